"""Corrupt, truncated, missing and mismatched shards; collective and async saves."""

import threading

import numpy as np
import pytest
from _util import save_all, shards_of, spec_for

from ferro_checkpoint import (
    AsyncCheckpointer,
    AsyncCheckpointError,
    IncompleteCheckpointError,
    MetadataError,
    SerializationError,
    TensorError,
    load_distributed,
    save_distributed,
)

FULL = {"w": np.arange(40, dtype=np.float32).reshape(10, 4), "b": np.arange(6, dtype=np.int64)}


def test_corrupt_byte_is_detected_and_the_file_named(tmp_path):
    save_all(FULL, tmp_path, 2)
    p = tmp_path / "rank_1.safetensors"
    data = bytearray(p.read_bytes())
    data[-3] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(SerializationError, match=r"rank_1.safetensors: tensor 'w' is corrupt"):
        load_distributed(tmp_path, 1, 2)
    with pytest.raises(SerializationError, match="rank_1"):
        load_distributed(tmp_path, 0, 1)  # a reshard reading that shard fails too


def test_truncated_file(tmp_path):
    save_all(FULL, tmp_path, 2)
    p = tmp_path / "rank_0.safetensors"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(SerializationError, match="rank_0.safetensors: truncated"):
        load_distributed(tmp_path, 0, 2)
    p.write_bytes(b"\x01\x02")
    with pytest.raises(SerializationError, match="truncated"):
        load_distributed(tmp_path, 0, 2)


def test_garbage_header(tmp_path):
    save_all(FULL, tmp_path, 1)
    (tmp_path / "rank_0.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" +
                                                  b"{not json at all" + b"\x00" * 32)
    with pytest.raises(SerializationError, match="corrupt header"):
        load_distributed(tmp_path, 0, 1)


def test_shard_from_another_save_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    save_all(FULL, a, 2, checkpoint_id="step100")
    save_all({k: v + 1 for k, v in FULL.items()}, b, 2, checkpoint_id="step200")
    (a / "rank_1.safetensors").write_bytes((b / "rank_1.safetensors").read_bytes())
    with pytest.raises(IncompleteCheckpointError, match="shards of different saves are mixed"):
        load_distributed(a, 1, 2)


def test_shape_mismatch_with_metadata(tmp_path):
    save_all(FULL, tmp_path, 2)
    meta = (tmp_path / "metadata.json").read_text().replace("[10, 4]", "[12, 4]")
    meta = meta.replace('"shard_sizes": [\n    5,\n    5\n   ]', '"shard_sizes": [6, 6]')
    (tmp_path / "metadata.json").write_text(meta)
    with pytest.raises((TensorError, MetadataError)):
        load_distributed(tmp_path, 0, 2)


def test_bad_format_version(tmp_path):
    save_all(FULL, tmp_path, 1)
    p = tmp_path / "metadata.json"
    p.write_text(p.read_text().replace('"format_version": 2', '"format_version": 99'))
    with pytest.raises(MetadataError, match="format_version 99 is not supported"):
        load_distributed(tmp_path, 0, 1)


def test_wrong_shard_shape_on_save(tmp_path):
    spec = spec_for(FULL, 2)
    bad = shards_of(FULL, spec, 0)
    bad["w"] = bad["w"][:4]
    with pytest.raises(TensorError, match=r"'w' has shape \(4, 4\), its shard spec expects"):
        save_distributed(bad, tmp_path, 0, 2, spec)
    with pytest.raises(TensorError, match="not in the shard spec"):
        save_distributed({"zzz": np.zeros(1)}, tmp_path, 0, 2, spec)


def test_uncommitted_save_leaves_previous_checkpoint_intact(tmp_path):
    save_all(FULL, tmp_path, 2, checkpoint_id="first")
    spec = spec_for(FULL, 2)
    new = {k: v * 2 for k, v in FULL.items()}
    save_distributed(shards_of(new, spec, 0), tmp_path, 0, 2, spec, checkpoint_id="second")
    # rank 1 never saved: not committed, the first checkpoint loads bit-exactly
    for r in range(2):
        got = load_distributed(tmp_path, r, 2)
        np.testing.assert_array_equal(got["w"], shards_of(FULL, spec, r)["w"])
    save_distributed(shards_of(new, spec, 1), tmp_path, 1, 2, spec, checkpoint_id="second")
    np.testing.assert_array_equal(load_distributed(tmp_path, 0, 1)["w"], new["w"])


def test_saving_a_smaller_world_removes_stale_shards(tmp_path):
    save_all(FULL, tmp_path, 4, checkpoint_id="a")
    save_all(FULL, tmp_path, 2, checkpoint_id="b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metadata.json", "rank_0.safetensors",
                                                          "rank_1.safetensors"]


def test_collective_save_with_a_backend(tmp_path):
    pytest.importorskip("ferro_backend")
    from ferro_backend.testing import run_ranks

    spec = spec_for(FULL, 3)

    def fn(b):
        return save_distributed(shards_of(FULL, spec, b.rank), tmp_path, b.rank, 3, spec,
                                backend=b)

    ids = run_ranks(fn, 3, timeout=30)
    assert len(set(ids)) == 1 and len(ids[0]) == 32
    np.testing.assert_array_equal(load_distributed(tmp_path, 0, 1)["w"], FULL["w"])


def test_async_second_save_refused_and_errors_reraised(tmp_path):
    spec = spec_for(FULL, 1)
    ck = AsyncCheckpointer(tmp_path, 0, 1, spec)
    gate = threading.Event()
    import ferro_checkpoint.async_save as mod

    real = mod.save_distributed

    def slow(*args, **kwargs):
        gate.wait(10)
        return real(*args, **kwargs)

    mod.save_distributed = slow
    try:
        fut = ck.save_async(FULL)
        with pytest.raises(AsyncCheckpointError, match="still in flight"):
            ck.save_async(FULL)
        gate.set()
        fut.wait(10)
    finally:
        mod.save_distributed = real
    bad = ck.save_async({"w": FULL["w"][:3], "b": FULL["b"]})
    for _ in range(2):  # idempotent: raises every time
        with pytest.raises(AsyncCheckpointError, match="TensorError") as info:
            bad.wait(10)
        assert isinstance(info.value.__cause__, TensorError)
    assert bad.is_done()


def test_async_collective_save(tmp_path):
    pytest.importorskip("ferro_backend")
    from ferro_backend.testing import run_ranks

    spec = spec_for(FULL, 2)

    def fn(b):
        ck = AsyncCheckpointer(tmp_path, b.rank, 2, spec, backend=b)
        fut = ck.save_async(shards_of(FULL, spec, b.rank))
        b.barrier(timeout=10)  # traffic on the parent meanwhile does not mix
        fut.wait(20)
        return fut.checkpoint_id

    ids = run_ranks(fn, 2, timeout=30)
    assert ids[0] == ids[1]
    np.testing.assert_array_equal(load_distributed(tmp_path, 0, 1)["b"], FULL["b"])
