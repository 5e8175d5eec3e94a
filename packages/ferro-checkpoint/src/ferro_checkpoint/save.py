"""Saving: every shard durable before the commit record, the commit record last.

Protocol for a save with id ``I`` into directory ``D``:

1. Each rank draws a random 128-bit shard id ``S_r`` (uuid4), writes
   ``D/.rank_<r>.<I>.safetensors.part`` (tensor by tensor), fsyncs it, renames it to
   ``D/.rank_<r>.<I>.safetensors.tmp`` and fsyncs the directory, so a ``.tmp`` shard that
   exists is complete. Its header metadata carries ``I``, ``S_r``, the rank, the world size and
   the CRC-32C of every 1 MiB chunk of every tensor (computed in the pass that writes it).
2. When every shard is durable (after a barrier with a backend; without one, the rank that finds
   all shards present), one rank reads ``S_r`` from every temp shard's header and writes the
   commit record ``D/.commit.<I>.json`` (temp file, fsync, rename, directory fsync) holding them
   as ``shard_ids``. **This is the commit point.**
3. Roll forward (``layout.recover``): each temp shard is renamed to ``rank_<r>.safetensors``
   and the commit record to ``metadata.json``, each step idempotent. Every open of the
   checkpoint calls ``recover`` too, finishing a save that crashed after its commit point.

A crash before step 2 leaves the previous checkpoint untouched; after it, the new checkpoint is
complete and durable. Loading checks that every shard carries ``metadata.json``'s ``I`` and its
own ``S_r``, and its checksums, so shards of two saves are never silently mixed.

Why the shard ids need no agreement: ``I`` may repeat across saves (``step<n>`` in two runs,
``g1`` in two directories), but each ``S_r`` is drawn by the one rank that writes shard ``r``
and is read back from that very file by the committer, so metadata.json names exactly the
files it commits; a file of any other save carries another ``S_r`` (a 2**-128 collision
aside). Two ranks committing at once read the same headers and write the same record; a
committer that finds a temp shard already renamed leaves the commit to the one that did.

With ``backend=`` (any ferro_backend.Backend) the save is collective: rank 0 draws a random id
and sends it to every rank, all ranks write, barrier, rank 0 commits, barrier. Without one, pass
the same ``checkpoint_id`` on every rank, a new one for each save (its step, say). The default,
``g<N+1>`` after the directory's committed ``g<N>`` (the contract's five-argument call), is
right while every rank's saves succeed or fail together; it is the same for a save and its
retry, so after a save that failed on some ranks only, a rank's next save can find a peer's
shard left by the failed attempt under its id and commit it with its own (a mix of two saves:
ids are all such ranks share, and nothing else tells the attempts apart). A save under the id of
an earlier attempt is that save: give each attempt its own id where their shards differ.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import os
import re
import sys
import uuid
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from . import errors
from .errors import (
    CheckpointIOError,
    DistCheckpointError,
    InvalidArgumentError,
    MissingShardError,
    ShardMismatchError,
    TensorError,
)
from .layout import (
    CHECKPOINT_ID_RE,
    METADATA,
    all_tmp_shards_written,
    commit_path,
    fsync_dir,
    part_shard_path,
    recover,
    remove_quietly,
    remove_stale_tmp_shards,
    tmp_shard_path,
    write_json_durably,
)
from .metadata import ShardMetadata, TensorShardSpec, check_rank_world
from .safetensors_io import (
    CHECKPOINT_ID_KEY,
    EXTRA_CRC_KEY,
    EXTRA_KEY,
    SHARD_ID_KEY,
    SafetensorsFile,
    dtype_code,
    extra_crc,
    write_safetensors,
)

_TAGS = (1 << 30) + 7  # user-range tags (on a private subgroup): three a save, by its number
_SAVES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> saves begun
_SAVES_BY_ID: dict[int, int] = {}


def next_save(backend) -> int:
    """The number of this collective save on ``backend`` (every rank begins its saves in one
    order): its messages' tags, so that one save's messages never meet another's (a failed
    save's unread id, or two checkpointers' saves in flight at once)."""
    try:
        k = _SAVES.get(backend, 0)
        _SAVES[backend] = k + 1
    except TypeError:  # a backend that takes no weak reference (an outside transport's)
        k = _SAVES_BY_ID.get(id(backend), 0)
        _SAVES_BY_ID[id(backend)] = k + 1
    return k


#: the number a checkpointer or manager took for the save its thread runs (:func:`numbered`)
_NUMBER: contextvars.ContextVar[int | None] = contextvars.ContextVar("ferro_checkpoint_save",
                                                                      default=None)


@contextlib.contextmanager
def numbered(number: int | None) -> Iterator[None]:
    """Within the block, a collective :func:`save_distributed` takes ``number`` (taken by
    :func:`next_save` in the program's order when the save was asked for, not when a
    background thread runs it) instead of the next one."""
    token = _NUMBER.set(number)
    try:
        yield
    finally:
        _NUMBER.reset(token)


def _tag(save: int, what: int) -> int:
    """The tag of a save's id (0), its ranks' "written" (1) and rank 0's verdict (2)."""
    return _TAGS + 3 * (save % (1 << 20)) + what
_VERDICT_BYTES = 1024  # its size: a flag byte, then the error's class and message
#: a shard header's digest of what its rank's save would commit (:func:`meta_digest`)
SPEC_KEY = "ferro.spec"


def _checked_arrays(state_dict: Mapping[str, np.ndarray], rank: int, spec: ShardMetadata
                    ) -> dict[str, np.ndarray]:
    """This rank's tensors as arrays, after checking names, shapes and dtypes against ``spec``."""
    for name in state_dict:
        if not isinstance(name, str) or name == "__metadata__":
            raise TensorError(f"save_distributed: rank {rank}'s state dict names a tensor "
                              f"{name!r}: names are str, and '__metadata__' is safetensors' "
                              "own header entry")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: no other safetensors reader opens it
            raise TensorError(f"save_distributed: rank {rank}'s state dict names a tensor "
                              f"{name!r}, which is not valid Unicode (a lone surrogate)") from None
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


def encode_extra(extra: Mapping | None, op: str) -> str | None:
    """``extra`` as JSON text (None stays None); InvalidArgumentError if it is not a JSON dict."""
    if extra is None:
        return None
    if not isinstance(extra, Mapping):
        raise InvalidArgumentError(f"{op}: extra must be a dict, not {type(extra).__name__}")
    try:
        return json.dumps(dict(extra), allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{op}: extra is not JSON-serializable: {exc}") from exc


def _checkpoint_group(backend):
    """The private subgroup of all ranks the save's messages travel on."""
    from ferro_backend import SubBackend

    return SubBackend(backend, range(backend.world_size), name="ferro-checkpoint")


def _agree_on_id(backend, save: int) -> str:
    """Rank 0 draws a random id and sends it to every rank."""
    group = _checkpoint_group(backend)
    buf = bytearray(32)
    if group.rank == 0:
        buf[:] = uuid.uuid4().hex.encode()
        for r in range(1, group.world_size):
            group.send(buf, r, tag=_tag(save, 0))
    else:
        group.recv(buf, 0, tag=_tag(save, 0))
    return buf.decode()


def committed_generation(directory: Path) -> int:
    """N of the checkpoint ``g<N>`` committed in ``directory`` (0: none, or another id)."""
    try:
        current = ShardMetadata.from_json((directory / METADATA).read_text()).checkpoint_id
    except (OSError, ValueError):
        current = ""
    return int(current[1:]) if re.fullmatch(r"g\d+", current) else 0


def _default_id(directory: Path) -> str:
    """Without a backend or an explicit id: 'g<N+1>' after the committed generation N."""
    return f"g{committed_generation(directory) + 1}"


def _shard_disagreement(header: SafetensorsFile, rank: int, meta: ShardMetadata) -> str | None:
    """What rank ``rank``'s temp shard holds that ``meta`` (the committer's record) does not
    say: a save whose ranks passed different specs, names or dtypes must not commit."""
    digest = header.metadata.get(SPEC_KEY)
    if digest == meta_digest(meta):
        return None
    got = {n: (code, shape) for n, (code, shape, _, _) in header.entries.items()}
    want = {n: (s.dtype, s.shard_shape(rank)) for n, s in meta.tensor_specs.items()}
    for name in sorted(set(got) | set(want)):
        if got.get(name) != want.get(name):
            def say(e):
                return "no such tensor" if e is None else f"{e[0]}{tuple(e[1])}"
            return (f"its tensor {name!r} is {say(got.get(name))}, the committing rank's "
                    f"spec and dtypes make it {say(want.get(name))}")
    if digest is None:
        return None  # (no digest to compare: its tensors agree)
    return "its shard spec (full shapes, shard dims or sizes) differs from the committing rank's"


def _tmp_shard_ids(directory: Path, meta: ShardMetadata) -> tuple[str, ...] | None:
    """Every rank's shard id, read from its temp shard's header; None if one was already
    renamed (another rank committed this save). TensorError where a shard disagrees with
    ``meta`` (nothing is committed; the previous checkpoint stays)."""
    ids, ckpt_id = [], meta.checkpoint_id
    for r in range(meta.num_ranks):
        path = tmp_shard_path(directory, r, ckpt_id)
        try:
            shard = SafetensorsFile(path)
        except FileNotFoundError:
            return None
        header = shard.metadata
        got = header.get(SHARD_ID_KEY)
        if got is None or header.get(CHECKPOINT_ID_KEY) != ckpt_id:
            raise ShardMismatchError(
                f"save_distributed: {path} carries checkpoint id "
                f"{header.get(CHECKPOINT_ID_KEY)!r} and shard id {got!r}, expected "
                f"checkpoint id {ckpt_id!r} and a shard id; not committing")
        differs = _shard_disagreement(shard, r, meta)
        if differs is not None:
            raise TensorError(f"save_distributed: the ranks disagree on what they save: "
                              f"rank {r}'s shard {path}: {differs}; not committing (the "
                              f"previous checkpoint in {directory} stays)")
        ids.append(got)
    return tuple(ids)


def meta_digest(meta: ShardMetadata) -> str:
    """A digest of what a save commits (id, world size, every tensor's spec and dtype; no shard
    ids): each rank writes its own into its shard header, so the committer sees any rank whose
    spec or dtypes differ from its own."""
    return hashlib.sha256(ShardMetadata(meta.num_ranks, meta.tensor_specs,
                                        meta.checkpoint_id).to_json().encode()).hexdigest()[:32]


def _commit(directory: Path, meta: ShardMetadata, collective: bool = False) -> None:
    """Write the commit record with every shard's id (the commit point), then roll the save
    forward. ``collective``: rank 0 commits once every rank said its shard is written, so a
    temp shard missing is an error (not another rank's commit)."""
    ids = _tmp_shard_ids(directory, meta)
    if ids is None and collective:
        raise MissingShardError(
            f"save_distributed: a temp shard of save {meta.checkpoint_id!r} is missing from "
            f"{directory} after every rank wrote its own (another process removed it, or the "
            "ranks see different directories); not committing")
    if ids is not None:
        meta.shard_ids = ids
        write_json_durably(commit_path(directory, meta.checkpoint_id), meta.to_json())
    recover(directory)


def _commit_for_all(group, directory: Path, meta: ShardMetadata, save: int) -> None:
    """Every rank tells rank 0 of ``group`` that its shard is written; rank 0 commits and sends
    every rank its verdict (the save's barrier, on the save's own tags): a commit refused or
    failed raises the same error on every rank, not on rank 0 alone while the others wait for
    a barrier's deadline."""
    verdict = bytearray(_VERDICT_BYTES)
    if group.rank == 0:
        written = bytearray(1)
        for r in range(1, group.world_size):
            group.recv(written, r, tag=_tag(save, 1))
        failure = None
        try:
            _commit(directory, meta, collective=True)
        except DistCheckpointError as exc:
            failure = exc
            said = f"{type(exc).__name__}:{exc}".encode()[:_VERDICT_BYTES - 1]
            verdict[:len(said) + 1] = b"\x01" + said
        for r in range(1, group.world_size):
            group.send(verdict, r, tag=_tag(save, 2))
        if failure is not None:
            raise failure
        return
    group.send(bytearray(b"\x01"), 0, tag=_tag(save, 1))
    group.recv(verdict, 0, tag=_tag(save, 2))
    if verdict[0]:
        kind, _, message = bytes(verdict[1:]).rstrip(b"\x00").decode(errors="replace") \
            .partition(":")
        raise getattr(errors, kind, DistCheckpointError)(f"{message} (rank 0's commit)")


def _on_timeline(name: str):
    """Put each call on ferro-backend's timeline (``ferro_backend.trace``) when that layer is
    loaded and tracing; this layer imports nothing of it (it needs only numpy)."""
    def wrap(fn):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            timeline = sys.modules.get("ferro_backend.timeline")
            if timeline is None or not timeline.active():
                return fn(*args, **kwargs)
            with timeline.span(name, "checkpoint", directory=str(args[1] if len(args) > 1
                                                                   else kwargs.get("directory"))):
                return fn(*args, **kwargs)
        return traced
    return wrap


@_on_timeline("checkpoint.save")
def save_distributed(state_dict: Mapping[str, np.ndarray], directory, rank: int,
                     world_size: int, shard_spec: ShardMetadata, *, backend=None,
                     checkpoint_id: str | None = None, extra: Mapping | None = None) -> str:
    """Save this rank's shards of a distributed checkpoint; returns the checkpoint id.

    Parameters
    ----------
    state_dict : mapping of str to numpy.ndarray
        This rank's tensors, each of shape ``shard_spec.tensor_specs[name].shard_shape(rank)``;
        any mix of float16/32/64, int8..int64, uint8..uint64, bool (and bfloat16 with ml_dtypes).
    directory : str or os.PathLike
        Created if needed. Holds ``rank_<r>.safetensors`` and ``metadata.json`` once committed.
    rank, world_size : int
        This rank and the number of ranks saving (``shard_spec.num_ranks``).
    shard_spec : ShardMetadata
        How every tensor is sharded (e.g. :func:`flat_shard_metadata`).
    backend : ferro_backend.Backend, optional
        Makes the save collective and crash-safe across ranks.
    checkpoint_id : str, optional
        Id shared by all ranks of this save (letters, digits, ``_``, ``-``), without a backend
        (default: ``g<N+1>`` after the directory's committed ``g<N>``; several ranks whose saves
        may fail apart pass a new id for each save, such as its step: see the module's notes).
        Ignored with a backend.
    extra : mapping, optional
        A JSON-serializable dict stored in this rank's shard header (key ``ferro.extra``),
        so it is committed atomically with the shard; read it back with
        :meth:`DistributedCheckpoint.extra`.

    Returns
    -------
    str
        The checkpoint id (the random one agreed with a backend).

    Raises
    ------
    InvalidArgumentError
        A bad rank, world size, ``checkpoint_id`` or ``extra``, or a spec of another world size.
    TensorError
        The state dict's names, shapes or dtypes do not match ``shard_spec``.
    CheckpointIOError
        The directory or the shard cannot be written.
    ShardMismatchError
        The committing rank found a temp shard of another save.

    Examples
    --------
    >>> state = {"w": np.arange(4, dtype=np.float32)}  # this rank's flat shard
    >>> spec = flat_shard_metadata(state, world_size=2)
    >>> save_distributed(state, "ckpt", rank=0, world_size=2, shard_spec=spec,
    ...                  checkpoint_id="step100")  # committed once rank 1 saved too
    'step100'
    """
    _save = _NUMBER.get() if backend is not None else None  # (numbered by its caller)
    if backend is not None and _save is None:  # (first: a save refused below counts too)
        _save = next_save(backend)
    rank, world_size = check_rank_world("save_distributed", rank, world_size)
    if shard_spec.num_ranks != world_size:
        raise InvalidArgumentError(f"save_distributed: shard_spec.num_ranks "
                                   f"{shard_spec.num_ranks} != world_size {world_size}")
    arrays = _checked_arrays(state_dict, rank, shard_spec)
    extra_json = encode_extra(extra, "save_distributed")
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointIOError(f"save_distributed: cannot create {directory}: {exc}") from exc
    # a save that crashed past its commit point is finished before this one picks its id or
    # removes temp shards (it would reuse the id, or delete the committed save's shard)
    recover(directory)
    if backend is not None:
        ckpt_id = _agree_on_id(backend, _save)
    else:
        ckpt_id = checkpoint_id or _default_id(directory)
    if not CHECKPOINT_ID_RE.fullmatch(ckpt_id):
        raise InvalidArgumentError(f"save_distributed: checkpoint_id {ckpt_id!r} must be "
                                   "letters, digits, '_' or '-'")
    remove_stale_tmp_shards(directory, rank, ckpt_id)
    # widest items first: every tensor then starts at a multiple of its item size, so zero-copy
    # loads (mmap=True) get aligned arrays
    names = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    specs = {n: TensorShardSpec(s.full_shape, s.shard_dim, s.shard_sizes,
                                dtype_code(arrays[n].dtype, n))
             for n, s in shard_spec.tensor_specs.items()}
    final = ShardMetadata(world_size, specs, ckpt_id)
    meta = {CHECKPOINT_ID_KEY: ckpt_id, SHARD_ID_KEY: uuid.uuid4().hex, "ferro.rank": str(rank),
            "ferro.world_size": str(world_size), SPEC_KEY: meta_digest(final)}
    if extra_json is not None:
        meta[EXTRA_KEY] = extra_json
        meta[EXTRA_CRC_KEY] = extra_crc(extra_json)
    part = part_shard_path(directory, rank, ckpt_id)
    try:
        write_safetensors(part, [(n, dtype_code(arrays[n].dtype, n), arrays[n].shape)
                                 for n in names], arrays.__getitem__, meta)
        os.replace(part, tmp_shard_path(directory, rank, ckpt_id))
    except BaseException as exc:
        remove_quietly(part)  # (an error of its own must not replace this one)
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointIOError):
            raise CheckpointIOError(f"save_distributed: cannot write {part}: {exc}") from exc
        raise
    fsync_dir(directory)
    if backend is not None:
        _commit_for_all(_checkpoint_group(backend), directory, final, _save)
    elif all_tmp_shards_written(directory, ckpt_id, world_size):
        _commit(directory, final)
    return ckpt_id
