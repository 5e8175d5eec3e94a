"""Checkpoints written before save identities: plain safetensors shards (no ``__metadata__``) with
a bare metadata.json, and shards with a checkpoint id and crc32s but no shard ids, written here
with ``safetensors.numpy.save_file`` as the old code did, load on every path."""

import json
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
    ShardMismatchError,
    consolidate,
    load_distributed,
    reshard,
)

safetensors_numpy = pytest.importorskip("safetensors.numpy")

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8,
          np.bool_]
FULL = {"w": np.arange(40, dtype=np.float32).reshape(10, 4), "b": np.arange(6, dtype=np.int64)}


def write_old(directory, full, world, dims=None, *, ckpt_id=None):
    """An old checkpoint: without ``ckpt_id`` the first format (bare shards, a metadata.json
    with only num_ranks and tensor_specs); with it the format before shard ids (a checkpoint
    id, rank, world size and crc32 per tensor in each header)."""
    directory.mkdir(parents=True, exist_ok=True)
    spec = spec_for(full, world, dims)
    for r in range(world):
        shard = shards_of(full, spec, r)
        meta = None
        if ckpt_id is not None:
            meta = {"ferro.checkpoint_id": ckpt_id, "ferro.rank": str(r),
                    "ferro.world_size": str(world)}
            meta.update({f"ferro.crc32.{k}": f"{zlib.crc32(v.tobytes()):08x}"
                         for k, v in shard.items()})
        safetensors_numpy.save_file(shard, str(directory / f"rank_{r}.safetensors"),
                                    metadata=meta)
    specs = {k: {"full_shape": list(s.full_shape), "shard_dim": s.shard_dim,
                 "shard_sizes": list(s.shard_sizes)} for k, s in spec.tensor_specs.items()}
    raw = {"num_ranks": world, "tensor_specs": specs}
    if ckpt_id is not None:
        raw = {"format": "ferro-checkpoint", "format_version": 1, "checkpoint_id": ckpt_id,
               **raw}
    (directory / "metadata.json").write_text(json.dumps(raw))
    return spec


@st.composite
def state_dicts(draw):
    full, dims = {}, {}
    for i in range(draw(st.integers(1, 3))):
        shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=7))
        full[f"t{i}"] = draw(hnp.arrays(draw(st.sampled_from(DTYPES)), shape))
        dims[f"t{i}"] = draw(st.integers(0, len(shape) - 1))
    return full, dims


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sd=state_dicts(), n=st.integers(1, 4), m=st.integers(1, 4),
       ckpt_id=st.sampled_from([None, "g3"]))
def test_old_checkpoints_load_on_any_world_size(tmp_path_factory, sd, n, m, ckpt_id):
    full, dims = sd
    d = tmp_path_factory.mktemp("old")
    write_old(d, full, n, dims, ckpt_id=ckpt_id)
    new_spec = spec_for(full, m, dims)
    for r in range(m):
        got = load_distributed(d, r, m)
        for k, want in shards_of(full, new_spec, r).items():
            assert got[k].dtype == want.dtype and got[k].shape == want.shape
            assert got[k].tobytes() == want.tobytes()
    consolidate(d, d / "full.safetensors")
    plain = safetensors_numpy.load_file(str(d / "full.safetensors"))
    assert all(plain[k].tobytes() == v.tobytes() for k, v in full.items())


@pytest.mark.parametrize("ckpt_id", [None, "step5"])
def test_manager_restores_an_old_step(tmp_path, ckpt_id):
    write_old(tmp_path / "step_5", FULL, 2, ckpt_id=ckpt_id)
    tensors, extra = CheckpointManager(tmp_path, 0, 1).restore()
    np.testing.assert_array_equal(tensors["w"], FULL["w"])
    assert extra == {}
    tensors, _ = CheckpointManager(tmp_path, 1, 2).restore(5)
    np.testing.assert_array_equal(tensors["b"], FULL["b"][3:])


def test_old_checksums_are_still_verified(tmp_path):
    write_old(tmp_path, FULL, 2, ckpt_id="g1")
    p = tmp_path / "rank_1.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match=r"rank_1.safetensors: tensor"):
        reshard(tmp_path, 2, 1, 0)
    reshard(tmp_path, 2, 1, 0, verify=False)


def test_old_checkpoints_still_refuse_shards_of_another_checkpoint_id(tmp_path):
    write_old(tmp_path / "a", FULL, 2, ckpt_id="g1")
    write_old(tmp_path / "b", FULL, 2, ckpt_id="g2")
    (tmp_path / "a" / "rank_0.safetensors").write_bytes(
        (tmp_path / "b" / "rank_0.safetensors").read_bytes())
    with pytest.raises(ShardMismatchError, match=r"'g2'.*'g1'"):
        load_distributed(tmp_path / "a", 0, 2)


@pytest.mark.parametrize("ckpt_id", [None, "g1"])
def test_an_old_shard_copied_into_a_new_checkpoint_is_refused(tmp_path, ckpt_id):
    save_all(FULL, tmp_path / "new", 2)  # default id: also "g1"
    write_old(tmp_path / "old", FULL, 2, ckpt_id=ckpt_id)
    path = tmp_path / "new" / "rank_1.safetensors"
    path.write_bytes((tmp_path / "old" / "rank_1.safetensors").read_bytes())
    with pytest.raises(ShardMismatchError, match="shard None"):
        load_distributed(tmp_path / "new", 1, 2)


def test_a_new_save_over_an_old_checkpoint_binds_its_shards(tmp_path):
    write_old(tmp_path, FULL, 3)
    save_all({k: v * 2 for k, v in FULL.items()}, tmp_path, 2)
    meta = json.loads((tmp_path / "metadata.json").read_text())
    assert meta["checkpoint_id"] == "g1" and len(meta["shard_ids"]) == 2
    assert not (tmp_path / "rank_2.safetensors").exists()
    np.testing.assert_array_equal(load_distributed(tmp_path, 0, 1)["w"], FULL["w"] * 2)
