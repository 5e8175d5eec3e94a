"""ferro-checkpoint: sharded safetensors checkpoints that reshard, save asynchronously and
never lose data. Needs numpy only (see the package README)."""


from . import _along_dim, _copy_crc  # noqa: F401 - the compiled kernels, imported unconditionally
from .along_dim import concat_along_dim, slice_along_dim
from .async_save import AsyncCheckpointer, CheckpointFuture
from .consolidate import consolidate
from .copy_plan import LazyTensors
from .errors import (
    AsyncCheckpointError,
    CheckpointIOError,
    ChecksumMismatchError,
    DistCheckpointError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    MetadataError,
    MissingShardError,
    MissingStepError,
    SerializationError,
    ShardMismatchError,
    TensorError,
)
from .load import DistributedCheckpoint, load_distributed, open_checkpoint, reshard
from .manager import CheckpointManager
from .metadata import (
    FORMAT_VERSION,
    ShardMetadata,
    TensorShardSpec,
    compute_shard_sizes,
    flat_shard_metadata,
)
from .save import save_distributed

__all__ = [
    "FORMAT_VERSION",
    "AsyncCheckpointError",
    "AsyncCheckpointer",
    "CheckpointFuture",
    "CheckpointIOError",
    "CheckpointManager",
    "ChecksumMismatchError",
    "DistCheckpointError",
    "DistributedCheckpoint",
    "IncompleteCheckpointError",
    "InvalidArgumentError",
    "LazyTensors",
    "MetadataError",
    "MissingShardError",
    "MissingStepError",
    "SerializationError",
    "ShardMetadata",
    "ShardMismatchError",
    "TensorError",
    "TensorShardSpec",
    "compute_shard_sizes",
    "concat_along_dim",
    "consolidate",
    "flat_shard_metadata",
    "load_distributed",
    "open_checkpoint",
    "reshard",
    "save_distributed",
    "slice_along_dim",
]


def __getattr__(name: str) -> str:
    """``__version__``, from the installed metadata when first asked for (importing
    importlib.metadata costs every process that imports ferro_checkpoint about 60 ms)."""
    if name == "__version__":
        from importlib.metadata import version

        globals()["__version__"] = value = version("ferro-checkpoint")
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
