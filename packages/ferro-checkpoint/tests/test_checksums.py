"""CRC-32C per chunk of each tensor: recorded at save (format 2), verified on every load path
(on by default, in the pass that reads the bytes), a flipped byte raises ChecksumMismatchError
naming the file, the tensor and the bytes; ``verify=False`` skips it; a reshard reads (and
checks) only the chunks holding its rows."""

import json
from pathlib import Path

import numpy as np
import pytest
from _util import save_all, shards_of, spec_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_copy_crc import crc32c_ref

from ferro_checkpoint import (
    CheckpointIOError,
    CheckpointManager,
    ChecksumMismatchError,
    InvalidArgumentError,
    SerializationError,
    consolidate,
    load_distributed,
    reshard,
    safetensors_io,
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


@pytest.fixture
def small_chunks(monkeypatch):
    """Saves cut tensors into chunks of 8 bytes, so small tensors have several."""
    monkeypatch.setattr(safetensors_io, "CHUNK", 8)
    return 8


@pytest.mark.parametrize("chunk", [8, 1 << 20])
def test_checksums_are_crc32c_of_each_chunk_of_the_little_endian_bytes(tmp_path, monkeypatch,
                                                                       chunk):
    monkeypatch.setattr(safetensors_io, "CHUNK", chunk)
    spec = save_all(FULL, tmp_path, 2)
    assert json.loads((tmp_path / "metadata.json").read_text())["format_version"] == 2
    for r in range(2):
        meta = SafetensorsFile(tmp_path / f"rank_{r}.safetensors").metadata
        assert meta["ferro.checksum"] == f"crc32c/{chunk}"
        for k, v in shards_of(FULL, spec, r).items():
            le = v.astype(v.dtype.newbyteorder("<")).tobytes()
            want = [crc32c_ref(le[i:i + chunk]) for i in range(0, max(len(le), 1), chunk)]
            assert meta[f"ferro.crc32c.{k}"] == "".join(f"{c:08x}" for c in want)


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
@given(case=corrupted(), chunk=st.sampled_from([8, 24, 1 << 20]))
def test_any_flipped_byte_is_caught_on_every_path(tmp_path_factory, case, chunk):
    full, dims, world, rank, name, k = case
    d = tmp_path_factory.mktemp("ckpt")
    saved = safetensors_io.CHUNK
    safetensors_io.CHUNK = chunk
    try:
        spec = save_all(full, d, world, dims)
    finally:
        safetensors_io.CHUNK = saved
    path = d / f"rank_{rank}.safetensors"
    flip_byte(path, name, k)
    lo = k // chunk * chunk  # the chunk of the flipped byte, named in the error
    pattern = (rf"{path}: tensor {name!r} is corrupt: bytes \[{lo}, \d+\) \(chunk {k // chunk} "
               rf"of \d+\) have crc32c [0-9a-f]{{8}}, expected [0-9a-f]{{8}}")
    with pytest.raises(ChecksumMismatchError, match=pattern):
        load_distributed(d, rank, world)
    with pytest.raises(ChecksumMismatchError, match=pattern):
        load_distributed(d, rank, world, mmap=True)
    lazy = load_distributed(d, rank, world, mmap=True, verify="lazy")  # checked on lookup
    for _ in range(2):
        with pytest.raises(ChecksumMismatchError, match=pattern):
            lazy[name]
    assert all(lazy[n].shape == shards_of(full, spec, rank)[n].shape for n in full if n != name)
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


def rewrite_header(path, edit) -> None:
    """Rewrite shard ``path`` with ``edit(metadata)`` applied to its header's metadata."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    meta = dict(SafetensorsFile(path).metadata)
    edit(meta)
    safetensors_numpy.save_file(safetensors_numpy.load_file(str(path)), str(path), metadata=meta)


@pytest.mark.parametrize("edit, error", [
    (lambda m: m.pop("ferro.crc32c.b"), r"tensor 'b' has no checksum"),
    (lambda m: m.update({"ferro.crc32c.b": "abc"}), r"tensor 'b'.s checksums are malformed"),
    (lambda m: m.update({"ferro.crc32c.b": "zz" * 4}), r"tensor 'b'.s checksums are malformed"),
    (lambda m: m.update({"ferro.checksum": "md5/8"}), r"checksum scheme 'md5/8' is not supported"),
    (lambda m: m.pop("ferro.checksum"), r"records no crc32c checksums .* format 2"),
])
def test_a_shard_with_missing_or_malformed_checksums_is_refused(tmp_path, edit, error):
    save_all(FULL, tmp_path, 1)
    rewrite_header(tmp_path / "rank_0.safetensors", edit)
    with pytest.raises(ChecksumMismatchError, match=error):
        load_distributed(tmp_path, 0, 1)
    with pytest.raises(ChecksumMismatchError, match=error):
        load_distributed(tmp_path, 0, 1, mmap=True)
    np.testing.assert_array_equal(load_distributed(tmp_path, 0, 1, verify=False)["b"],
                                  FULL["b"])


def test_a_reshard_reads_and_checks_only_the_chunks_it_needs(tmp_path, small_chunks):
    """Rows 0..7 of a (16, 2) float32 tensor are bytes [0, 64) of the one shard; a damaged row 12
    is in chunk 12: the new rank 0 of 2 never reads it, rank 1 does and refuses it."""
    full = {"w": np.arange(32, dtype=np.float32).reshape(16, 2)}
    save_all(full, tmp_path, 1)
    flip_byte(tmp_path / "rank_0.safetensors", "w", 12 * 8 + 3)
    np.testing.assert_array_equal(reshard(tmp_path, 1, 2, 0)["w"], full["w"][:8])
    np.testing.assert_array_equal(reshard(tmp_path, 1, 2, 0, mmap=True)["w"], full["w"][:8])
    with pytest.raises(ChecksumMismatchError, match=r"bytes \[96, 104\) \(chunk 12 of 16\)"):
        reshard(tmp_path, 1, 2, 1)
    with pytest.raises(ChecksumMismatchError, match=r"chunk 12 of 16"):
        load_distributed(tmp_path, 0, 1)


@pytest.mark.parametrize("value", ["yes", 1, 0.0, "0"])
def test_a_verify_that_is_not_a_bool_is_refused(tmp_path, value):
    save_all(FULL, tmp_path, 1)
    with pytest.raises(InvalidArgumentError, match="verify"):
        load_distributed(tmp_path, 0, 1, verify=value)
    with pytest.raises(InvalidArgumentError, match="verify"):
        consolidate(tmp_path, tmp_path / "full.safetensors", verify=value)
    assert not (tmp_path / "full.safetensors").exists()



def test_lazy_verification_needs_mmap(tmp_path):
    save_all(FULL, tmp_path, 1)
    with pytest.raises(InvalidArgumentError, match="verify='lazy' needs mmap=True"):
        load_distributed(tmp_path, 0, 1, verify="lazy")
    with pytest.raises(InvalidArgumentError, match="verify='lazy' needs mmap=True"):
        CheckpointManager(tmp_path / "m", 0, 1).restore(verify="lazy")


@pytest.mark.parametrize("bad", ["yes", 1, 0.0, "LAZY"])
def test_verify_must_be_a_bool_or_none(tmp_path, bad):
    save_all(FULL, tmp_path, 1)
    with pytest.raises(InvalidArgumentError, match="verify"):
        load_distributed(tmp_path, 0, 1, verify=bad)
    with pytest.raises(InvalidArgumentError, match="verify"):
        consolidate(tmp_path, tmp_path / "x.safetensors", verify=bad)
    with pytest.raises(InvalidArgumentError, match="verify"):
        CheckpointManager(tmp_path / "m", 0, 1).restore(verify=bad)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_failed_write_is_a_checkpoint_io_error_naming_the_file():
    """The fused write-and-checksum pass reports the write's errno (here ENOSPC)."""
    with pytest.raises(CheckpointIOError, match=r"writing /dev/full: .*No space left"):
        safetensors_io.write_safetensors(Path("/dev/full"), [("w", "F32", (4,))],
                                         lambda n: np.ones(4, np.float32))
