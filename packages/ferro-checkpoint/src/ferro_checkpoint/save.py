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

With ``backend=`` (any ferro_backend.Backend) the save is collective (``collective_save.py``):
rank 0 draws a random id and sends it to every rank, all ranks write and tell rank 0, rank 0
commits and sends every rank its verdict. A rank that refuses its save (a shard of the wrong
shape or dtype, a bad ``extra``, a write that failed) still takes part, telling rank 0 why, so
every rank raises at once (the others an error of its class naming that rank and its error)
and the next save works.

Without a backend, pass the same ``checkpoint_id`` on every rank, a new one for each save (its
step, say), or let the default number the saves (the contract's five-argument call): ``g<N+1>``,
N the larger of the directory's committed ``g<N>`` and the last default id this process saved
there as this rank (of this world size). A rank that runs ahead of its peers (its previous save
not committed yet: a peer still writes it) so takes a new id, and its shard of the pending save
stays until a peer commits it (``layout.remove_stale_tmp_shards``); a fresh process (every rank
restarting) starts after the committed one, the same on every rank. A save that failed on this
rank does not advance it: its retry reuses the id, right while every rank's saves succeed or fail
together. After a save that failed on some ranks only, a rank's next save can find a peer's shard
left by the failed attempt under its id and commit it with its own (a mix of two saves: ids are
all such ranks share, and nothing else tells the attempts apart). A save under the id of an
earlier attempt is that save: give each attempt its own id where their shards differ.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .collective_save import (
    agree_on_id,
    checkpoint_group,
    commit_for_all,
    save_number,
)
from .errors import (
    CheckpointIOError,
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

_LAST_DEFAULT: dict[tuple[str, int, int], int] = {}  # (directory, rank, world) -> last g<N>
_LAST_LOCK = threading.Lock()
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


def committed_generation(directory: Path) -> int:
    """N of the checkpoint ``g<N>`` committed in ``directory`` (0: none, or another id)."""
    try:
        current = ShardMetadata.from_json((directory / METADATA).read_text()).checkpoint_id
    except (OSError, ValueError):
        current = ""
    return int(current[1:]) if re.fullmatch(r"g\d+", current) else 0


def _default_key(directory: Path, rank: int, world_size: int) -> tuple[str, int, int]:
    try:
        where = str(directory.resolve())
    except OSError:
        where = os.path.abspath(directory)
    return where, rank, world_size


def _default_id(directory: Path, rank: int, world_size: int) -> str:
    """Without a backend or an explicit id: ``g<N+1>``, N the larger of the directory's
    committed generation and the last one this process saved there as this rank (of this
    world size): a rank that runs ahead (its previous save not committed yet, a peer still
    writing it) takes a new id, not the pending save's again."""
    last = _LAST_DEFAULT.get(_default_key(directory, rank, world_size), 0)
    return f"g{max(committed_generation(directory), last) + 1}"


def _saved_default(directory: Path, rank: int, world_size: int, ckpt_id: str) -> None:
    """This rank saved ``ckpt_id`` (a default id) into ``directory``: the next default is after
    it."""
    key = _default_key(directory, rank, world_size)
    with _LAST_LOCK:
        _LAST_DEFAULT[key] = max(_LAST_DEFAULT.get(key, 0), int(ckpt_id[1:]))


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
        (default: ``g<N+1>``, N the larger of the directory's committed ``g<N>`` and the last
        default id this process saved there as this rank; several ranks whose saves may fail
        apart pass a new id for each save, such as its step: see the module's notes).
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
    DistCheckpointError
        With a backend, any of the above on another rank (its class, naming that rank and its
        error), or the commit's on rank 0; the backend's errors where a peer does not answer.

    Examples
    --------
    >>> state = {"w": np.arange(4, dtype=np.float32)}  # this rank's flat shard
    >>> spec = flat_shard_metadata(state, world_size=2)
    >>> save_distributed(state, "ckpt", rank=0, world_size=2, shard_spec=spec,
    ...                  checkpoint_id="step100")  # committed once rank 1 saved too
    'step100'
    """
    if backend is None:
        directory, arrays, extra_json = _prepared(state_dict, directory, rank, world_size,
                                                  shard_spec, extra)
        default = checkpoint_id is None
        ckpt_id = _default_id(directory, rank, world_size) if default else checkpoint_id
        final = _write_shard(arrays, directory, rank, world_size, shard_spec, ckpt_id,
                             extra_json)
        if all_tmp_shards_written(directory, ckpt_id, world_size):
            _commit(directory, final)
        if default:
            _saved_default(directory, rank, world_size, ckpt_id)
        return ckpt_id
    # collective: numbered first (a save refused below counts too), and a rank that refuses
    # its save still takes part in the id's agreement and the commit's exchange, telling rank 0
    # why: every rank raises at once and no message of this save is left unread
    save = save_number(backend)
    group = checkpoint_group(backend)
    failure = final = None
    try:
        directory, arrays, extra_json = _prepared(state_dict, directory, rank, world_size,
                                                  shard_spec, extra)
    except Exception as exc:
        failure = exc
    ckpt_id = agree_on_id(group, save)
    if failure is None:
        try:
            final = _write_shard(arrays, directory, rank, world_size, shard_spec, ckpt_id,
                                 extra_json)
        except Exception as exc:
            failure = exc
    commit_for_all(group, lambda: _commit(directory, final, collective=True), save, failure)
    return ckpt_id


def _prepared(state_dict, directory, rank: int, world_size: int, shard_spec: ShardMetadata,
              extra) -> tuple[Path, dict[str, np.ndarray], str | None]:
    """The checks of a save, then its directory made and any save committed there before a
    crash finished (before the save picks its id or removes temp shards: it would reuse the
    id, or delete the committed save's shard)."""
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
    recover(directory)
    return directory, arrays, extra_json


def _write_shard(arrays: dict[str, np.ndarray], directory: Path, rank: int, world_size: int,
                 shard_spec: ShardMetadata, ckpt_id: str, extra_json: str | None
                 ) -> ShardMetadata:
    """Write this rank's temp shard of save ``ckpt_id`` durably; returns the save's record."""
    if not CHECKPOINT_ID_RE.fullmatch(ckpt_id):
        raise InvalidArgumentError(f"save_distributed: checkpoint_id {ckpt_id!r} must be "
                                   "letters, digits, '_' or '-'")
    try:
        remove_stale_tmp_shards(directory, rank, ckpt_id)
    except OSError as exc:
        raise CheckpointIOError(f"save_distributed: cannot remove rank {rank}'s stale temp "
                                f"shards in {directory}: {exc}") from exc
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
    try:
        fsync_dir(directory)
    except OSError as exc:
        raise CheckpointIOError(f"save_distributed: cannot make {directory} durable (fsync): "
                                f"{exc}") from exc
    return final
