"""Shard specs and the checkpoint's metadata.json.

metadata.json schema (``format_version`` 2)::

    {
      "format": "ferro-checkpoint",
      "format_version": 2,
      "checkpoint_id": "<the save's id: the same in every shard's header>",
      "num_ranks": 4,
      "shard_ids": ["<32 hex digits>", ...],
      "tensor_specs": {
        "<name>": {"full_shape": [10, 3], "shard_dim": 0, "shard_sizes": [3, 3, 2, 2],
                   "dtype": "F32"}
      }
    }

``checkpoint_id`` is shared by the ranks of one save (random with a backend; without one the
caller's id or a default such as ``step<n>``, so two saves can share it). ``shard_ids[r]`` is
the random 128-bit id rank ``r`` drew for its shard of this save alone and wrote into that
shard's header (key ``ferro.shard_id``); the committing rank copied it from the header. Together
they are the save's identity: a shard whose header does not carry both is from another save.
Checkpoints written before shard ids existed have no ``shard_ids`` (and possibly no
``checkpoint_id``); they still load, checked only by what they record. In version 2 every shard
records a CRC-32C per 1 MiB chunk of each tensor (``checksums.py``) and a shard without them is
refused; version 1 (crc32 per tensor, or none) is still read and checked.

Shard ``r`` of a tensor holds the rows ``[sum(shard_sizes[:r]), sum(shard_sizes[:r+1]))`` along
``shard_dim``; every other dimension is whole.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidArgumentError, MetadataError

FORMAT = "ferro-checkpoint"
FORMAT_VERSION = 2  # what saves write
READABLE_VERSIONS = (1, 2)  # what loads read


def _whole(v, what: str) -> int:
    """``v`` as an int where it is an integer (Python's or numpy's, not bool): a float or a
    bool was truncated silently ((2.5, 1.5) became (2, 1), True became 1)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise InvalidArgumentError(f"{what}: {v!r:.40} is not an int")
    return int(v)


def check_rank_world(op: str, rank: int, world_size: int) -> tuple[int, int]:
    """``(rank, world_size)`` as ints; InvalidArgumentError unless both are integers (Python's
    or numpy's, not bool) with ``0 <= rank < world_size``; ``op`` names the caller."""
    for what, v in (("world_size", world_size), ("rank", rank)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InvalidArgumentError(f"{op}: {what} must be an int, not "
                                       f"{type(v).__name__} ({v!r:.40})")
    if world_size < 1:
        raise InvalidArgumentError(f"{op}: world_size {int(world_size)} must be >= 1")
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"{op}: rank {int(rank)} is out of range for world_size "
                                   f"{int(world_size)}")
    return int(rank), int(world_size)


def compute_shard_sizes(full: int, world_size: int) -> tuple[int, ...]:
    """Split ``full`` rows over ``world_size`` ranks: the first ``full % world`` get one extra.

    The same rule as ``ferro_backend.partition.split_sizes``, its single home; this copy exists
    because ferro-checkpoint does not depend on ferro-backend, and a test checks they agree.

    Parameters
    ----------
    full : int
        The number of rows to split.
    world_size : int
        The number of ranks, >= 1.

    Returns
    -------
    tuple of int
        ``world_size`` sizes summing to ``full``, the larger ones first.

    Raises
    ------
    InvalidArgumentError
        ``world_size`` is below 1.

    Examples
    --------
    >>> compute_shard_sizes(10, 4)
    (3, 3, 2, 2)
    """
    if world_size < 1:
        raise InvalidArgumentError(f"world_size {world_size} must be >= 1")
    base, extra = divmod(full, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))


@dataclass
class TensorShardSpec:
    """How one tensor is split: ``shard_sizes[r]`` rows of ``shard_dim`` live on rank ``r``.

    Parameters
    ----------
    full_shape : tuple of int
        The whole tensor's shape (at least one dimension).
    shard_dim : int
        The dimension split over the ranks, ``0 <= shard_dim < len(full_shape)``.
    shard_sizes : tuple of int
        Each rank's number of rows of ``shard_dim``; they sum to ``full_shape[shard_dim]``.
    dtype : str, optional
        The safetensors dtype code (``"F32"``...), filled in by the save (default: None).

    Raises
    ------
    InvalidArgumentError
        An empty or negative shape, a ``shard_dim`` out of range, or sizes that do not add up.
    """

    full_shape: tuple[int, ...]
    shard_dim: int
    shard_sizes: tuple[int, ...]
    dtype: str | None = None  # safetensors dtype code, filled in by save

    def __post_init__(self) -> None:
        for what in ("full_shape", "shard_sizes"):
            self.__dict__[what] = tuple(_whole(s, f"TensorShardSpec: {what}")
                                        for s in getattr(self, what))
        self.shard_dim = _whole(self.shard_dim, "TensorShardSpec: shard_dim")
        if not self.full_shape:
            raise InvalidArgumentError("TensorShardSpec: a 0-d tensor cannot be sharded; "
                                       "reshape it to (1,)")
        if any(s < 0 for s in self.full_shape):
            raise InvalidArgumentError(f"TensorShardSpec: full_shape {self.full_shape} has a "
                                       "negative dimension")
        if not 0 <= self.shard_dim < len(self.full_shape):
            raise InvalidArgumentError(f"TensorShardSpec: shard_dim {self.shard_dim} is out of "
                                       f"range for full_shape {self.full_shape}")
        if any(s < 0 for s in self.shard_sizes) or not self.shard_sizes:
            raise InvalidArgumentError(f"TensorShardSpec: bad shard_sizes {self.shard_sizes}")
        if sum(self.shard_sizes) != self.full_shape[self.shard_dim]:
            raise InvalidArgumentError(
                f"TensorShardSpec: shard_sizes {self.shard_sizes} sum to {sum(self.shard_sizes)}"
                f", expected full_shape[{self.shard_dim}] = {self.full_shape[self.shard_dim]}")

    def start(self, rank: int) -> int:
        """The first row of ``shard_dim`` that rank ``rank`` holds.

        Parameters
        ----------
        rank : int
            A rank, ``0 <= rank < len(shard_sizes)``.

        Returns
        -------
        int
            ``sum(shard_sizes[:rank])``.
        """
        return sum(self.shard_sizes[:rank])

    def shard_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of rank ``rank``'s shard.

        Parameters
        ----------
        rank : int
            A rank, ``0 <= rank < len(shard_sizes)``.

        Returns
        -------
        tuple of int
            ``full_shape`` with ``shard_sizes[rank]`` rows along ``shard_dim``.
        """
        shape = list(self.full_shape)
        shape[self.shard_dim] = self.shard_sizes[rank]
        return tuple(shape)

    def resharded(self, world_size: int) -> TensorShardSpec:
        """This tensor split over ``world_size`` ranks instead (:func:`compute_shard_sizes`).

        Parameters
        ----------
        world_size : int
            The new number of ranks, >= 1.

        Returns
        -------
        TensorShardSpec
            A new spec of the same shape, dim and dtype.
        """
        return TensorShardSpec(self.full_shape, self.shard_dim,
                               compute_shard_sizes(self.full_shape[self.shard_dim], world_size),
                               self.dtype)

    def to_dict(self) -> dict:
        """The spec as the JSON object ``metadata.json`` stores (``from_dict`` reads it back).

        Returns
        -------
        dict
            The spec's fields, JSON-serialisable.
        """
        d = {"full_shape": list(self.full_shape), "shard_dim": self.shard_dim,
             "shard_sizes": list(self.shard_sizes)}
        return d if self.dtype is None else {**d, "dtype": self.dtype}


@dataclass
class ShardMetadata:
    """How many ranks wrote a checkpoint and how each tensor is sharded.

    Parameters
    ----------
    num_ranks : int
        The number of ranks (and shards), >= 1.
    tensor_specs : dict of str to TensorShardSpec, optional
        Each tensor's split over ``num_ranks`` ranks, by name (default: none).
    checkpoint_id : str, optional
        The save's id, filled in by the save (default: ``""``).
    shard_ids : tuple of str, optional
        Each rank's shard id, filled in by the commit (default: none).
    format_version : int, optional
        The metadata.json version read (default: :data:`FORMAT_VERSION`, what a save writes).

    Raises
    ------
    InvalidArgumentError
        ``num_ranks`` below 1, or ``shard_ids`` or a spec's sizes not one per rank.
    """

    num_ranks: int
    tensor_specs: dict[str, TensorShardSpec] = field(default_factory=dict)
    checkpoint_id: str = ""
    shard_ids: tuple[str, ...] = ()  # per rank; empty in checkpoints older than shard ids
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if isinstance(self.num_ranks, np.integer) and not isinstance(self.num_ranks, bool):
            self.num_ranks = int(self.num_ranks)
        if isinstance(self.num_ranks, bool) or not isinstance(self.num_ranks, int) or \
                self.num_ranks < 1:
            raise InvalidArgumentError(f"ShardMetadata: num_ranks {self.num_ranks!r} must be >= 1")
        self.shard_ids = tuple(self.shard_ids)
        if self.shard_ids and (len(self.shard_ids) != self.num_ranks or
                               not all(isinstance(i, str) for i in self.shard_ids)):
            raise InvalidArgumentError(f"ShardMetadata: shard_ids must be {self.num_ranks} "
                                       f"strings (one per rank), got {self.shard_ids!r:.120}")
        for name, spec in self.tensor_specs.items():
            if len(spec.shard_sizes) != self.num_ranks:
                raise InvalidArgumentError(
                    f"ShardMetadata: tensor {name!r} has {len(spec.shard_sizes)} shard sizes, "
                    f"expected num_ranks = {self.num_ranks}")

    def to_json(self) -> str:
        """This metadata as the text of metadata.json (the schema of the module docstring).

        Returns
        -------
        str
            The JSON text, tensors sorted by name.
        """
        raw = {"format": FORMAT, "format_version": self.format_version,
               "checkpoint_id": self.checkpoint_id, "num_ranks": self.num_ranks}
        if self.shard_ids:
            raw["shard_ids"] = list(self.shard_ids)
        raw["tensor_specs"] = {k: v.to_dict() for k, v in sorted(self.tensor_specs.items())}
        return json.dumps(raw, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "metadata.json") -> ShardMetadata:
        """Parse and check metadata.json; anything malformed raises MetadataError naming
        ``source`` (never KeyError/TypeError/ValueError).

        Parameters
        ----------
        text : str or bytes
            The content of a metadata.json.
        source : str, optional
            What the errors call it (default: ``"metadata.json"``).

        Returns
        -------
        ShardMetadata
            The parsed metadata.

        Raises
        ------
        MetadataError
            Not JSON, another format or format version, or a missing or malformed field.
        """
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise MetadataError(f"{source}: malformed metadata: not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise MetadataError(f"{source}: malformed metadata: a JSON {type(raw).__name__}, "
                                "not an object")
        if raw.get("format", FORMAT) != FORMAT:
            raise MetadataError(f"{source}: format {raw.get('format')!r:.80} is not {FORMAT!r}")
        version = raw.get("format_version", 1)
        if type(version) is not int or version not in READABLE_VERSIONS:  # bool is not int
            raise MetadataError(f"{source}: format_version {version!r:.80} is not supported "
                                f"(this reads {', '.join(map(str, READABLE_VERSIONS))})")
        try:
            specs_raw = raw["tensor_specs"]
            if not isinstance(specs_raw, dict):
                raise MetadataError(f"{source}: malformed metadata: tensor_specs must be an "
                                    "object")
            specs = {k: _spec_from_dict(k, v, source) for k, v in specs_raw.items()}
            ckpt_id = raw.get("checkpoint_id", "")
            if not isinstance(ckpt_id, str):
                raise MetadataError(f"{source}: malformed metadata: checkpoint_id "
                                    f"{ckpt_id!r:.80} is not a string")
            shard_ids = raw.get("shard_ids", [])
            if not isinstance(shard_ids, list):
                raise MetadataError(f"{source}: malformed metadata: shard_ids "
                                    f"{shard_ids!r:.80} is not a list")
            return cls(_nonneg_int(raw["num_ranks"], "num_ranks", source), specs, ckpt_id,
                       tuple(shard_ids), version)
        except KeyError as exc:
            raise MetadataError(f"{source}: malformed metadata: missing field {exc}") from None
        except InvalidArgumentError as exc:
            raise MetadataError(f"{source}: malformed metadata: {exc}") from exc


def _nonneg_int(v, what: str, source: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise MetadataError(f"{source}: malformed metadata: {what} {v!r:.80} is not an int >= 0")
    return v


def _spec_from_dict(name: str, v, source: str) -> TensorShardSpec:
    where = f"tensor_specs[{name!r}]"
    if not isinstance(v, dict):
        raise MetadataError(f"{source}: malformed metadata: {where} is not an object")
    lists = {}
    for key in ("full_shape", "shard_sizes"):
        value = v[key]
        if not isinstance(value, list):
            raise MetadataError(f"{source}: malformed metadata: {where}.{key} {value!r:.80} is "
                                "not a list")
        lists[key] = tuple(_nonneg_int(i, f"{where}.{key} entry", source) for i in value)
    dtype = v.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise MetadataError(f"{source}: malformed metadata: {where}.dtype {dtype!r:.80} is not "
                            "a string")
    return TensorShardSpec(lists["full_shape"], _nonneg_int(v["shard_dim"], f"{where}.shard_dim",
                                                            source), lists["shard_sizes"], dtype)


def flat_shard_metadata(state_dict: Mapping[str, np.ndarray], world_size: int) -> ShardMetadata:
    """Spec for FSDP-style flat shards: each rank's tensor is its flat chunk of a 1-d tensor of
    ``numel * world_size`` elements, equal chunks, sharded along dim 0 (the 0.1 crate's helper).

    Parameters
    ----------
    state_dict : mapping of str to numpy.ndarray
        This rank's flat chunks (every rank's chunk of a tensor has the same size).
    world_size : int
        The number of ranks, >= 1.

    Returns
    -------
    ShardMetadata
        The spec of every tensor of ``state_dict``, to pass to :func:`save_distributed`.

    Raises
    ------
    InvalidArgumentError
        ``world_size`` is below 1.

    Examples
    --------
    >>> flat_shard_metadata({"w": np.zeros(4)}, world_size=2).tensor_specs["w"].full_shape
    (8,)
    """
    world_size = _whole(world_size, "flat_shard_metadata: world_size")
    if world_size < 1:
        raise InvalidArgumentError(f"flat_shard_metadata: world_size {world_size} must be >= 1")
    numels = {name: int(np.asarray(t).size) for name, t in state_dict.items()}
    return ShardMetadata(world_size, {name: TensorShardSpec((n * world_size,), 0, (n,) * world_size)
                                      for name, n in numels.items()})
