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


def remove_stale_tmp_shards(directory: Path, rank: int, ckpt_id: str,
                            mine: Callable[[Path], bool] | None = None) -> None:
    """Delete rank ``rank``'s temp shards of saves other than ``ckpt_id`` and all its partly
    written ones (left by a crash before their commit). Only the rank that wrote them calls
    this, when it saves again. ``mine``: where given, only the temp shards it says are this
    job's go, and no partly written one (a manager built to restore must not delete the shard
    another job is saving)."""
    for p in Path(directory).iterdir():
        m = _TMP_SHARD_RE.fullmatch(p.name)
        if m and int(m.group(1)) == rank and m.group(2) != ckpt_id \
                and not commit_path(directory, m.group(2)).exists() \
                and (mine is None or mine(p)):  # (committed: recover's)
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
    commit point) stay until their rank saves again (:func:`remove_stale_tmp_shards`), and with
    no commit record present this only lists the directory. Every step is idempotent, so
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
        ckpt_id = _COMMIT_RE.fullmatch(record.name).group(1)
        try:
            meta = ShardMetadata.from_json(record.read_bytes(), source=str(record))
        except FileNotFoundError:
            continue  # another process finished it
        if not _rolls_forward(directory, meta, ckpt_id):
            continue  # a stray record (copied, or left by a crash of another save): not ours
        for r in range(meta.num_ranks):
            try:
                os.replace(tmp_shard_path(directory, r, ckpt_id), shard_path(directory, r))
            except FileNotFoundError:
                pass
        fsync_dir(directory)
        try:
            os.replace(record, directory / METADATA)
        except FileNotFoundError:
            continue
        fsync_dir(directory)
        for p in directory.iterdir():
            m = _SHARD_RE.fullmatch(p.name)
            if m and int(m.group(1)) >= meta.num_ranks:
                p.unlink(missing_ok=True)
