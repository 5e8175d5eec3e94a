"""reduce, gather, scatter (and async): hypothesis against numpy references over simulated ranks
(world 1..8, every algorithm, dtypes, 0-d and empty shapes, any root), root checks, out=,
mismatches and timeouts."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_properties import FLOAT, INT, assert_close, inputs, reference

from ferro_backend import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidRankError,
    SimulatedBackend,
    SizeMismatchError,
)
from ferro_backend.testing import run_ranks
from ferro_collective import (
    ReduceOp,
    Work,
    gather,
    gather_async,
    reduce,
    reduce_async,
    scatter,
    scatter_async,
)
from ferro_collective.api import GATHER, REDUCE, SCATTER
from ferro_collective.dispatch import run
from ferro_collective.records import ALL_ALGORITHMS as ALGORITHMS

SETTINGS = settings(max_examples=40, deadline=None)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
ARITH = [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT]


@SETTINGS
@given(n=st.integers(1, 8), shape=shapes, dtype=st.sampled_from(FLOAT + INT),
       op=st.sampled_from(ARITH), algo=st.sampled_from(ALGORITHMS["reduce"]), data=st.data())
def test_reduce_property(n, shape, dtype, op, algo, data):
    if op is ReduceOp.MEAN and np.dtype(dtype).kind in "iu":
        op = ReduceOp.SUM
    if op is ReduceOp.PRODUCT and np.dtype(dtype).kind in "iu":
        op = ReduceOp.MAX
    root = data.draw(st.integers(0, n - 1))
    xs = inputs(np.random.default_rng(root + n), dtype, shape, n)
    keep = [x.copy() for x in xs]

    def fn(b):
        return run(REDUCE, xs[b.rank], b, (root, op), None, algo)

    results = run_ranks(fn, n, timeout=30)
    again = run_ranks(fn, n, timeout=30)
    assert [r is None for r in results] == [r != root for r in range(n)]
    res = results[root]
    assert res.shape == tuple(shape) and res.dtype == np.dtype(dtype)
    assert res.tobytes() == again[root].tobytes()  # the same bits run after run
    assert_close(res, reference(xs, op), dtype)
    for x, k in zip(xs, keep):
        assert x.tobytes() == k.tobytes()


@SETTINGS
@given(n=st.integers(1, 8), shape=shapes, dtype=st.sampled_from(FLOAT + INT + [np.bool_]),
       algo=st.sampled_from(ALGORITHMS["gather"]), data=st.data())
def test_gather_property(n, shape, dtype, algo, data):
    root = data.draw(st.integers(0, n - 1))
    xs = [x.astype(dtype) for x in inputs(np.random.default_rng(n), np.int8, shape, n)]
    results = run_ranks(lambda b: run(GATHER, xs[b.rank], b, root, None, algo), n,
                        timeout=30)
    expected = np.stack(xs) if len(shape) == 0 else np.concatenate(xs, axis=0)
    for r, res in enumerate(results):
        if r != root:
            assert res is None
    np.testing.assert_array_equal(results[root], expected)
    assert results[root].dtype == np.dtype(dtype) and results[root].shape == expected.shape


@SETTINGS
@given(n=st.integers(1, 8), rows=st.integers(0, 3),
       tail=hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=4),
       dtype=st.sampled_from(FLOAT + INT + [np.bool_]), algo=st.sampled_from(ALGORITHMS["scatter"]),
       data=st.data())
def test_scatter_property(n, rows, tail, dtype, algo, data):
    root = data.draw(st.integers(0, n - 1))
    full = inputs(np.random.default_rng(rows), np.int8, (rows * n, *tail), 1)[0].astype(dtype)
    keep = full.copy()
    results = run_ranks(lambda b: run(SCATTER, full if b.rank == root else None, b, root, None,
                                      algo), n, timeout=30)
    for r, res in enumerate(results):
        assert res.shape == (rows, *tail) and res.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(res, full[r * rows:(r + 1) * rows])
    assert full.tobytes() == keep.tobytes()


@pytest.mark.parametrize("algo", ["tree", "ring"])
def test_reduce_large_and_widened_dtypes(algo):
    n = 5
    xs = [np.random.default_rng(r).standard_normal(70_001).astype(np.float16) for r in range(n)]
    res = run_ranks(lambda b: run(REDUCE, xs[b.rank], b, (3, ReduceOp.MEAN), None, algo),
                    n, timeout=30)
    assert res[3].dtype == np.float16
    np.testing.assert_allclose(res[3].astype(np.float64), reference(xs, ReduceOp.MEAN),
                               atol=2e-2, rtol=2e-2)


def test_auto_algorithms_choose_by_size():
    from ferro_collective.costmodel import SMALL_MESSAGE_BYTES
    from ferro_collective.plan import choose
    from ferro_collective.records import BY_NAME

    assert choose(BY_NAME["reduce"], None, 1000, 8) == "tree"
    assert choose(BY_NAME["reduce"], None, SMALL_MESSAGE_BYTES * 4, 8) == "ring"
    assert choose(BY_NAME["reduce"], None, SMALL_MESSAGE_BYTES * 4, 2) == "tree"
    assert choose(BY_NAME["gather"], None, 1000, 8) == "tree"
    assert choose(BY_NAME["scatter"], None, SMALL_MESSAGE_BYTES, 8) == "star"


def test_large_gather_and_scatter_take_the_direct_path():
    n, rows = 3, 40_000
    xs = [np.full((rows, 2), r, np.float64) for r in range(n)]
    full = np.concatenate(xs)

    def fn(b):
        return gather(xs[b.rank], b, root=2), scatter(full if b.rank == 1 else None, b, root=1)

    res = run_ranks(fn, n, timeout=30)
    np.testing.assert_array_equal(res[2][0], full)
    for r in range(n):
        np.testing.assert_array_equal(res[r][1], xs[r])


def test_out_is_filled_and_returned_and_async_forms():
    def fn(b):
        r = b.rank
        red = np.empty(4, np.int64)
        got_red = reduce(np.arange(4) * (r + 1), b, root=0, out=red)
        gat = np.empty(6, np.float32)
        got_gat = gather(np.full(2, r, np.float32), b, root=1, out=gat)
        sca = np.empty((1, 2))
        got_sca = scatter(np.arange(6.0).reshape(3, 2) if r == 2 else None, b, root=2, out=sca)
        x = np.arange(3.0) + r
        got_inplace = reduce(x, b, root=0, out=x if r == 0 else None)
        works = [reduce_async(np.ones(3), b, root=1), gather_async(np.array(r), b, root=0),
                 scatter_async(np.arange(3) if r == 0 else None, b)]
        assert all(isinstance(w, Work) for w in works)
        return (got_red is red, red, got_gat is gat, gat, got_sca is sca, sca, got_inplace,
                x, [w.wait(30) for w in works])

    res = run_ranks(fn, 3, timeout=30)
    assert res[0][0] and res[0][1].tolist() == [0, 6, 12, 18]
    assert res[1][2] and res[1][3].tolist() == [0, 0, 1, 1, 2, 2]
    for r in range(3):
        assert res[r][4] and res[r][5].tolist() == [[2.0 * r, 2.0 * r + 1]]
    assert res[0][6] is not None and res[0][7].tolist() == [3.0, 6.0, 9.0]  # in place on root 0
    assert res[1][6] is None and res[1][7].tolist() == [1.0, 2.0, 3.0]
    assert [w[0] is None for w in (res[0][8], res[2][8])] == [True, True]
    assert res[1][8][0].tolist() == [3.0] * 3
    assert res[0][8][1].tolist() == [0, 1, 2]
    assert [res[r][8][2].tolist() for r in range(3)] == [[0], [1], [2]]


@pytest.mark.parametrize("fn", [
    lambda b, root: reduce(np.ones(2), b, root=root),
    lambda b, root: gather(np.ones(2), b, root=root),
    lambda b, root: scatter(np.ones(2), b, root=root),
    lambda b, root: reduce_async(np.ones(2), b, root=root),
], ids=["reduce", "gather", "scatter", "reduce_async"])
@pytest.mark.parametrize("root", [-1, 2, 7, 1.0, "0", True])
def test_bad_root_raises_invalid_rank_error_naming_it(fn, root):
    def call(b):  # every rank makes the call (one alone would wait for its peer: test_habits)
        with pytest.raises(InvalidRankError,
                           match=f"root {root!r} is out of range for world_size 2"):
            fn(b, root)

    run_ranks(call, 2, timeout=30)


def test_scatter_errors_reach_every_rank():
    def indivisible(b):
        return scatter(np.arange(5) if b.rank == 0 else None, b, timeout=10)

    errors = collect(indivisible, 3)
    assert set(errors) == {0, 1, 2}
    for e in errors.values():
        assert isinstance(e, SizeMismatchError) and isinstance(e, ValueError)
        assert "dim 0 of root 0's shape (5,) (5) is not divisible by world_size 3" in str(e)

    def none_on_root(b):
        return scatter(None, b, root=1, timeout=10)

    errors = collect(none_on_root, 3)
    assert "root (rank 1) must pass an array, got None" in str(errors[1])
    for r in (0, 2):
        assert isinstance(errors[r], CollectiveMismatchError)
        assert ("rank 1 refused the call (ValueError: the root (rank 1) must pass an array, "
                "got None)") in str(errors[r])

    def bad_out(b):  # a wrong out= fails on its rank only, after the data moved: no hang
        return scatter(np.arange(4.0) if b.rank == 0 else None, b,
                       out=np.empty(3) if b.rank == 1 else None, timeout=10)

    errors = collect(bad_out, 2)
    assert list(errors) == [1] and "out is float64[3], the result is float64[2]" in str(errors[1])


def test_gather_called_against_scatter_is_a_mismatch_on_every_rank():
    def fn(b):
        if b.rank == 1:
            return scatter(np.arange(3.0), b, root=1, timeout=10)
        return gather(np.zeros(2, np.float32), b, root=1, timeout=10)

    errors = collect(fn, 3)
    assert set(errors) == {0, 1, 2}
    for e in errors.values():
        assert isinstance(e, CollectiveMismatchError)
        assert "ranks [0, 2] called gather(float32[2], root=1)" in str(e)
        assert "ranks [1] called scatter(root=1)" in str(e)


def test_reduce_mismatched_root_or_op_is_named():
    def fn(b):
        return reduce(np.ones(2), b, root=b.rank % 2, op=ReduceOp.MAX if b.rank else "sum",
                      timeout=10)

    errors = collect(fn, 2)
    msg = str(errors[0])
    assert "reduce(float64[2], SUM, root=0)" in msg and "reduce(float64[2], MAX, root=1)" in msg
    assert str(errors[1]) == msg


@pytest.mark.timeout(30)
@pytest.mark.parametrize("call", [
    lambda b: reduce(np.ones(3), b, timeout=0.4),
    lambda b: gather(np.ones(3), b, root=1, timeout=0.4),
    lambda b: scatter(np.ones(3), b, timeout=0.4),
    lambda b: scatter_async(None, b, root=1, timeout=0.4).wait(10),
], ids=["reduce", "gather", "scatter", "scatter_async"])
def test_silent_peer_times_out(call):
    rank0, _silent = SimulatedBackend.create_group(2)
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="timed out after 0.4s"):
        call(rank0)
    assert time.monotonic() - t0 < 5  # gave up at its deadline (a loaded host's room)


def collect(fn, world):
    errors = {}

    def wrap(b):
        try:
            fn(b)
        except Exception as exc:
            errors[b.rank] = exc

    run_ranks(wrap, world, timeout=30)
    return errors
