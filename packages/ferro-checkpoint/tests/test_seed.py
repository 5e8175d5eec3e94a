"""The seed checkpoint.rs tests, ported."""

import json

import numpy as np
import pytest
from _util import save_all, shards_of, spec_for

from ferro_checkpoint import (
    AsyncCheckpointer,
    DistributedCheckpoint,
    InvalidArgumentError,
    MetadataError,
    MissingShardError,
    ShardMetadata,
    TensorShardSpec,
    compute_shard_sizes,
    concat_along_dim,
    flat_shard_metadata,
    load_distributed,
    reshard,
    save_distributed,
    slice_along_dim,
)


def test_save_load_single_rank(tmp_path):
    full = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1.0, 2.0])}
    save_all(full, tmp_path, 1)
    out = load_distributed(tmp_path, 0, 1)
    for k in full:
        np.testing.assert_array_equal(out[k], full[k])
        assert out[k].dtype == full[k].dtype


def test_save_load_two_ranks(tmp_path):
    full = {"w": np.arange(8, dtype=np.float64)}
    spec = save_all(full, tmp_path, 2)
    for r in range(2):
        np.testing.assert_array_equal(load_distributed(tmp_path, r, 2)["w"],
                                      shards_of(full, spec, r)["w"])


@pytest.mark.parametrize("old,new", [(2, 4), (4, 2), (3, 2), (2, 2), (1, 3)])
def test_reshard(tmp_path, old, new):
    full = {"w": np.arange(10, dtype=np.float32), "m": np.arange(21.0).reshape(7, 3)}
    save_all(full, tmp_path, old)
    new_spec = spec_for(full, new)
    for r in range(new):
        got = reshard(tmp_path, old, new, r)
        for k in full:
            np.testing.assert_array_equal(got[k], shards_of(full, new_spec, r)[k])


def test_reshard_dim1(tmp_path):
    full = {"w": np.arange(24.0).reshape(4, 6)}
    save_all(full, tmp_path, 2, dims={"w": 1})
    parts = [reshard(tmp_path, 2, 3, r)["w"] for r in range(3)]
    assert [p.shape for p in parts] == [(4, 2), (4, 2), (4, 2)]
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), full["w"])


def test_reshard_3_to_2_uneven(tmp_path):
    full = {"w": np.arange(7.0)}
    save_all(full, tmp_path, 3)
    a, b = (reshard(tmp_path, 3, 2, r)["w"] for r in range(2))
    np.testing.assert_array_equal(a, [0, 1, 2, 3])
    np.testing.assert_array_equal(b, [4, 5, 6])


def test_load_distributed_reshards_when_world_size_differs(tmp_path):
    full = {"w": np.arange(12.0)}
    save_all(full, tmp_path, 4)
    np.testing.assert_array_equal(load_distributed(tmp_path, 1, 2)["w"], np.arange(6.0, 12.0))


def test_metadata_roundtrip():
    meta = ShardMetadata(3, {"a": TensorShardSpec((10, 4), 1, (2, 1, 1)),
                             "b": TensorShardSpec((5,), 0, (2, 2, 1))}, "abc")
    back = ShardMetadata.from_json(meta.to_json())
    assert back == meta
    raw = json.loads(meta.to_json())
    assert raw["format_version"] == 2 and raw["tensor_specs"]["a"]["shard_dim"] == 1


def test_compute_shard_sizes():
    assert compute_shard_sizes(8, 4) == (2, 2, 2, 2)
    assert compute_shard_sizes(10, 3) == (4, 3, 3)
    assert compute_shard_sizes(2, 4) == (1, 1, 0, 0)


def test_concat_and_slice():
    a, b = np.arange(6.0).reshape(2, 3), np.arange(6.0, 12.0).reshape(2, 3)
    np.testing.assert_array_equal(concat_along_dim([a, b], 0), np.concatenate([a, b], 0))
    np.testing.assert_array_equal(concat_along_dim([a, b], 1), np.concatenate([a, b], 1))
    np.testing.assert_array_equal(concat_along_dim([np.arange(3), np.arange(2)], 0),
                                  [0, 1, 2, 0, 1])
    m = np.arange(20.0).reshape(4, 5)
    np.testing.assert_array_equal(slice_along_dim(m, 0, 1, 3), m[1:3])
    np.testing.assert_array_equal(slice_along_dim(m, 1, 2, 5), m[:, 2:5])
    np.testing.assert_array_equal(slice_along_dim(np.arange(5), 0, 1, 4), [1, 2, 3])


def test_flat_shard_metadata():
    meta = flat_shard_metadata({"w": np.zeros(3), "b": np.zeros((2, 2))}, 2)
    assert meta.num_ranks == 2
    assert meta.tensor_specs["w"] == TensorShardSpec((6,), 0, (3, 3))
    assert meta.tensor_specs["b"] == TensorShardSpec((8,), 0, (4, 4))


def test_async_checkpoint_basic_wait_idempotent_is_done(tmp_path):
    full = {"w": np.arange(10.0)}
    spec = spec_for(full, 1)
    ck = AsyncCheckpointer(tmp_path, 0, 1, spec)
    state = {"w": full["w"].copy()}
    fut = ck.save_async(state)
    state["w"][:] = -1  # the staging copy protects the save
    fut.wait()
    fut.wait()
    assert fut.is_done()
    np.testing.assert_array_equal(load_distributed(tmp_path, 0, 1)["w"], full["w"])


def test_save_invalid_rank(tmp_path):
    spec = spec_for({"w": np.zeros(4)}, 2)
    with pytest.raises(InvalidArgumentError, match="rank 5 is out of range for world_size 2"):
        save_distributed({"w": np.zeros(2)}, tmp_path, 5, 2, spec)


def test_load_missing_metadata(tmp_path):
    with pytest.raises(MetadataError, match="metadata.json is missing"):
        load_distributed(tmp_path, 0, 1)


def test_load_missing_shard(tmp_path):
    save_all({"w": np.arange(4.0)}, tmp_path, 2)
    (tmp_path / "rank_1.safetensors").unlink()
    with pytest.raises(MissingShardError, match="rank_1.safetensors is missing"):
        load_distributed(tmp_path, 1, 2)


def test_reshard_multiple_tensors(tmp_path):
    full = {f"t{i}": np.arange(i + 5, dtype=np.float32) * i for i in range(5)}
    save_all(full, tmp_path, 2)
    parts = [reshard(tmp_path, 2, 3, r) for r in range(3)]
    for k in full:
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), full[k])


def test_distributed_checkpoint_struct(tmp_path):
    save_all({"w": np.arange(4.0)}, tmp_path, 2)
    ck = DistributedCheckpoint.open(tmp_path)
    assert ck.checkpoint_dir == tmp_path and ck.shard_metadata.num_ranks == 2
    np.testing.assert_array_equal(ck.load(0, 1)["w"], np.arange(4.0))


def test_reshard_same_world_size(tmp_path):
    full = {"w": np.arange(6.0)}
    save_all(full, tmp_path, 3)
    np.testing.assert_array_equal(reshard(tmp_path, 3, 3, 2)["w"], [4.0, 5.0])
