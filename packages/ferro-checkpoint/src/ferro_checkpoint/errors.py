"""The ``DistCheckpointError`` family; each class also subclasses the closest builtin."""


class DistCheckpointError(Exception):
    """Base class of every ferro-checkpoint error."""


class CheckpointIOError(DistCheckpointError, OSError):
    """Reading or writing a checkpoint file failed."""


class SerializationError(DistCheckpointError, ValueError):
    """A shard file is not valid safetensors, or its bytes do not match its checksum."""


class MetadataError(DistCheckpointError, ValueError):
    """metadata.json is missing, malformed, of an unknown format version, or inconsistent."""


class IncompleteCheckpointError(MetadataError):
    """Shards of different saves are mixed (a save did not commit): refused, never loaded."""


class ShardMismatchError(IncompleteCheckpointError):
    """A shard file belongs to another save (or another rank) than metadata.json records: its
    header's save identity differs. The message names the file and both identities."""


class ChecksumMismatchError(SerializationError):
    """A tensor's bytes do not match the crc32 its shard header records (or a checksummed shard
    lacks one). The message names the file and the tensor."""


class MissingShardError(DistCheckpointError, FileNotFoundError):
    """A shard file the metadata names does not exist."""


class MissingStepError(MissingShardError):
    """``CheckpointManager.restore`` asked for a step that is not committed (or none is)."""


class TensorError(DistCheckpointError, ValueError):
    """A tensor's shape or dtype does not match its shard spec, or a tensor is missing."""


class InvalidArgumentError(DistCheckpointError, ValueError):
    """A bad rank, world size, shard dim or spec."""


class AsyncCheckpointError(DistCheckpointError, RuntimeError):
    """A background save failed (the cause is chained), or a save was started while one runs."""

