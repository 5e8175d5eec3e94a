"""The seed collective.rs tests, ported."""

import numpy as np
import pytest

from ferro_backend import InvalidRankError, SimulatedBackend, SizeMismatchError
from ferro_backend.testing import run_ranks
from ferro_collective import ReduceOp, all_gather, allreduce, barrier, broadcast, reduce_scatter


def test_allreduce_sum_4_ranks():
    res = run_ranks(lambda b: allreduce(np.full(4, b.rank + 1.0, np.float32), b), 4)
    for r in res:
        np.testing.assert_array_equal(r, np.full(4, 10.0, np.float32))


def test_allreduce_mean_4_ranks():
    res = run_ranks(lambda b: allreduce(np.full(3, b.rank * 2.0), b, ReduceOp.MEAN), 4)
    for r in res:
        np.testing.assert_array_equal(r, np.full(3, 3.0))


def test_broadcast_from_rank_0():
    res = run_ranks(lambda b: broadcast(np.array([1.0, 2, 3]) if b.rank == 0 else np.zeros(3),
                                        b, 0), 3)
    for r in res:
        np.testing.assert_array_equal(r, [1.0, 2.0, 3.0])


def test_barrier_completes():
    assert run_ranks(lambda b: barrier(b, timeout=10), 4) == [None] * 4


def test_broadcast_invalid_root():
    g = SimulatedBackend.create_group(2)
    with pytest.raises(InvalidRankError, match="root 5"):
        broadcast(np.zeros(3, np.float32), g[0], 5)


def test_allreduce_single_rank():
    (b,) = SimulatedBackend.create_group(1)
    x = np.array([1.0, 2.0, 3.0], np.float32)
    out = allreduce(x, b)
    np.testing.assert_array_equal(out, x)
    assert out is not x


def test_bytes_roundtrip_f32_and_f64():
    # the seed's floats_to_bytes/bytes_to_floats are numpy views here; the wire is the buffer
    for dt in (np.float32, np.float64):
        x = np.array([1.0, 2.5, -3.14, 0.0], dt)
        np.testing.assert_array_equal(np.frombuffer(x.view(np.uint8).tobytes(), dt), x)


def test_all_gather_4_ranks():
    res = run_ranks(lambda b: all_gather(np.array([b.rank * 10.0, b.rank * 10.0 + 1]), b), 4)
    for r in res:
        np.testing.assert_array_equal(r, [0, 1, 10, 11, 20, 21, 30, 31])


def test_all_gather_preserves_shape():
    res = run_ranks(lambda b: all_gather(np.ones((2, 3), np.float32) * b.rank, b), 3)
    for r in res:
        assert r.shape == (6, 3)
        np.testing.assert_array_equal(r[2:4], np.ones((2, 3)))


def test_all_gather_single_rank():
    (b,) = SimulatedBackend.create_group(1)
    np.testing.assert_array_equal(all_gather(np.array([1.0, 2.0]), b), [1.0, 2.0])


def test_all_gather_zero_size():
    for r in run_ranks(lambda b: all_gather(np.zeros((0, 3), np.float32), b), 2):
        assert r.shape == (0, 3)


def test_reduce_scatter_sum_4_ranks():
    res = run_ranks(lambda b: reduce_scatter(np.array([1.0, 2, 3, 4], np.float32), b), 4)
    for rank, r in enumerate(res):
        assert r.shape == (1,)
        assert r[0] == [4.0, 8.0, 12.0, 16.0][rank]


def test_reduce_scatter_mean_2_ranks():
    res = run_ranks(lambda b: reduce_scatter(np.full(4, float(b.rank), np.float32), b,
                                             ReduceOp.MEAN), 2)
    for r in res:
        np.testing.assert_array_equal(r, [0.5, 0.5])


def test_reduce_scatter_single_rank():
    (b,) = SimulatedBackend.create_group(1)
    np.testing.assert_array_equal(reduce_scatter(np.array([1.0, 2, 3]), b), [1.0, 2, 3])


def test_reduce_scatter_indivisible():
    g = SimulatedBackend.create_group(2)
    with pytest.raises(SizeMismatchError, match=r"\(3\) is not divisible by world_size 2"):
        reduce_scatter(np.array([1.0, 2, 3], np.float32), g[0])


def test_reduce_scatter_preserves_shape():
    res = run_ranks(lambda b: reduce_scatter(np.arange(12, dtype=np.float32).reshape(4, 3), b), 2)
    for rank, r in enumerate(res):
        assert r.shape == (2, 3)
        np.testing.assert_array_equal(r, 2 * np.arange(12).reshape(4, 3)[rank * 2:rank * 2 + 2])
