"""Garbage in metadata.json and in a shard's safetensors header: loading raises a typed
DistCheckpointError naming the file, never a bare KeyError/TypeError/IndexError/numpy error,
and never allocates what the file cannot hold."""

import json
import struct

import numpy as np
import pytest
from _util import save_all

from ferro_checkpoint import (
    CheckpointIOError,
    CheckpointManager,
    DistCheckpointError,
    MetadataError,
    SerializationError,
    ShardMetadata,
    TensorShardSpec,
    consolidate,
    load_distributed,
)
from ferro_checkpoint.safetensors_io import SafetensorsFile

FULL = {"w": np.arange(40, dtype=np.float32).reshape(10, 4), "b": np.arange(6, dtype=np.int64)}


def good_meta():
    return {"format": "ferro-checkpoint", "format_version": 1, "checkpoint_id": "x",
            "num_ranks": 2,
            "tensor_specs": {"w": {"full_shape": [10, 4], "shard_dim": 0, "shard_sizes": [5, 5],
                                   "dtype": "F32"},
                             "b": {"full_shape": [6], "shard_dim": 0, "shard_sizes": [3, 3],
                                   "dtype": "I64"}}}


def mutate(path, *keys, value=None, delete=False):
    meta = good_meta()
    d = meta
    for k in keys[:-1]:
        d = d[k]
    if delete:
        del d[keys[-1]]
    else:
        d[keys[-1]] = value
    return meta


BAD_METADATA = [
    b"[]", b"null", b"3", b'"text"', b"{}", b"", b"\xff\xfe\x00garbage", b"[" * 100000,
    mutate(None, "num_ranks", delete=True),
    mutate(None, "tensor_specs", delete=True),
    mutate(None, "tensor_specs", "w", "shard_dim", delete=True),
    mutate(None, "tensor_specs", "w", "full_shape", delete=True),
    mutate(None, "tensor_specs", "b", "shard_sizes", delete=True),
    mutate(None, "num_ranks", value="two"),
    mutate(None, "num_ranks", value=-1),
    mutate(None, "num_ranks", value=0),
    mutate(None, "num_ranks", value=3),
    mutate(None, "num_ranks", value=2.5),
    mutate(None, "num_ranks", value=[2]),
    mutate(None, "format_version", value="1"),
    mutate(None, "format_version", value=3),
    mutate(None, "format_version", value=2.0),
    mutate(None, "format", value=["x"]),
    mutate(None, "checkpoint_id", value={"a": 1}),
    mutate(None, "tensor_specs", value=[]),
    mutate(None, "tensor_specs", value="w"),
    mutate(None, "tensor_specs", "w", value=[10, 4]),
    mutate(None, "tensor_specs", "w", value=None),
    mutate(None, "tensor_specs", "w", "full_shape", value=10),
    mutate(None, "tensor_specs", "w", "full_shape", value=["10", 4]),
    mutate(None, "tensor_specs", "w", "full_shape", value=[10, -4]),
    mutate(None, "tensor_specs", "w", "full_shape", value=[10.5, 4]),
    mutate(None, "tensor_specs", "w", "full_shape", value=[]),
    mutate(None, "tensor_specs", "w", "shard_dim", value=5),
    mutate(None, "tensor_specs", "w", "shard_dim", value=-1),
    mutate(None, "tensor_specs", "w", "shard_dim", value="0"),
    mutate(None, "tensor_specs", "w", "shard_dim", value=None),
    mutate(None, "tensor_specs", "w", "shard_sizes", value=[-5, 15]),
    mutate(None, "tensor_specs", "w", "shard_sizes", value=[5]),
    mutate(None, "tensor_specs", "w", "shard_sizes", value=[5, 6]),
    mutate(None, "tensor_specs", "w", "shard_sizes", value={"0": 5}),
    mutate(None, "tensor_specs", "w", "dtype", value=5),
    mutate(None, "tensor_specs", "w", "dtype", value=["F32"]),
]

# accepted as metadata.json, refused against the shards
MISMATCHED_METADATA = [
    mutate(None, "tensor_specs", "w", "full_shape", value=[12, 4]),  # not the bytes
    mutate(None, "tensor_specs", "w", "full_shape", value=[2**62, 2**62]),  # huge
    mutate(None, "tensor_specs", "w", "full_shape", value=[10, 2**40]),
    mutate(None, "tensor_specs", "w", "shard_sizes", value=[4, 6]),
    mutate(None, "tensor_specs", "w", "dtype", value="F64"),
    mutate(None, "tensor_specs", "w", "dtype", value="F99"),
    mutate(None, "tensor_specs", "w", "shard_dim", value=1),
    mutate(None, "tensor_specs", "x", value={"full_shape": [2], "shard_dim": 0,
                                             "shard_sizes": [1, 1]}),
    mutate(None, "checkpoint_id", value="other"),
]


def saved(tmp_path):
    save_all(FULL, tmp_path, 2, checkpoint_id="x")
    return tmp_path


def all_loads(directory, rank1=True):
    """Every way to read the checkpoint that reads rank 0's shard (and rank 1's if
    ``rank1``): same world, reshards, consolidate."""
    yield lambda: load_distributed(directory, 0, 2)
    if rank1:
        yield lambda: load_distributed(directory, 1, 2)
    yield lambda: load_distributed(directory, 0, 1)
    if rank1:
        yield lambda: load_distributed(directory, 2, 3)
    yield lambda: consolidate(directory, directory.parent / "out.safetensors")


def assert_typed(fn, *names):
    try:
        fn()
    except DistCheckpointError as exc:
        assert any(name in str(exc) for name in names), exc
        return exc
    except Exception as exc:  # pragma: no cover - the failure this file guards against
        pytest.fail(f"untyped {type(exc).__name__}: {exc}")
    pytest.fail("loaded garbage without an error")


@pytest.mark.parametrize("bad", BAD_METADATA, ids=range(len(BAD_METADATA)))
def test_garbage_metadata_is_a_metadata_error(tmp_path, bad):
    text = bad if isinstance(bad, bytes) else json.dumps(bad).encode()
    d = saved(tmp_path / "ckpt")
    (d / "metadata.json").write_bytes(text)
    for fn in all_loads(d):
        exc = assert_typed(fn, "metadata.json")
        assert isinstance(exc, MetadataError)
    with pytest.raises(MetadataError, match="source.json"):
        ShardMetadata.from_json(text, source="source.json")


@pytest.mark.parametrize("bad", MISMATCHED_METADATA, ids=range(len(MISMATCHED_METADATA)))
def test_metadata_that_does_not_match_the_shards(tmp_path, bad):
    d = saved(tmp_path / "ckpt")
    (d / "metadata.json").write_text(json.dumps(bad))
    for fn in all_loads(d):
        assert_typed(fn, "rank_", "metadata.json")


def test_garbage_commit_record_is_a_metadata_error(tmp_path):
    d = saved(tmp_path / "ckpt")
    (d / ".commit.y.json").write_bytes(b"[]")
    assert_typed(lambda: load_distributed(d, 0, 2), ".commit.y.json")


def test_manager_restore_with_garbage_metadata(tmp_path):
    m = CheckpointManager(tmp_path, 0, 1)
    m.save(1, FULL, ShardMetadata(1, {k: TensorShardSpec(v.shape, 0, (v.shape[0],))
                                      for k, v in FULL.items()}), extra={"a": 1})
    (tmp_path / "step_1" / "metadata.json").write_bytes(b'{"num_ranks": "x"}')
    assert_typed(m.restore, "metadata.json")


def shard_file(header, data=b"", hlen=None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if hlen is None else hlen) + raw + data


META = {"ferro.checkpoint_id": "x", "ferro.rank": "0", "ferro.world_size": "1"}


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


BAD_SHARDS = [
    b"", b"\x01\x02\x03",  # truncated before the length
    shard_file(b"{}", hlen=2**62),  # huge length prefix: refused before reading
    shard_file(b"{}", hlen=2**64 - 1),
    shard_file(b"{}", hlen=200),  # longer than the file
    shard_file({"__metadata__": META, "w": entry()}, b"\x00" * 4),  # truncated data
    shard_file(b"[]"), shard_file(b"null"), shard_file(b"7"), shard_file(b"\xff\xfe"),
    shard_file(b"[" * 50000),
    shard_file({"__metadata__": ["a"], "w": entry()}, b"\x00" * 8),
    shard_file({"__metadata__": {"ferro.rank": 0}, "w": entry()}, b"\x00" * 8),
    shard_file({"__metadata__": META, "w": 5}, b"\x00" * 8),
    shard_file({"__metadata__": META, "w": {"dtype": "F32", "shape": [2]}}, b"\x00" * 8),
    shard_file({"__metadata__": META, "w": entry(dtype=["F32"])}, b"\x00" * 8),
    shard_file({"__metadata__": META, "w": entry(dtype=None)}, b"\x00" * 8),
    shard_file({"__metadata__": META, "w": entry(dtype="F99")}, b"\x00" * 8),
    shard_file({"__metadata__": META, "w": entry(shape=(-1, -2))}, b"\x00" * 8),
    shard_file({"__metadata__": META, "w": entry(shape=(2.0,))}, b"\x00" * 8),
    shard_file({"__metadata__": META, "w": entry(shape="2")}, b"\x00" * 8),
    shard_file({"__metadata__": META, "w": entry(shape=(2**32, 2**32), offsets=(0, 0))}),
    shard_file({"__metadata__": META, "w": entry(shape=(2**62,), offsets=(0, 2**64))}),
    shard_file({"__metadata__": META, "w": entry(offsets=(0, 8000))}, b"\x00" * 8),  # past end
    shard_file({"__metadata__": META, "w": entry(offsets=(2**63, 2**63 + 8))}, b"\x00" * 8),
    shard_file({"__metadata__": META, "w": entry(offsets=(8, 0))}, b"\x00" * 8),  # reversed
    shard_file({"__metadata__": META, "w": entry(offsets=(-8, 0))}, b"\x00" * 8),  # negative
    shard_file({"__metadata__": META, "w": entry(offsets=(0, 8, 16))}, b"\x00" * 16),
    shard_file({"__metadata__": META, "w": entry(offsets=("0", "8"))}, b"\x00" * 8),
    shard_file({"__metadata__": META, "w": entry(offsets=(0.0, 8.0))}, b"\x00" * 8),
    shard_file({"__metadata__": META, "w": entry(offsets=(0, 12))}, b"\x00" * 12),  # size
    shard_file({"__metadata__": META, "w": entry(offsets=(0, 8)),
                "b": entry(offsets=(4, 12))}, b"\x00" * 12),  # overlap
    shard_file({"__metadata__": META, "w": entry(offsets=(0, 8)),
                "b": entry(offsets=(0, 8))}, b"\x00" * 8),  # the same bytes twice
]


@pytest.mark.parametrize("bad", BAD_SHARDS, ids=range(len(BAD_SHARDS)))
def test_garbage_shard_header_is_a_serialization_error(tmp_path, bad):
    p = tmp_path / "rank_0.safetensors"
    p.write_bytes(bad)
    exc = assert_typed(lambda: [SafetensorsFile(p).tensor(n) for n in ("w", "b")], str(p))
    assert isinstance(exc, (SerializationError, DistCheckpointError))
    d = saved(tmp_path / "ckpt")
    (d / "rank_0.safetensors").write_bytes(bad)
    for fn in all_loads(d, rank1=False):
        assert_typed(fn, "rank_0.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_huge_header_length_is_refused_before_reading(tmp_path, monkeypatch):
    p = tmp_path / "rank_0.safetensors"
    p.write_bytes(shard_file(b"{}", hlen=2**62))
    import builtins

    real_open = builtins.open
    reads = []

    class Spy:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            reads.append(n)
            return self.f.read(n)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    monkeypatch.setattr(builtins, "open", lambda *a, **k: Spy(real_open(*a, **k)))
    with pytest.raises(SerializationError, match=r"header claims 4611686018427387904 bytes"):
        SafetensorsFile(p)
    assert reads == [8]


def test_zero_length_tensors_do_not_overlap(tmp_path):
    p = tmp_path / "t.safetensors"
    p.write_bytes(shard_file({"a": entry(shape=(0,), offsets=(4, 4)), "w": entry()},
                             b"\x00" * 8))
    f = SafetensorsFile(p)
    assert f.tensor("a").shape == (0,) and f.tensor("w").shape == (2,)


def test_consolidate_refuses_an_empty_name_and_leaves_no_temp_file(tmp_path):
    from ferro_checkpoint import InvalidArgumentError

    d = tmp_path / "ckpt"
    save_all({"w": np.arange(6.0)}, d, 2)
    with pytest.raises(InvalidArgumentError, match="names no file"):
        consolidate(d, "")
    (tmp_path / "out").mkdir()  # a directory where the file goes: the rename fails
    with pytest.raises(CheckpointIOError):
        consolidate(d, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]  # (no .tmp left)


def test_a_directory_named_metadata_json_is_a_metadata_error(tmp_path):
    save_all({"w": np.arange(4.0)}, tmp_path, 1)
    (tmp_path / "metadata.json").unlink()
    (tmp_path / "metadata.json").mkdir()
    with pytest.raises(MetadataError, match="cannot be read"):
        load_distributed(tmp_path, 0, 1)


def test_a_lazy_membership_test_reads_nothing(tmp_path):
    # Mapping's `in` read the tensor and verified it: a corrupt one raised there
    from ferro_checkpoint import ChecksumMismatchError

    save_all({"w": np.arange(4.0), "v": np.ones(2)}, tmp_path, 1)
    shard = tmp_path / "rank_0.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x40  # the last tensor's last byte ("w": the widest first, then by name)
    shard.write_bytes(bytes(raw))
    tensors = load_distributed(tmp_path, 0, 1, mmap=True, verify="lazy")
    assert "w" in tensors and "x" not in tensors
    with pytest.raises(ChecksumMismatchError):
        tensors["w"]


@pytest.mark.parametrize("bad", [np.int64(2), True, 2.5])
def test_world_sizes_and_shard_sizes_are_integers(bad):
    from ferro_checkpoint import InvalidArgumentError, TensorShardSpec, flat_shard_metadata

    if isinstance(bad, np.integer):  # a numpy integer is one
        assert flat_shard_metadata({"w": np.zeros(2)}, bad).num_ranks == 2
        assert TensorShardSpec((4,), 0, (bad, bad)).shard_sizes == (2, 2)
        return
    with pytest.raises(InvalidArgumentError, match="is not an int"):
        flat_shard_metadata({"w": np.zeros(2)}, bad)
    with pytest.raises(InvalidArgumentError, match="is not an int"):
        TensorShardSpec((4,), 0, (bad, 4 - bad))
