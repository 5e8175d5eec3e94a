"""ferro_collective.ops' folds (ferro-backend's reduction kernel) against numpy's ufuncs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ferro_backend.kernels import _fold
from ferro_collective import ReduceOp
from ferro_collective.ops import OPS, accumulate, fold

KERNEL_DTYPES = [np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8,
                 np.uint16, np.uint32, np.uint64]
UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.MAX: np.maximum,
          ReduceOp.MIN: np.minimum}


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(KERNEL_DTYPES).flatmap(
    lambda dt: st.tuples(hnp.arrays(dt, st.integers(0, 50)), st.just(dt))),
    st.sampled_from(list(UFUNCS)), st.data())
def test_accumulate_matches_numpy(arr_dt, op, data):
    a, dt = arr_dt
    b = data.draw(hnp.arrays(dt, a.shape))
    acc = a.copy()
    with np.errstate(all="ignore"):
        expected = UFUNCS[op](a, b)
    accumulate(acc, b, op)
    np.testing.assert_array_equal(acc, expected)


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_fused_mean_matches_add_then_divide(dt):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(1001).astype(dt), rng.standard_normal(1001).astype(dt)
    acc = a.copy()
    accumulate(acc, b, ReduceOp.MEAN, mean_divisor=3)
    np.testing.assert_array_equal(acc, np.divide(np.add(a, b), 3))


def test_nan_and_signed_zero_follow_numpy():
    a = np.array([np.nan, 1.0, 0.0, -0.0], np.float32)
    b = np.array([1.0, np.nan, -0.0, 0.0], np.float32)
    for op in (ReduceOp.MAX, ReduceOp.MIN):
        acc = a.copy()
        accumulate(acc, b, op)
        assert np.isnan(acc[:2]).all()


def test_integer_sum_wraps_exactly_like_numpy():
    a = np.array([2**31 - 1, -(2**31)], np.int32)
    acc = a.copy()
    accumulate(acc, np.array([1, -1], np.int32), ReduceOp.SUM)
    np.testing.assert_array_equal(acc, np.add(a, np.array([1, -1], np.int32)))


def test_op_codes_have_one_definition():
    # the kernel defines its codes; the op table reads them; header codes are distinct
    assert {OPS[op].kernel for op in ReduceOp} == {_fold.OP_SUM, _fold.OP_PROD,
                                                   _fold.OP_MAX, _fold.OP_MIN,
                                                   _fold.OP_BAND, _fold.OP_BOR,
                                                   _fold.OP_BXOR}
    assert len({spec.wire for spec in OPS.values()}) == len(ReduceOp)
    assert 0 not in {spec.wire for spec in OPS.values()}


def test_lengths_are_checked_once_in_python_and_read_only_accumulators_refused():
    with pytest.raises(ValueError, match="4 elements, input 3"):
        accumulate(np.zeros(4, np.float32), np.zeros(3, np.float32), ReduceOp.SUM)
    ro = np.zeros(4)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        _fold.accumulate(ro, np.zeros(4), _fold.DTYPE_CODES["float64"], _fold.OP_SUM)
    # read-only *inputs* are fine (const memoryviews)
    x = np.frombuffer(np.ones(4).tobytes())
    acc = np.zeros(4)
    _fold.accumulate(acc, x, _fold.DTYPE_CODES["float64"], _fold.OP_SUM)
    assert acc.sum() == 4


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(KERNEL_DTYPES), st.integers(1, 6), st.integers(0, 9000),
       st.sampled_from(list(UFUNCS) + [ReduceOp.MEAN]), st.data())
def test_fold_equals_accumulating_in_list_order(dt, count, size, op, data):
    if op is ReduceOp.MEAN and np.dtype(dt).kind != "f":
        return  # MEAN is refused on integers before any kernel runs
    inputs = [data.draw(hnp.arrays(dt, size)) for _ in range(count)]
    expected = inputs[0].copy()
    with np.errstate(all="ignore"):
        for i, x in enumerate(inputs[1:], start=1):
            last = i == count - 1
            accumulate(expected, x, op, count if op is ReduceOp.MEAN and last else None)
        got = np.empty_like(inputs[0])
        fold(got, inputs, op, count if op is ReduceOp.MEAN and count > 1 else None)
    np.testing.assert_array_equal(got, expected)  # the same bits (NaNs in the same places)


def test_fold_checks_inputs_once_in_python():
    with pytest.raises(ValueError, match="input 1 is float64"):
        fold(np.zeros(4, np.float32), [np.zeros(4, np.float32), np.zeros(4)], ReduceOp.SUM)
    with pytest.raises(ValueError, match="input 0 is float32\\[3\\]"):
        fold(np.zeros(4, np.float32), [np.zeros(3, np.float32)], ReduceOp.SUM)


# ----------------------------------------------------------------------------- bitwise ops
INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
BITWISE_UFUNCS = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
                  ReduceOp.BXOR: np.bitwise_xor}


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(INT_DTYPES).flatmap(
    lambda dt: st.tuples(hnp.arrays(dt, st.integers(0, 50)), st.just(dt))),
    st.sampled_from(list(BITWISE_UFUNCS)), st.data())
def test_bitwise_accumulate_matches_numpy(arr_dt, op, data):
    a, dt = arr_dt
    b = data.draw(hnp.arrays(dt, a.shape))
    acc = a.copy()
    accumulate(acc, b, op)
    np.testing.assert_array_equal(acc, BITWISE_UFUNCS[op](a, b))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(INT_DTYPES), st.integers(1, 6), st.integers(0, 9000),
       st.sampled_from(list(BITWISE_UFUNCS)), st.data())
def test_bitwise_fold_matches_numpy_reduce(dt, count, size, op, data):
    inputs = [data.draw(hnp.arrays(dt, size)) for _ in range(count)]
    got = np.empty_like(inputs[0])
    fold(got, inputs, op)
    np.testing.assert_array_equal(got, BITWISE_UFUNCS[op].reduce(np.stack(inputs), axis=0))


@pytest.mark.parametrize("op", list(BITWISE_UFUNCS))
def test_bitwise_on_bool_views_keeps_zero_one(op):
    a = np.array([True, True, False, False])
    b = np.array([True, False, True, False])
    acc = a.view(np.uint8).copy()
    accumulate(acc, b.view(np.uint8), op)
    np.testing.assert_array_equal(acc.view(np.bool_), BITWISE_UFUNCS[op](a, b))


@pytest.mark.parametrize("op", list(BITWISE_UFUNCS))
@pytest.mark.parametrize("dt", [np.float32, np.float64, np.float16, np.complex64])
def test_bitwise_ops_refuse_non_integer_dtypes(op, dt):
    from ferro_collective.ops import work_dtype

    with pytest.raises(TypeError, match=f"ReduceOp.{op.name} needs an integer or bool dtype, "
                                        f"got {np.dtype(dt)}"):
        work_dtype("allreduce", np.dtype(dt), op)


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(KERNEL_DTYPES), st.integers(2, 4), st.integers(1, 5000),
       st.sampled_from(list(UFUNCS) + [ReduceOp.MEAN]), st.integers(0, 1), st.data())
def test_fold_into_one_of_its_inputs_equals_numpy(dt, count, size, op, into, data):
    """The fold's first pass combines two inputs in one sweep (three streams): the output may
    be either of them (an in-place allreduce folds into the caller's own input)."""
    if op is ReduceOp.MEAN and np.dtype(dt).kind != "f":
        return
    inputs = [data.draw(hnp.arrays(dt, size)) for _ in range(count)]
    ufunc = np.add if op is ReduceOp.MEAN else UFUNCS[op]
    with np.errstate(all="ignore"):
        expected = inputs[0].copy()
        for x in inputs[1:]:
            expected = ufunc(expected, x)
        if op is ReduceOp.MEAN:
            expected = np.divide(expected, count).astype(dt)
        out = inputs[into]
        fold(out, inputs, op, count if op is ReduceOp.MEAN else None)
    np.testing.assert_array_equal(out, expected)


def test_the_float_loops_run_the_clone_this_cpu_supports():
    # the AVX2 clone of the float SUM/MEAN loops is compiled in and picked where the CPU has
    # AVX2 (Linux x86-64 with GCC); its results are numpy's, tails (sizes not a multiple of
    # the vector width) included
    import platform
    import sys

    if sys.platform == "linux" and platform.machine() == "x86_64":
        with open("/proc/cpuinfo") as f:
            avx2 = " avx2" in f.read()
        assert _fold.SIMD_AVX2 == avx2
    rng = np.random.default_rng(1)
    for dt in (np.float32, np.float64):
        for size in (1, 7, 8, 9, 31, 4097, 10_001):
            a, b = rng.standard_normal(size).astype(dt), rng.standard_normal(size).astype(dt)
            got = np.empty_like(a)
            fold(got, [a, b], ReduceOp.SUM)
            np.testing.assert_array_equal(got, a + b)
            fold(got, [a, b], ReduceOp.MEAN, 2)
            np.testing.assert_array_equal(got, (a + b) / dt(2))
