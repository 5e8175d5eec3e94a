"""Per-tensor crc32: recorded at save, verified on every load path (on by default), a flipped
byte raises ChecksumMismatchError naming file and tensor; ``verify=False`` skips it."""

import zlib

import numpy as np
import pytest
from _util import save_all, shards_of, spec_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ferro_checkpoint import (
    CheckpointManager,
    ChecksumMismatchError,
    InvalidArgumentError,
    SerializationError,
    consolidate,
    load_distributed,
    reshard,
)
from ferro_checkpoint.safetensors_io import SafetensorsFile

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8, np.uint16,
          np.bool_]
FULL = {"w": np.arange(40, dtype=np.float32).reshape(10, 4), "b": np.arange(6, dtype=np.int64)}


def flip_byte(path, name: str, k: int = 0) -> None:
    """Flip every bit of byte ``k`` of tensor ``name``'s data in shard file ``path``."""
    f = SafetensorsFile(path)
    _, _, s, t = f.entries[name]
    assert 0 <= k < t - s
    pos = f.data_start + s + k
    del f
    data = bytearray(path.read_bytes())
    data[pos] ^= 0xFF
    path.write_bytes(bytes(data))


def test_checksums_are_crc32_of_the_little_endian_bytes(tmp_path):
    spec = save_all(FULL, tmp_path, 2)
    for r in range(2):
        meta = SafetensorsFile(tmp_path / f"rank_{r}.safetensors").metadata
        for k, v in shards_of(FULL, spec, r).items():
            le = v.astype(v.dtype.newbyteorder("<")).tobytes()
            assert meta[f"ferro.crc32.{k}"] == f"{zlib.crc32(le):08x}"


@st.composite
def corrupted(draw):
    full, dims = {}, {}
    for i in range(draw(st.integers(1, 3))):
        shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6))
        full[f"t{i}"] = draw(hnp.arrays(draw(st.sampled_from(DTYPES)), shape))
        dims[f"t{i}"] = draw(st.integers(0, len(shape) - 1))
    world = draw(st.integers(1, 4))
    spec = spec_for(full, world, dims)
    hits = [(r, n) for r in range(world) for n in full
            if shards_of(full, spec, r)[n].nbytes > 0]
    rank, name = draw(st.sampled_from(hits))
    nbytes = shards_of(full, spec, rank)[name].nbytes
    return full, dims, world, rank, name, draw(st.integers(0, nbytes - 1))


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=corrupted())
def test_any_flipped_byte_is_caught_on_every_path(tmp_path_factory, case):
    full, dims, world, rank, name, k = case
    d = tmp_path_factory.mktemp("ckpt")
    spec = save_all(full, d, world, dims)
    path = d / f"rank_{rank}.safetensors"
    flip_byte(path, name, k)
    pattern = rf"{path}: tensor {name!r} is corrupt \(crc32 [0-9a-f]{{8}}, expected"
    with pytest.raises(ChecksumMismatchError, match=pattern):
        load_distributed(d, rank, world)
    with pytest.raises(ChecksumMismatchError, match=pattern):
        reshard(d, world, 1, 0)
    with pytest.raises(ChecksumMismatchError, match=pattern):
        consolidate(d, d / "full.safetensors")
    assert not (d / "full.safetensors").exists()
    got = load_distributed(d, rank, world, verify=False)  # skipped: the damage comes through
    assert got[name].tobytes() != shards_of(full, spec, rank)[name].tobytes()
    assert reshard(d, world, 1, 0, verify=False)[name].tobytes() != full[name].tobytes()
    with pytest.raises(ChecksumMismatchError):
        load_distributed(d, rank, world, verify=True)


def test_manager_restore_verifies_and_can_skip(tmp_path):
    spec = spec_for(FULL, 2)
    for r in range(2):
        CheckpointManager(tmp_path, r, 2).save(3, shards_of(FULL, spec, r), spec)
    flip_byte(tmp_path / "step_3" / "rank_1.safetensors", "w", 5)
    with pytest.raises(ChecksumMismatchError, match=r"rank_1.safetensors: tensor 'w'") as info:
        CheckpointManager(tmp_path, 0, 1).restore()
    assert isinstance(info.value, SerializationError)  # what callers caught before
    tensors, _ = CheckpointManager(tmp_path, 0, 1).restore(verify=False)
    assert tensors["w"].shape == FULL["w"].shape
    tensors, _ = CheckpointManager(tmp_path, 0, 2).restore()  # rank 0's shard is intact
    np.testing.assert_array_equal(tensors["w"], FULL["w"][:5])


def test_a_checksummed_shard_missing_one_checksum_is_refused(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    save_all(FULL, tmp_path, 1)
    path = tmp_path / "rank_0.safetensors"
    meta = dict(SafetensorsFile(path).metadata)
    del meta["ferro.crc32.b"]
    safetensors_numpy.save_file(safetensors_numpy.load_file(str(path)), str(path), metadata=meta)
    with pytest.raises(ChecksumMismatchError, match=r"tensor 'b' has no checksum"):
        load_distributed(tmp_path, 0, 1)
    np.testing.assert_array_equal(load_distributed(tmp_path, 0, 1, verify=False)["b"],
                                  FULL["b"])


@pytest.mark.parametrize("value", ["yes", 1, 0.0, "0"])
def test_a_verify_that_is_not_a_bool_is_refused(tmp_path, value):
    save_all(FULL, tmp_path, 1)
    with pytest.raises(InvalidArgumentError, match="verify"):
        load_distributed(tmp_path, 0, 1, verify=value)
    with pytest.raises(InvalidArgumentError, match="verify"):
        consolidate(tmp_path, tmp_path / "full.safetensors", verify=value)
    assert not (tmp_path / "full.safetensors").exists()



@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_verify_must_be_a_bool_or_none(tmp_path, bad):
    save_all(FULL, tmp_path, 1)
    with pytest.raises(InvalidArgumentError, match="verify"):
        load_distributed(tmp_path, 0, 1, verify=bad)
    with pytest.raises(InvalidArgumentError, match="verify"):
        consolidate(tmp_path, tmp_path / "x.safetensors", verify=bad)
    with pytest.raises(InvalidArgumentError, match="verify"):
        CheckpointManager(tmp_path / "m", 0, 1).restore(verify=bad)
