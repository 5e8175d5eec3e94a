"""Hypothesis: every collective, world sizes 1..8, shapes (0-d, zero-size), dtypes, ops and
algorithms, against a numpy reference computed from all inputs; bit-identical across ranks and
runs."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ferro_backend.testing import run_ranks
from ferro_collective import (
    ALGORITHMS,
    ReduceOp,
    all_gather,
    allreduce,
    broadcast,
    reduce_scatter,
)
from ferro_collective.ops import BFLOAT16

FLOAT = [np.float16, np.float32, np.float64] + ([BFLOAT16] if BFLOAT16 is not None else [])
INT = [np.int32, np.int64, np.int8, np.uint8]
OPS = [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT]  # bitwise: test_bitwise.py
SETTINGS = settings(max_examples=80, deadline=None)

shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)


def inputs(rng, dtype, shape, n):
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return [rng.integers(-5 if dtype.kind == "i" else 0, 6, size=shape).astype(dtype)
                for _ in range(n)]
    return [rng.standard_normal(size=shape).astype(dtype) for _ in range(n)]


def reference(xs, op):
    wide = [x.astype(np.float64) if x.dtype.kind == "f" or x.dtype == BFLOAT16 else x
            for x in xs]
    f = {ReduceOp.SUM: np.add, ReduceOp.MEAN: np.add, ReduceOp.PRODUCT: np.multiply,
         ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}[op]
    acc = wide[0].copy()
    for w in wide[1:]:
        acc = f(acc, w)
    if op is ReduceOp.MEAN:
        acc = acc / len(xs)
    return acc


def assert_close(got, ref, dtype):
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        np.testing.assert_array_equal(got, ref.astype(dtype))
    else:
        tol = {2: 2e-2, 4: 1e-4, 8: 1e-10}[dtype.itemsize]
        np.testing.assert_allclose(got.astype(np.float64), ref, rtol=tol, atol=tol * 8)


def same_bits(results):
    first = results[0].tobytes()
    return all(r.tobytes() == first for r in results)


@SETTINGS
@given(n=st.integers(1, 8), shape=shapes, dtype=st.sampled_from(FLOAT + INT),
       op=st.sampled_from(OPS), algo=st.sampled_from(ALGORITHMS["allreduce"]),
       seed=st.integers(0, 2**16))
def test_allreduce_property(n, shape, dtype, op, algo, seed):
    if op is ReduceOp.MEAN and np.dtype(dtype).kind in "iu":
        return
    if op is ReduceOp.PRODUCT and np.dtype(dtype).kind in "iu":
        op = ReduceOp.SUM  # small ints overflow under products; SUM is the exact case
    xs = inputs(np.random.default_rng(seed), dtype, shape, n)
    results = run_ranks(lambda b: allreduce(xs[b.rank], b, op, algorithm=algo), n, timeout=30)
    again = run_ranks(lambda b: allreduce(xs[b.rank], b, op, algorithm=algo), n, timeout=30)
    assert all(r.shape == tuple(shape) and r.dtype == np.dtype(dtype) for r in results)
    assert same_bits(results) and results[0].tobytes() == again[0].tobytes()
    assert_close(results[0], reference(xs, op), dtype)


@SETTINGS
@given(n=st.integers(1, 8), shape=shapes, dtype=st.sampled_from(FLOAT + INT + [np.bool_]),
       algo=st.sampled_from(ALGORITHMS["all_gather"]), seed=st.integers(0, 2**16))
def test_all_gather_property(n, shape, dtype, algo, seed):
    xs = inputs(np.random.default_rng(seed), np.int8 if dtype is np.bool_ else dtype, shape, n)
    xs = [x.astype(dtype) for x in xs]
    results = run_ranks(lambda b: all_gather(xs[b.rank], b, algorithm=algo), n, timeout=30)
    expected = np.stack(xs) if len(shape) == 0 else np.concatenate(xs, axis=0)
    for r in results:
        np.testing.assert_array_equal(r, expected)
        assert r.dtype == np.dtype(dtype)


@SETTINGS
@given(n=st.integers(1, 8), rows=st.integers(0, 3), tail=hnp.array_shapes(min_dims=0,
       max_dims=2, min_side=0, max_side=4), dtype=st.sampled_from(FLOAT + INT),
       op=st.sampled_from([ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX, ReduceOp.MIN]),
       algo=st.sampled_from(ALGORITHMS["reduce_scatter"]), seed=st.integers(0, 2**16))
def test_reduce_scatter_property(n, rows, tail, dtype, op, algo, seed):
    if op is ReduceOp.MEAN and np.dtype(dtype).kind in "iu":
        return
    shape = (rows * n, *tail)
    xs = inputs(np.random.default_rng(seed), dtype, shape, n)
    results = run_ranks(lambda b: reduce_scatter(xs[b.rank], b, op, algorithm=algo), n,
                        timeout=30)
    ref = reference(xs, op)
    for r, res in enumerate(results):
        assert res.shape == (rows, *tail) and res.dtype == np.dtype(dtype)
        assert_close(res, ref[r * rows:(r + 1) * rows], dtype)


@SETTINGS
@given(n=st.integers(1, 8), shape=shapes, dtype=st.sampled_from(FLOAT + INT),
       algo=st.sampled_from(ALGORITHMS["broadcast"]), data=st.data())
def test_broadcast_property(n, shape, dtype, algo, data):
    root = data.draw(st.integers(0, n - 1))
    xs = inputs(np.random.default_rng(root), dtype, shape, n)
    results = run_ranks(lambda b: broadcast(xs[b.rank], b, root, algorithm=algo), n, timeout=30)
    for r in results:
        np.testing.assert_array_equal(r, xs[root])


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 8), numel=st.integers(0, 40), seed=st.integers(0, 1000))
def test_ring_uneven_chunks_any_numel(n, numel, seed):
    xs = inputs(np.random.default_rng(seed), np.float64, (numel,), n)
    results = run_ranks(lambda b: allreduce(xs[b.rank], b, algorithm="ring"), n, timeout=30)
    assert same_bits(results)
    np.testing.assert_allclose(results[0], reference(xs, ReduceOp.SUM), rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 6), numel=st.integers(0, 60), seed=st.integers(0, 1000),
       seg_items=st.integers(1, 9), dtype=st.sampled_from([np.float32, np.float64, np.int32]),
       op=st.sampled_from([ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX]))
def test_segmented_ring_has_the_unsegmented_bits(n, numel, seed, seg_items, dtype, op):
    """Ring steps sent in segments (each one forwarded as soon as it arrived and was folded)
    give the bits of the one-message steps: allreduce, reduce_scatter and all_gather."""
    from ferro_collective import p2p

    dtype = np.dtype(dtype)
    if op is ReduceOp.MEAN and dtype.kind == "i":
        op = ReduceOp.SUM
    xs = inputs(np.random.default_rng(seed), dtype, (numel * n,), n)

    def fn(b):
        return (allreduce(xs[b.rank], b, op, algorithm="ring"),
                reduce_scatter(xs[b.rank], b, op, algorithm="ring"),
                all_gather(xs[b.rank][:numel], b, algorithm="ring"))

    whole = run_ranks(fn, n, timeout=30)
    saved = p2p.SEGMENT_BYTES, p2p.MAX_SEGMENTS
    p2p.SEGMENT_BYTES, p2p.MAX_SEGMENTS = seg_items * dtype.itemsize, 64
    try:
        assert p2p.ring_segments(n, numel * dtype.itemsize) > 1 or numel < 2 * seg_items
        parts = run_ranks(fn, n, timeout=30)
    finally:
        p2p.SEGMENT_BYTES, p2p.MAX_SEGMENTS = saved
    for a, b in zip(whole, parts):
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    np.testing.assert_allclose(parts[0][0], reference(xs, op), rtol=1e-5, atol=1e-5)


def test_inputs_are_never_modified():
    xs = [np.arange(6.0) + r for r in range(3)]
    copies = [x.copy() for x in xs]

    def fn(b):
        for algo in ALGORITHMS["allreduce"]:
            allreduce(xs[b.rank], b, ReduceOp.MEAN, algorithm=algo)
        reduce_scatter(xs[b.rank], b)
        all_gather(xs[b.rank], b)
        broadcast(xs[b.rank], b)

    run_ranks(fn, 3, timeout=30)
    for x, c in zip(xs, copies):
        np.testing.assert_array_equal(x, c)


def test_integer_sum_is_exact_at_large_values():
    xs = [np.array([2**52 + r, -(2**40) * r], np.int64) for r in range(4)]
    for r in run_ranks(lambda b: allreduce(xs[b.rank], b), 4):
        assert r.tolist() == [4 * 2**52 + 6, -(2**40) * 6]


def test_mean_on_integers_is_a_clear_error():
    import pytest

    from ferro_backend import SimulatedBackend

    g = SimulatedBackend.create_group(1)  # (a group of several: every rank refuses at once)
    with pytest.raises(TypeError, match="MEAN on integer dtype int32"):
        allreduce(np.ones(3, np.int32), g[0], ReduceOp.MEAN)
    with pytest.raises(TypeError, match="cannot reduce dtype bool"):
        allreduce(np.ones(3, np.bool_), g[0])
