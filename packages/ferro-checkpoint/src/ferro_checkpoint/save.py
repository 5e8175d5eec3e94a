"""Saving: every shard durable before the commit record, the commit record last.

Protocol for a save with id ``I`` into directory ``D``:

1. Each rank writes ``D/.rank_<r>.<I>.safetensors.tmp`` (tensor by tensor), fsyncs it and the
   directory. Its header metadata carries ``I``, the rank, the world size and a crc32 per tensor.
2. When every shard is durable (after a barrier with a backend; without one, the rank that finds
   all shards present), one rank writes the commit record ``D/.commit.<I>.json`` (temp file,
   fsync, rename, directory fsync). **This is the commit point.**
3. Roll forward: each temp shard is renamed to ``rank_<r>.safetensors`` and the commit record
   to ``metadata.json`` (each step idempotent; ``open_checkpoint`` finishes it after a crash).

A crash before step 2 leaves the previous checkpoint untouched; after it, the new checkpoint is
complete and durable. Loading checks that every shard carries ``metadata.json``'s id and its
checksums, so shards of two saves are never silently mixed.

With ``backend=`` (any ferro_backend.Backend) the save is collective: rank 0 draws a random id
and sends it to every rank, all ranks write, barrier, rank 0 commits, barrier. Without one, pass
the same ``checkpoint_id`` on every rank (a default derived from the directory's last commit is
used otherwise; a crashed save's leftovers are then only safe once every rank saved again).
"""

from __future__ import annotations

import os
import re
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .errors import CheckpointIOError, InvalidArgumentError, TensorError
from .format import crc32, dtype_code, fsync_dir, little_endian, write_safetensors
from .metadata import ShardMetadata, TensorShardSpec

METADATA = "metadata.json"
_TMP_RE = re.compile(r"^\.rank_(\d+)\.([0-9A-Za-z_-]+)\.safetensors\.tmp$")
_COMMIT_RE = re.compile(r"^\.commit\.([0-9A-Za-z_-]+)\.json$")
_ID_TAG = (1 << 30) + 7  # user-range tag for the checkpoint id (on a private subgroup)


def shard_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank_{rank}.safetensors"


def tmp_shard_path(directory: Path, rank: int, ckpt_id: str) -> Path:
    return Path(directory) / f".rank_{rank}.{ckpt_id}.safetensors.tmp"


def commit_path(directory: Path, ckpt_id: str) -> Path:
    return Path(directory) / f".commit.{ckpt_id}.json"


def check_rank_world(op: str, rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"{op}: world_size {world_size!r} must be >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"{op}: rank {rank!r} is out of range for world_size "
                                   f"{world_size}")


def _validate(state_dict: Mapping[str, np.ndarray], rank: int, spec: ShardMetadata
              ) -> dict[str, np.ndarray]:
    names, expected = set(state_dict), set(spec.tensor_specs)
    if names != expected:
        raise TensorError(f"save_distributed: rank {rank}'s state dict has tensors "
                          f"{sorted(names - expected)} not in the shard spec and lacks "
                          f"{sorted(expected - names)}")
    arrays = {}
    for name, t in state_dict.items():
        a = np.asarray(t)
        want = spec.tensor_specs[name].shard_shape(rank)
        if a.shape != want:
            raise TensorError(f"save_distributed: rank {rank}'s tensor {name!r} has shape "
                              f"{a.shape}, its shard spec expects {want}")
        dtype_code(a.dtype, name)
        arrays[name] = a
    return arrays


def _agree_on_id(backend, rank: int, world_size: int) -> str:
    from ferro_backend import SubBackend

    group = SubBackend(backend, range(backend.world_size), name="ferro-checkpoint")
    buf = bytearray(32)
    if group.rank == 0:
        buf[:] = uuid.uuid4().hex.encode()
        for r in range(1, group.world_size):
            group.send(buf, r, tag=_ID_TAG)
    else:
        group.recv(buf, 0, tag=_ID_TAG)
    return buf.decode()


def _default_id(directory: Path) -> str:
    """Without a backend or an explicit id: 'g<N+1>' after the committed generation N."""
    try:
        current = ShardMetadata.from_json((directory / METADATA).read_text()).checkpoint_id
    except (OSError, ValueError):
        current = ""
    n = int(current[1:]) if re.fullmatch(r"g\d+", current) else 0
    return f"g{n + 1}"


def _write_json_durably(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.part.{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def roll_forward(directory: Path) -> None:
    """Finish any committed-but-not-renamed save (idempotent, safe after a crash)."""
    directory = Path(directory)
    def mtime(p: Path) -> int:
        try:
            return p.stat().st_mtime_ns
        except FileNotFoundError:
            return 0

    records = sorted((p for p in directory.iterdir() if _COMMIT_RE.match(p.name)), key=mtime)
    for record in records:
        ckpt_id = _COMMIT_RE.match(record.name).group(1)
        try:
            meta = ShardMetadata.from_json(record.read_text(), source=str(record))
        except FileNotFoundError:
            continue  # another process finished it
        for r in range(meta.num_ranks):
            tmp = tmp_shard_path(directory, r, ckpt_id)
            try:
                os.replace(tmp, shard_path(directory, r))
            except FileNotFoundError:
                pass
        fsync_dir(directory)
        try:
            os.replace(record, directory / METADATA)
        except FileNotFoundError:
            continue
        fsync_dir(directory)
        for p in directory.iterdir():  # shards of a larger, older world
            m = re.fullmatch(r"rank_(\d+)\.safetensors", p.name)
            if m and int(m.group(1)) >= meta.num_ranks:
                p.unlink(missing_ok=True)


def _commit(directory: Path, meta: ShardMetadata) -> None:
    _write_json_durably(commit_path(directory, meta.checkpoint_id), meta.to_json())
    roll_forward(directory)


def _all_shards_written(directory: Path, ckpt_id: str, world_size: int) -> bool:
    return all(tmp_shard_path(directory, r, ckpt_id).exists() for r in range(world_size))


def save_distributed(state_dict: Mapping[str, np.ndarray], directory, rank: int,
                     world_size: int, shard_spec: ShardMetadata, *, backend=None,
                     checkpoint_id: str | None = None) -> str:
    """Save this rank's shards of a distributed checkpoint; returns the checkpoint id.

    Parameters
    ----------
    state_dict
        This rank's tensors, each of shape ``shard_spec.tensor_specs[name].shard_shape(rank)``;
        any mix of float16/32/64, int8..int64, uint8..uint64, bool (and bfloat16 with ml_dtypes).
    directory
        Created if needed. Holds ``rank_<r>.safetensors`` and ``metadata.json`` once committed.
    rank, world_size
        This rank and the number of ranks saving (``shard_spec.num_ranks``).
    shard_spec
        How every tensor is sharded (e.g. :func:`flat_shard_metadata`).
    backend
        Optional ferro_backend.Backend: makes the save collective and crash-safe across ranks.
    checkpoint_id
        Id shared by all ranks of this save (letters, digits, ``_``, ``-``), without a backend.

    Raises
    ------
    InvalidArgumentError, TensorError, CheckpointIOError
    """
    check_rank_world("save_distributed", rank, world_size)
    if shard_spec.num_ranks != world_size:
        raise InvalidArgumentError(f"save_distributed: shard_spec.num_ranks "
                                   f"{shard_spec.num_ranks} != world_size {world_size}")
    arrays = _validate(state_dict, rank, shard_spec)
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointIOError(f"save_distributed: cannot create {directory}: {exc}") from exc
    if backend is not None:
        ckpt_id = _agree_on_id(backend, rank, world_size)
    else:
        ckpt_id = checkpoint_id or _default_id(directory)
    if not re.fullmatch(r"[0-9A-Za-z_-]+", ckpt_id):
        raise InvalidArgumentError(f"save_distributed: checkpoint_id {ckpt_id!r} must be "
                                   "letters, digits, '_' or '-'")
    # this rank's leftovers of crashed saves
    for p in directory.iterdir():
        m = _TMP_RE.match(p.name)
        if m and int(m.group(1)) == rank and m.group(2) != ckpt_id:
            p.unlink(missing_ok=True)
    names = sorted(arrays)
    le = {n: little_endian(arrays[n]) for n in names}
    meta = {"ferro.checkpoint_id": ckpt_id, "ferro.rank": str(rank),
            "ferro.world_size": str(world_size)}
    meta.update({f"ferro.crc32.{n}": crc32(le[n]) for n in names})
    write_safetensors(tmp_shard_path(directory, rank, ckpt_id),
                      [(n, dtype_code(le[n].dtype, n), le[n].shape) for n in names],
                      le.__getitem__, meta)
    fsync_dir(directory)
    specs = {n: TensorShardSpec(s.full_shape, s.shard_dim, s.shard_sizes,
                                dtype_code(arrays[n].dtype, n))
             for n, s in shard_spec.tensor_specs.items()}
    final = ShardMetadata(world_size, specs, ckpt_id)
    if backend is not None:
        from ferro_backend import SubBackend

        group = SubBackend(backend, range(backend.world_size), name="ferro-checkpoint")
        group.barrier()
        if rank == 0:
            _commit(directory, final)
        group.barrier()
    elif _all_shards_written(directory, ckpt_id, world_size):
        _commit(directory, final)
    return ckpt_id
