"""Loading: this rank's shard when the world size is unchanged, a memory-bounded reshard
otherwise. Every shard used is checked against metadata.json (the save's identity: checkpoint
id and shard id; rank, world size, shapes, dtypes) and, unless ``verify=False``, the checksums
of every byte read, in the pass that reads it (``copy_plan.py``); the error names the bad file.
(No environment variable turns verification off: ferro's live in one table,
``ferro_backend.settings``, which this numpy-only layer does not import.)
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .copy_plan import LazyTensors, VerifiedShards, read_tensors
from .errors import (
    ChecksumMismatchError,
    InvalidArgumentError,
    MetadataError,
    MissingShardError,
    SerializationError,
    ShardMismatchError,
    TensorError,
)
from .layout import METADATA, recover, shard_path
from .metadata import ShardMetadata, check_rank_world
from .read_options import ReadOptions
from .safetensors_io import (
    CHECKPOINT_ID_KEY,
    EXTRA_CRC_KEY,
    EXTRA_KEY,
    SHARD_ID_KEY,
    SafetensorsFile,
    extra_crc,
)


@dataclass
class DistributedCheckpoint:
    """A committed checkpoint directory and its metadata (see :func:`open_checkpoint`).

    Parameters
    ----------
    checkpoint_dir : pathlib.Path
        The checkpoint directory.
    shard_metadata : ShardMetadata
        Its metadata.json, parsed.
    """

    checkpoint_dir: Path
    shard_metadata: ShardMetadata

    @classmethod
    def open(cls, directory) -> DistributedCheckpoint:
        """Open a committed checkpoint; see :func:`open_checkpoint` (it may rename files).

        Parameters
        ----------
        directory : str or os.PathLike
            The checkpoint directory.

        Returns
        -------
        DistributedCheckpoint
            The checkpoint; raises as :func:`open_checkpoint`.
        """
        return open_checkpoint(directory)

    @property
    def num_ranks(self) -> int:
        """How many ranks saved the checkpoint (its shard files)."""
        return self.shard_metadata.num_ranks

    @property
    def checkpoint_id(self) -> str:
        """The save's random id, which every shard of it carries (a shard of another save is
        refused)."""
        return self.shard_metadata.checkpoint_id

    def shard(self, rank: int) -> SafetensorsFile:
        """The verified shard file of ``rank``.

        Parameters
        ----------
        rank : int
            A rank of the saving world, ``0 <= rank < num_ranks``.

        Returns
        -------
        SafetensorsFile
            Its shard file, checked against metadata.json (identity, tensors, shapes, dtypes).

        Raises
        ------
        InvalidArgumentError
            ``rank`` is not an int of the saving world.
        """
        return _open_verified_shard(self, self._saved_rank("shard", rank))

    def load(self, rank: int, world_size: int, *, verify: bool | str | None = None,
             mmap: bool = False, out: Mapping[str, np.ndarray] | None = None,
             threads: int | None = None) -> dict[str, np.ndarray] | LazyTensors:
        """This rank's tensors, resharded where ``world_size`` differs from the saved one: as
        :func:`load_distributed` on this checkpoint.

        Parameters
        ----------
        rank, world_size : int
            This rank and the loading world's size.
        verify : bool or "lazy", optional
            Check the bytes against their checksums (default: yes); see :func:`load_distributed`.
        mmap : bool, optional
            Read-only arrays backed by the files instead of copies.
        out : Mapping of str to numpy.ndarray, optional
            Arrays to load into (each must fit its tensor).
        threads : int, optional
            Threads for the copy (default: the usable CPUs over ``LOCAL_WORLD_SIZE``, at most 8).

        Returns
        -------
        dict of str to numpy.ndarray, or LazyTensors
            This rank's tensors by name (:class:`LazyTensors` with ``mmap=True, verify="lazy"``).
        """
        return load_distributed(self.checkpoint_dir, rank, world_size, checkpoint=self,
                                verify=verify, mmap=mmap, out=out, threads=threads)

    def _saved_rank(self, what: str, rank) -> int:
        """``rank`` as an int of the saving world (numpy's integers too; not a bool), else
        InvalidArgumentError naming ``what``."""
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
            raise InvalidArgumentError(f"{what}: rank {rank!r} is not an int")
        if not 0 <= rank < self.num_ranks:
            raise InvalidArgumentError(f"{what}: rank {int(rank)} is out of range for a "
                                       f"checkpoint of {self.num_ranks} ranks")
        return int(rank)

    def extra(self, rank: int) -> dict | None:
        """The ``extra`` dict rank ``rank`` saved with its shard (None if it saved none).

        Parameters
        ----------
        rank : int
            A rank of the saving world, ``0 <= rank < num_ranks``.

        Returns
        -------
        dict or None
            The ``extra`` of :func:`save_distributed`, or None.

        Raises
        ------
        InvalidArgumentError, SerializationError
            ``rank`` is out of range; the stored ``extra`` (or the shard) is corrupt.
        """
        f = _open_verified_shard(self, self._saved_rank("extra", rank))
        text = f.metadata.get(EXTRA_KEY)
        if text is None:
            return None
        crc = f.metadata.get(EXTRA_CRC_KEY)
        if crc is not None and crc != extra_crc(text):
            raise ChecksumMismatchError(f"{f.path}: the extra saved with rank {rank}'s shard "
                                        f"fails its checksum ({extra_crc(text)}, recorded {crc})")
        try:
            value = json.loads(text)
        except (ValueError, TypeError, RecursionError) as exc:
            raise SerializationError(f"{f.path}: corrupt extra: {exc}") from exc
        if not isinstance(value, dict):
            raise SerializationError(f"{f.path}: extra is {type(value).__name__}, not a dict")
        return value


def open_checkpoint(directory) -> DistributedCheckpoint:
    """The committed checkpoint in ``directory``.

    Opening is not read-only: it first calls ``ferro_checkpoint.layout.recover``, which
    finishes a save that crashed after its commit point (renames its temp shards and commit
    record into place, deletes shards of a larger old world). Without such a leftover it
    changes nothing.

    Parameters
    ----------
    directory : str or os.PathLike
        The checkpoint directory.

    Returns
    -------
    DistributedCheckpoint
        The checkpoint: its directory and metadata (shards are opened when read).

    Raises
    ------
    MissingShardError, MetadataError
        No ``directory``; no committed checkpoint in it, or a malformed or unsupported one.

    Examples
    --------
    >>> open_checkpoint("ckpt").num_ranks  # the world size that saved it
    4
    """
    directory = Path(directory)
    if not directory.is_dir():
        if directory.exists():
            raise MissingShardError(f"checkpoint directory {directory} is not a directory")
        raise MissingShardError(f"checkpoint directory {directory} does not exist")
    recover(directory)  # deliberate: a committed save is finished before metadata.json is read
    path = directory / METADATA
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise MetadataError(f"{path} is missing: no committed checkpoint in {directory}") \
            from None
    except OSError as exc:  # a directory of that name, no permission...
        raise MetadataError(f"{path} cannot be read: {exc}") from exc
    return DistributedCheckpoint(directory, ShardMetadata.from_json(text, source=str(path)))


def _open_verified_shard(ckpt: DistributedCheckpoint, rank: int) -> SafetensorsFile:
    """Rank ``rank``'s shard, checked against metadata.json (id, rank, names, shapes, dtypes)."""
    path = shard_path(ckpt.checkpoint_dir, rank)
    try:
        f = SafetensorsFile(path)
    except FileNotFoundError:
        raise MissingShardError(f"{path} is missing (checkpoint of {ckpt.num_ranks} ranks)") \
            from None
    _check_identity(ckpt.shard_metadata, f, rank)
    specs = ckpt.shard_metadata.tensor_specs
    if set(f.entries) != set(specs):
        raise TensorError(f"{path} holds tensors {sorted(f.entries)}, metadata.json names "
                          f"{sorted(specs)}")
    for name, spec in specs.items():
        code, shape, _, _ = f.entries[name]
        if shape != spec.shard_shape(rank) or (spec.dtype and code != spec.dtype):
            raise TensorError(f"{path}: tensor {name!r} is {code}{shape}, metadata.json "
                              f"expects {spec.dtype}{spec.shard_shape(rank)}")
    return f


def _check_identity(md: ShardMetadata, f: SafetensorsFile, rank: int) -> None:
    """ShardMismatchError unless ``f``'s header carries metadata.json's checkpoint id and shard
    id of ``rank`` (only what a legacy checkpoint records, for one written before them)."""
    meta, strict = f.metadata, bool(md.shard_ids)
    got_ckpt, got_shard = meta.get(CHECKPOINT_ID_KEY, ""), meta.get(SHARD_ID_KEY)
    want_shard = md.shard_ids[rank] if strict else None
    if got_ckpt != md.checkpoint_id or (strict and got_shard != want_shard):
        raise ShardMismatchError(
            f"{f.path} belongs to save (checkpoint {got_ckpt!r}, shard {got_shard!r}), "
            f"metadata.json records rank {rank}'s shard of save (checkpoint "
            f"{md.checkpoint_id!r}, shard {want_shard!r}): shards of different saves are mixed "
            "(copied in, or a save did not complete); refusing to load")
    got_rank, got_world = meta.get("ferro.rank"), meta.get("ferro.world_size")
    if (strict or got_rank is not None or got_world is not None) and \
            (got_rank != str(rank) or got_world != str(md.num_ranks)):
        raise ShardMismatchError(f"{f.path} says rank {got_rank} of {got_world}, expected rank "
                                 f"{rank} of {md.num_ranks}")


def shards_of(ckpt: DistributedCheckpoint, verify: bool = True) -> VerifiedShards:
    """The shards of ``ckpt`` as one load reads them: each opened once, checked against
    metadata.json (identity, tensors, shapes, dtypes), checksums verified if ``verify``."""
    return VerifiedShards(ckpt.shard_metadata, lambda r: _open_verified_shard(ckpt, r), verify)


def reshard(directory, old_world_size: int, new_world_size: int, new_rank: int, *,
            checkpoint: DistributedCheckpoint | None = None, verify: bool | str | None = None,
            mmap: bool = False, out: Mapping[str, np.ndarray] | None = None,
            threads: int | None = None) -> dict[str, np.ndarray] | LazyTensors:
    """Rank ``new_rank``'s tensors for a world of ``new_world_size`` from a checkpoint saved by
    ``old_world_size`` ranks. Reads only the 1 MiB chunks holding the rows this rank needs
    (each checksummed in the pass that copies its rows). New shard sizes: the first
    ``full % world`` ranks get one extra row.

    Parameters
    ----------
    directory : str or os.PathLike
        The checkpoint directory.
    old_world_size, new_world_size, new_rank : int
        The saving world's size (checked), the new one, and the rank whose tensors to return.
    checkpoint : DistributedCheckpoint, optional
        The checkpoint already opened (default: ``open_checkpoint(directory)``).
    verify, mmap, out, threads
        As :func:`load_distributed`. With ``mmap``, a tensor whose new rows lie in one old
        shard in one piece is a view of that file; the others are copies (read-only too).

    Returns
    -------
    dict of str to numpy.ndarray
        Every tensor's shard of rank ``new_rank`` in a world of ``new_world_size``
        (a :class:`~ferro_checkpoint.copy_plan.LazyTensors` mapping with ``verify="lazy"``).

    Raises
    ------
    InvalidArgumentError
        A bad ``new_rank``, ``new_world_size`` or keyword, or ``old_world_size`` is not the
        saved one.
    MetadataError, MissingShardError, SerializationError, ShardMismatchError, TensorError
        As :func:`load_distributed` (and ChecksumMismatchError, CheckpointIOError).

    Examples
    --------
    >>> reshard("ckpt", 4, 2, 1)["weight"].shape  # rows 5..9 of a (10, 3) tensor
    (5, 3)
    """
    new_rank, new_world_size = check_rank_world("reshard", new_rank, new_world_size)
    if isinstance(old_world_size, bool) or not isinstance(old_world_size, numbers.Integral):
        raise InvalidArgumentError(f"reshard: old_world_size {old_world_size!r} is not an int")
    opts = ReadOptions.of("reshard", verify, mmap, out, threads)
    ckpt = checkpoint or open_checkpoint(directory)
    if ckpt.num_ranks != old_world_size:
        raise InvalidArgumentError(f"reshard: the checkpoint in {ckpt.checkpoint_dir} was saved "
                                   f"by {ckpt.num_ranks} ranks, not {old_world_size}")
    return _read(ckpt, new_world_size, new_rank, opts)


def _read(ckpt: DistributedCheckpoint, world_size: int, rank: int,
          opts: ReadOptions) -> dict[str, np.ndarray] | LazyTensors:
    return read_tensors(shards_of(ckpt, opts.verify), sorted(ckpt.shard_metadata.tensor_specs),
                        world_size, rank, out=opts.out, mmap=opts.mmap, lazy=opts.lazy,
                        threads=opts.threads)


def load_distributed(directory, rank: int, world_size: int, *,
                     checkpoint: DistributedCheckpoint | None = None,
                     verify: bool | str | None = None, mmap: bool = False,
                     out: Mapping[str, np.ndarray] | None = None,
                     threads: int | None = None) -> dict[str, np.ndarray] | LazyTensors:
    """This rank's tensors: its own shard if ``world_size`` equals the saved one, else resharded.

    Each byte is read once: the pass that copies it also folds it into its chunk's CRC-32C.

    Parameters
    ----------
    directory : str or os.PathLike
        The checkpoint directory (saved by any number of ranks).
    rank, world_size : int
        This rank and the loading world's size.
    checkpoint : DistributedCheckpoint, optional
        The checkpoint already opened (default: ``open_checkpoint(directory)``).
    verify : bool or "lazy", optional
        None or True (the default) checks the checksum of every byte read, False not (the
        save's identity is always checked). ``"lazy"`` (with ``mmap``) checks each tensor when
        it is first looked up in the returned mapping.
    mmap : bool, optional
        Zero-copy: return read-only arrays backed by the shard files (default: False, new
        arrays). They stay valid after the checkpoint is deleted (the mapping keeps the file).
    out : mapping of str to numpy.ndarray, optional
        Arrays to load into (C-contiguous, writable, each tensor's shape and dtype), by name;
        tensors not named get new arrays. After an error their contents are unspecified.
    threads : int, optional
        Kernel threads for loads of 16 MiB or more (default: the CPUs this process may use,
        divided by ``LOCAL_WORLD_SIZE`` when a launcher sets it, at most 8).

    Returns
    -------
    dict of str to numpy.ndarray
        This rank's shard of every tensor, by name. New arrays are views of one allocation
        (freed with the last of them); ``verify="lazy"`` returns a read-only mapping instead.

    Raises
    ------
    MetadataError, MissingShardError
        No committed checkpoint (or a malformed metadata.json); a missing directory or shard.
    SerializationError, ChecksumMismatchError, ShardMismatchError
        A corrupt or truncated file; bytes that differ from their checksum (names the file,
        the tensor and the bytes); a shard of another save.
    TensorError, InvalidArgumentError, CheckpointIOError
        Tensors unlike metadata.json's or an ``out`` array that does not fit; a bad argument;
        an unreadable file. Each names the file.

    Examples
    --------
    >>> sorted(load_distributed("ckpt", rank=0, world_size=2))
    ['bias', 'weight']
    >>> load_distributed("ckpt", 0, 2, mmap=True)["weight"].flags.writeable  # the file itself
    False
    """
    rank, world_size = check_rank_world("load_distributed", rank, world_size)
    opts = ReadOptions.of("load_distributed", verify, mmap, out, threads)
    ckpt = checkpoint or open_checkpoint(directory)
    return _read(ckpt, world_size, rank, opts)
