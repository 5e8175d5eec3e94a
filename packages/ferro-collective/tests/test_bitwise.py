"""ReduceOp.BAND/BOR/BXOR through allreduce, reduce_scatter and reduce (every algorithm) against
numpy over simulated ranks; integer and bool dtypes only."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ferro_backend import SimulatedBackend
from ferro_backend.testing import run_ranks
from ferro_collective import ReduceOp, allreduce, reduce, reduce_scatter
from ferro_collective.api import REDUCE
from ferro_collective.dispatch import run
from ferro_collective.records import ALL_ALGORITHMS as ALGORITHMS

UFUNC = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
         ReduceOp.BXOR: np.bitwise_xor}
DTYPES = [np.int8, np.uint8, np.int16, np.int32, np.uint32, np.int64, np.uint64, np.bool_]


def inputs(seed, dtype, shape, n):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return [rng.integers(0, 2, size=shape).astype(np.bool_) for _ in range(n)]
    info = np.iinfo(dtype)
    return [rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
            for _ in range(n)]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 8), shape=hnp.array_shapes(min_dims=0, max_dims=2, min_side=0,
       max_side=6), dtype=st.sampled_from(DTYPES), op=st.sampled_from(list(UFUNC)),
       data=st.data())
def test_bitwise_ops_in_every_reduction(n, shape, dtype, op, data):
    xs = inputs(n, dtype, shape, n)
    ref = UFUNC[op].reduce(np.stack(xs), axis=0)
    ar_algo = data.draw(st.sampled_from(ALGORITHMS["allreduce"]))
    red_algo = data.draw(st.sampled_from(ALGORITHMS["reduce"]))
    root = data.draw(st.integers(0, n - 1))
    rows = data.draw(st.integers(0, 2))
    rs_in = inputs(n + 1, dtype, (rows * n, 2), n)
    rs_ref = UFUNC[op].reduce(np.stack(rs_in), axis=0)

    def fn(b):
        x = xs[b.rank]
        return (allreduce(x, b, op, algorithm=ar_algo),
                run(REDUCE, x, b, (root, op), None, red_algo),
                reduce_scatter(rs_in[b.rank], b, op))

    for r, (ar, red, rs) in enumerate(run_ranks(fn, n, timeout=30)):
        assert ar.dtype == np.dtype(dtype) and ar.shape == tuple(shape)
        np.testing.assert_array_equal(ar, ref)
        if r == root:
            np.testing.assert_array_equal(red, ref)
            assert red.dtype == np.dtype(dtype)
        else:
            assert red is None
        np.testing.assert_array_equal(rs, rs_ref[r * rows:(r + 1) * rows])


@pytest.mark.parametrize("op", list(UFUNC))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_bitwise_ops_on_floats_are_type_errors_naming_the_dtype(op, dtype):
    b = SimulatedBackend.create_group(1)[0]
    msg = f"ReduceOp.{op.name} needs an integer or bool dtype, got {np.dtype(dtype)}"
    for call in (allreduce, reduce, reduce_scatter):
        with pytest.raises(TypeError, match=f"{call.__name__}: {msg}"):
            call(np.ones(2, dtype), b, op=op)


def test_bitwise_ops_by_name():
    res = run_ranks(lambda b: allreduce(np.array([b.rank + 1], np.uint8), b, "bxor"), 3)
    assert [r.tolist() for r in res] == [[1 ^ 2 ^ 3]] * 3
