"""Every test of the seed fsdp.rs (both versions carry the same 22), ported one to one."""

import numpy as np
import pytest
from _helpers import FS, HS, NS, SGO, SeedModule, run

from ferro_backend import InvalidWorldSizeError, SimulatedBackend
from ferro_fsdp import FSDP, FSDPStateError, ShardingStrategy


def one_rank():
    return SimulatedBackend.create_group(1)[0]


def test_fsdp_sharding():
    def body(b):
        fsdp = FSDP(SeedModule([10.0, 20.0, 30.0, 40.0]), b)
        return fsdp.module.weight.data.tolist()

    assert run(body, 2) == [[10.0, 20.0], [30.0, 40.0]]


def test_fsdp_shard_requires_grad():
    def body(b):
        fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), b)
        return fsdp.module.weight.requires_grad

    assert all(run(body, 2))


def test_fsdp_forward_restores_shards():
    def body(b):
        fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), b)
        fsdp.forward(np.array([1.0], np.float32))
        w = fsdp.module.weight
        assert w.data.size == 2
        assert w.requires_grad

    run(body, 2)


def test_fsdp_forward_produces_correct_output():
    def body(b):
        fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), b)
        return fsdp.forward(np.array([2.0], np.float32))[0]

    for v in run(body, 2):
        assert abs(v - 20.0) < 1e-6


def test_fsdp_update_shards():
    fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), one_rank())
    fsdp.update_shards([10.0, 20.0, 30.0, 40.0])
    assert fsdp.module.weight.data.tolist() == [10.0, 20.0, 30.0, 40.0]


def test_fsdp_update_shards_size_validation():
    fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), one_rank())
    with pytest.raises(ValueError, match="expected 4 elements but got 2"):
        fsdp.update_shards([10.0, 20.0])


def test_fsdp_sync_gradients_single_rank():
    fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), one_rank())
    fsdp.forward(np.array([1.0], np.float32))
    fsdp.full_params[0].grad = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    fsdp.sync_gradients()
    np.testing.assert_array_equal(fsdp.module.weight.grad, np.array([0.1, 0.2, 0.3, 0.4], np.float32))


def test_fsdp_shard_grad_op_keeps_full_params():
    def body(b):
        fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), b, ShardingStrategy.SHARD_GRAD_OP)
        assert fsdp.strategy is ShardingStrategy.SHARD_GRAD_OP
        return fsdp.module.weight.data.tolist()

    assert run(body, 2) == [[1.0, 2.0, 3.0, 4.0]] * 2


def test_fsdp_shard_grad_op_sync_gradients_multi_rank():
    def body(b):
        fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), b, SGO)
        fsdp.forward(np.array([1.0], np.float32))
        fsdp.full_params[0].grad = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
        fsdp.sync_gradients()
        w = fsdp.module.weight
        assert w.data.size == 4, "SHARD_GRAD_OP keeps params full"
        assert w.grad.shape == (4,), "grad should be full-shape"
        return w.grad.tolist()

    g0, g1 = run(body, 2)
    assert abs(g0[0] - 1.0) < 1e-6 and abs(g0[1] - 2.0) < 1e-6
    assert g0[2] == 0.0 and g0[3] == 0.0
    assert g1[0] == 0.0 and g1[1] == 0.0
    assert abs(g1[2] - 3.0) < 1e-6 and abs(g1[3] - 4.0) < 1e-6


def test_fsdp_shard_grad_op_broadcast_updated_params():
    def body(b):
        fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), b, SGO)
        local = fsdp.module.weight.data.copy()
        if b.rank == 0:
            local[:2] += 10.0
        else:
            local[2:] += 20.0
        fsdp.module.weight.data = local
        fsdp.broadcast_updated_params()
        return fsdp.module.weight.data.tolist()

    assert run(body, 2) == [[11.0, 12.0, 23.0, 24.0]] * 2


def test_fsdp_no_shard_is_ddp_equivalent():
    def body(b):
        fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), b, NS)
        assert fsdp.strategy is NS
        assert fsdp.module.weight.data.size == 4
        fsdp.forward(np.array([1.0], np.float32))
        fsdp.full_params[0].grad = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
        fsdp.sync_gradients()
        w = fsdp.module.weight
        assert w.data.size == 4, "NO_SHARD keeps params full"
        return w.grad

    for g in run(body, 2):
        np.testing.assert_allclose(g, [1.0, 2.0, 3.0, 4.0], atol=1e-6)


def test_fsdp_prefetched_forward_matches_sync_forward():
    def body(b):
        fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), b)
        assert not fsdp.has_pending_prefetch
        fsdp.prefetch_forward_params()
        assert fsdp.has_pending_prefetch
        sum(float(i) for i in range(100))  # local compute between prefetch and forward
        out = fsdp.forward(np.array([2.0], np.float32))
        assert not fsdp.has_pending_prefetch
        return out[0]

    for v in run(body, 2):
        assert abs(v - 20.0) < 1e-6


def test_fsdp_forward_without_prefetch_still_works():
    def body(b):
        fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), b)
        assert not fsdp.has_pending_prefetch
        return fsdp.forward(np.array([2.0], np.float32))[0]

    for v in run(body, 2):
        assert abs(v - 20.0) < 1e-6


def test_fsdp_prefetch_rejects_double_call():
    fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), one_rank())
    fsdp.prefetch_forward_params()
    with pytest.raises(FSDPStateError, match="called twice"):
        fsdp.prefetch_forward_params()
    fsdp.forward(np.array([1.0], np.float32))  # consumes the pending gather
    assert not fsdp.has_pending_prefetch


def test_fsdp_prefetch_rejects_non_fullshard():
    fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), one_rank(), SGO)
    with pytest.raises(FSDPStateError, match="FULL_SHARD"):
        fsdp.prefetch_forward_params()


def test_fsdp_no_shard_broadcast_is_noop():
    fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), one_rank(), NS)
    fsdp.broadcast_updated_params()
    assert fsdp.module.weight.data.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_fsdp_sync_gradients_multi_rank():
    def body(b):
        fsdp = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), b)
        fsdp.forward(np.array([1.0], np.float32))
        fsdp.full_params[0].grad = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
        fsdp.sync_gradients()
        return fsdp.module.weight.grad

    g0, g1 = run(body, 2)
    np.testing.assert_allclose(g0, [1.0, 2.0], atol=1e-6)
    np.testing.assert_allclose(g1, [3.0, 4.0], atol=1e-6)


def test_fsdp_hybrid_shard_rejects_uneven_world_size():
    group = SimulatedBackend.create_group(4)
    with pytest.raises(InvalidWorldSizeError):
        FSDP(SeedModule([1.0] * 8), group[0], HS, intra_node_size=3)


def test_fsdp_hybrid_shard_intra_node_sharding():
    def body(b):
        fsdp = FSDP(SeedModule([10.0, 20.0, 30.0, 40.0]), b, HS, intra_node_size=2)
        return fsdp.module.weight.data.tolist()

    shards = run(body, 4)
    for rank, shard in enumerate(shards):
        assert len(shard) == 2, "each rank gets 4/2 = 2 elements"
        assert shard == ([10.0, 20.0] if rank % 2 == 0 else [30.0, 40.0]), rank


def test_fsdp_hybrid_shard_sync_gradients():
    def body(b):
        fsdp = FSDP(SeedModule([10.0, 20.0, 30.0, 40.0]), b, HS, intra_node_size=2)
        fsdp.forward(np.array([1.0], np.float32))
        fsdp.full_params[0].grad = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
        fsdp.sync_gradients()
        w = fsdp.module.weight
        assert w.data.size == 2, "HYBRID_SHARD keeps params as intra-shards"
        return w.grad

    for rank, g in enumerate(run(body, 4)):
        np.testing.assert_allclose(g, [1.0, 2.0] if rank % 2 == 0 else [3.0, 4.0], atol=1e-6)


def test_fsdp_hybrid_shard_inter_node_averaging():
    def body(b):
        fsdp = FSDP(SeedModule([0.0] * 4), b, HS, intra_node_size=2)
        fsdp.forward(np.array([1.0], np.float32))
        grad = [2.0, 4.0, 6.0, 8.0] if b.rank < 2 else [10.0, 20.0, 30.0, 40.0]
        fsdp.full_params[0].grad = np.array(grad, np.float32)
        fsdp.sync_gradients()
        return fsdp.module.weight.grad

    for rank, g in enumerate(run(body, 4)):
        np.testing.assert_allclose(g, [6.0, 12.0] if rank % 2 == 0 else [18.0, 24.0], atol=1e-4)


def test_seed_fs_constant_is_default():
    fsdp = FSDP(SeedModule([1.0, 2.0]), one_rank())
    assert fsdp.strategy is FS
