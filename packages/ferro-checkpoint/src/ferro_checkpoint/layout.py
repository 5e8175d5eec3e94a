"""A checkpoint directory's files, their durable transitions, and crash recovery.

Save and load both use this module; it is the one place that knows the file names.

Files of a checkpoint directory ``D`` (``<id>``: letters, digits, ``_``, ``-``):

- ``D/metadata.json``: the committed checkpoint's metadata (schema in ``metadata.py``).
- ``D/rank_<r>.safetensors``: rank ``r``'s committed shard.
- ``D/.rank_<r>.<id>.safetensors.part.<pid>-<thread>``: rank ``r``'s shard of save ``<id>``
  while the writer (that process and thread) writes it; renamed to the ``.tmp`` name below only
  once complete and fsynced, so a ``.tmp`` shard that exists is always whole (another rank may
  read its header to commit the save). Each writer has a file of its own: two saves of one id
  at once (two jobs in one directory, a misuse) never write into one file.
- ``D/.rank_<r>.<id>.safetensors.tmp``: rank ``r``'s shard of save ``<id>``, not yet renamed.
- ``D/.commit.<id>.json``: the commit record of save ``<id>``: once it exists, save ``<id>`` is
  committed, and :func:`recover` finishes it.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

from .errors import CheckpointIOError, DistCheckpointError
from .metadata import ShardMetadata

METADATA = "metadata.json"
CHECKPOINT_ID_RE = re.compile(r"[0-9A-Za-z_-]+")
_SHARD_RE = re.compile(r"rank_(\d+)\.safetensors")
_TMP_SHARD_RE = re.compile(r"\.rank_(\d+)\.([0-9A-Za-z_-]+)\.safetensors\.tmp")
_PART_SHARD_RE = re.compile(r"\.rank_(\d+)\.([0-9A-Za-z_-]+)\.safetensors\.part(?:\.\d+-\d+)?")
_COMMIT_RE = re.compile(r"\.commit\.([0-9A-Za-z_-]+)\.json")
_WRITING_RE = re.compile(r"(?:metadata|\.commit\.[0-9A-Za-z_-]+)\.json\.part\.\d+\.\d+")


def is_checkpoint_file(name: str) -> bool:
    """Whether a file named ``name`` is one of this module's (a checkpoint directory's)."""
    return name == METADATA or any(r.fullmatch(name) for r in (
        _SHARD_RE, _TMP_SHARD_RE, _PART_SHARD_RE, _COMMIT_RE, _WRITING_RE))


def shard_path(directory: Path, rank: int) -> Path:
    """``D/rank_<rank>.safetensors``: a committed shard."""
    return Path(directory) / f"rank_{rank}.safetensors"


def tmp_shard_path(directory: Path, rank: int, ckpt_id: str) -> Path:
    """``D/.rank_<rank>.<id>.safetensors.tmp``: a shard written but not yet committed."""
    return Path(directory) / f".rank_{rank}.{ckpt_id}.safetensors.tmp"


def part_shard_path(directory: Path, rank: int, ckpt_id: str) -> Path:
    """``D/.rank_<rank>.<id>.safetensors.part.<pid>-<thread>``: a shard this process and
    thread write (before 0.4 without the suffix: still recognized as one)."""
    return Path(directory) / (f".rank_{rank}.{ckpt_id}.safetensors.part."
                              f"{os.getpid()}-{threading.get_ident()}")


def commit_path(directory: Path, ckpt_id: str) -> Path:
    """``D/.commit.<id>.json``: the commit record of save ``<id>``."""
    return Path(directory) / f".commit.{ckpt_id}.json"


def fsync_dir(path: Path) -> None:
    """Make the renames and creations in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quietly(path: Path) -> None:
    """Delete ``path`` if it exists, ignoring any error: cleanup after a failure, which must
    never replace the error being reported (a read-only or full disk refuses the unlink too)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def write_json_durably(path: Path, text: str) -> None:
    """Write ``path`` atomically and durably: temp file, fsync, rename, directory fsync.

    On failure (a full or read-only disk) the temp file is removed and CheckpointIOError, naming
    ``path``, is raised; ``path`` itself is untouched unless the rename happened.
    """
    tmp = path.with_name(f"{path.name}.part.{os.getpid()}.{threading.get_ident()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        remove_quietly(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointIOError):
            raise CheckpointIOError(f"cannot write {path}: {exc}") from exc
        raise
    try:
        fsync_dir(path.parent)
    except OSError as exc:
        raise CheckpointIOError(f"cannot make {path} durable (fsync of its directory): "
                                f"{exc}") from exc


def all_tmp_shards_written(directory: Path, ckpt_id: str, world_size: int) -> bool:
    return all(tmp_shard_path(directory, r, ckpt_id).exists() for r in range(world_size))


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def superseded_since(directory: Path, rank: int) -> int | None:
    """When rank ``rank``'s part of the committed checkpoint was written (its committed shard's
    modification time, kept by the renames; ``metadata.json``'s where that checkpoint has no
    such rank), or None if nothing is committed: a temp shard of this rank written before it is
    of a save that can no longer commit (see :func:`remove_stale_tmp_shards`)."""
    directory = Path(directory)
    if _mtime_ns(directory / METADATA) is None:
        return None
    mine = _mtime_ns(shard_path(directory, rank))
    return mine if mine is not None else _mtime_ns(directory / METADATA)


def _committed_id(directory: Path) -> str | None:
    try:
        return ShardMetadata.from_json((directory / METADATA).read_bytes()).checkpoint_id
    except (OSError, ValueError):
        return None


def remove_stale_tmp_shards(directory: Path, rank: int, ckpt_id: str,
                            mine: Callable[[Path], bool] | None = None) -> None:
    """Delete rank ``rank``'s temp shards that no commit can use any more, and all its partly
    written ones (left by a crash or a failed write). Only the rank that wrote them calls this,
    when it saves again.

    A complete temp shard of another save than ``ckpt_id`` (without a commit record: a
    committed one is :func:`recover`'s) is stale once the committed checkpoint's shard of this
    rank was written after it (:func:`superseded_since`): every rank saves in one order, so the
    committed save's ranks all wrote that save's shards, and none will save the older one again.
    A temp shard of the committed save's own id is stale too (another attempt at a save that is
    committed: a failed save's retry, whose peer committed the first attempt's shard). Any other
    is kept: without a backend a peer may still be writing that save (this rank ran ahead, its
    shard of the previous save not committed yet), and the peer's save commits it. Leftovers of
    a crash or of a failed save therefore go at this rank's first save after the next commit.
    ``mine``: where given (a new manager's cleanup of a crash), every
    complete temp shard of this rank that it says is this job's goes, whenever written, and no
    partly written one (a manager built to restore must not delete the shard another job is
    saving).
    """
    directory = Path(directory)
    since = superseded_since(directory, rank) if mine is None else None
    done = _committed_id(directory) if since is not None else None
    for p in directory.iterdir():
        m = _TMP_SHARD_RE.fullmatch(p.name)
        if m and int(m.group(1)) == rank and m.group(2) != ckpt_id \
                and not commit_path(directory, m.group(2)).exists():  # (committed: recover's)
            if mine is None:
                written = _mtime_ns(p)
                stale = m.group(2) == done or (since is not None and written is not None
                                               and written < since)
            else:
                stale = mine(p)
            if stale:
                p.unlink(missing_ok=True)
        m = _PART_SHARD_RE.fullmatch(p.name)
        if m and int(m.group(1)) == rank and mine is None:
            p.unlink(missing_ok=True)


def _rolls_forward(directory: Path, meta: ShardMetadata, ckpt_id: str) -> bool:
    """Whether commit record ``meta`` (of ``ckpt_id``) names shards that are here: each rank's
    temp shard, or its shard already renamed (its header carries the recorded shard id). A
    record whose shards are gone was rolled forward over a good ``metadata.json`` before, and
    no load worked after it."""
    from .safetensors_io import CHECKPOINT_ID_KEY, SHARD_ID_KEY, SafetensorsFile

    for r in range(meta.num_ranks):
        if tmp_shard_path(directory, r, ckpt_id).exists():
            continue
        if not meta.shard_ids:
            return False
        try:
            header = SafetensorsFile(shard_path(directory, r)).metadata
        except (OSError, ValueError, DistCheckpointError):
            return False
        if header.get(SHARD_ID_KEY) != meta.shard_ids[r] or \
                header.get(CHECKPOINT_ID_KEY) != ckpt_id:
            return False
    return True


def recover(directory: Path) -> None:
    """Finish every committed save in ``directory`` whose files were not all renamed yet.

    A save is committed once its commit record ``.commit.<id>.json`` exists. For each commit
    record, oldest first (by modification time), this

    1. renames ``.rank_<r>.<id>.safetensors.tmp`` to ``rank_<r>.safetensors`` for every rank
       ``r`` of that save (replacing the previous checkpoint's shard; a temp shard already
       renamed is skipped), then fsyncs the directory;
    2. renames the commit record to ``metadata.json`` (replacing the previous one) and fsyncs
       the directory;
    3. deletes ``rank_<r>.safetensors`` for every ``r >= num_ranks`` of that save (shards of an
       older checkpoint saved by more ranks).

    Nothing else is touched: temp shards of saves without a commit record (a crash before the
    commit point, or a save still waiting for a peer) stay until their rank saves again after a
    newer commit (:func:`remove_stale_tmp_shards`), and with no commit record present this only
    lists the directory. A rename or fsync refused (a read-only disk) raises CheckpointIOError
    naming the directory: finishing the committed save needs write access. Every step is idempotent, so
    concurrent or repeated calls, and a crash during one, are safe.

    Called by every save before it picks its id and removes its stale temp shards (so a
    committed save is never overwritten nor deleted as stale) and right after it writes its
    commit record, and by every open of a
    checkpoint (``open_checkpoint``, hence ``load_distributed``, ``reshard``, ``consolidate``)
    before it reads ``metadata.json``: a save that crashed after its commit point is finished
    by the next open, which therefore needs write access to the directory in that case.
    """
    directory = Path(directory)

    def mtime(p: Path) -> int:
        try:
            return p.stat().st_mtime_ns
        except FileNotFoundError:
            return 0

    records = sorted((p for p in directory.iterdir() if _COMMIT_RE.fullmatch(p.name)), key=mtime)
    for record in records:
        try:
            _roll_forward(directory, record)
        except FileNotFoundError:
            raise  # (the directory deleted meanwhile: its callers' case)
        except OSError as exc:
            if isinstance(exc, CheckpointIOError):
                raise
            raise CheckpointIOError(
                f"cannot finish the save committed in {directory} ({record.name}, written "
                f"before a crash or by a save still running): {exc}; finishing the committed "
                f"save needs write access to {directory}") from exc


def _roll_forward(directory: Path, record: Path) -> None:
    """:func:`recover`'s steps for one commit record."""
    ckpt_id = _COMMIT_RE.fullmatch(record.name).group(1)
    try:
        meta = ShardMetadata.from_json(record.read_bytes(), source=str(record))
    except FileNotFoundError:
        return  # another process finished it
    if not _rolls_forward(directory, meta, ckpt_id):
        return  # a stray record (copied, or left by a crash of another save): not ours
    for r in range(meta.num_ranks):
        try:
            os.replace(tmp_shard_path(directory, r, ckpt_id), shard_path(directory, r))
        except FileNotFoundError:
            pass
    fsync_dir(directory)
    try:
        os.replace(record, directory / METADATA)
    except FileNotFoundError:
        return
    fsync_dir(directory)
    for p in directory.iterdir():
        m = _SHARD_RE.fullmatch(p.name)
        if m and int(m.group(1)) >= meta.num_ranks:
            p.unlink(missing_ok=True)
