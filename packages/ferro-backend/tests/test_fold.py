"""The reduction kernel (kernels/_fold.h) against numpy: every dtype and op, float16 and bfloat16
widened and rounded once (every bit pattern: NaN payloads, infinities, subnormals), AVG's
divide in the last step, the output in place of the first or second input. Bit for bit, except
the sign of a zero that MAX or MIN picks between 0 and -0, which numpy's own loops pick either
way, and which NaN a fold of two NaNs keeps."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ferro_backend.kernels import _fold

ml_dtypes = pytest.importorskip("ml_dtypes")

CODES = {np.dtype(name): code for name, code in _fold.DTYPE_CODES.items() if name != "bfloat16"}
BF16 = np.dtype(ml_dtypes.bfloat16)
CODES[BF16] = _fold.DTYPE_CODES["bfloat16"]
UFUNCS = {_fold.OP_SUM: np.add, _fold.OP_PROD: np.multiply, _fold.OP_MAX: np.maximum,
          _fold.OP_MIN: np.minimum, _fold.OP_BAND: np.bitwise_and, _fold.OP_BOR: np.bitwise_or,
          _fold.OP_BXOR: np.bitwise_xor, _fold.OP_AVG: np.add}
HALF = (np.dtype(np.float16), BF16)


def _reference(inputs, op, dtype):
    work = [x.astype(np.float32) for x in inputs] if dtype in HALF else inputs
    with np.errstate(all="ignore"):
        acc = work[0].copy()
        for x in work[1:]:
            acc = UFUNCS[op](acc, x)
        if op == _fold.OP_AVG and len(work) > 1:
            acc = np.divide(acc, len(work)).astype(acc.dtype)
    return acc.astype(dtype) if dtype in HALF else acc


def _same(out, want, dtype):
    """Bit for bit, except which NaN a fold of two NaNs keeps (the compiler may take either
    operand first; every rank runs the same code, so every rank gets the same NaN)."""
    if dtype.kind != "f" and dtype not in HALF:
        return out.tobytes() == want.tobytes()
    wide_o, wide_w = out.astype(np.float64), want.astype(np.float64)
    nan = np.isnan(wide_w)
    return bool((np.isnan(wide_o) == nan).all()) and \
        out[~nan].view(np.uint8).tobytes() == want[~nan].view(np.uint8).tobytes()


def _ops(dtype):
    return [op for op in UFUNCS if _fold.op_fits(CODES[dtype], op)]


def _arrays(dtype, size):
    if dtype in HALF:  # every bit pattern: NaNs (with payloads), infinities, subnormals
        return hnp.arrays(np.uint16, size).map(lambda a: a.view(dtype))
    return hnp.arrays(dtype, size)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(CODES, key=str)), st.integers(1, 5), st.integers(0, 2500),
       st.data())
def test_the_fold_equals_numpy_bit_for_bit(dtype, count, size, data):
    op = data.draw(st.sampled_from(_ops(dtype)))
    inputs = [data.draw(_arrays(dtype, size)) for _ in range(count)]
    out = np.empty(size, dtype)
    _fold.fold(out, inputs, CODES[dtype], op, float(count) if op == _fold.OP_AVG else 0.0)
    want = _reference(inputs, op, dtype)
    if op in (_fold.OP_MAX, _fold.OP_MIN):  # numpy's SIMD picks either zero of max(0, -0)
        np.testing.assert_array_equal(out.astype(np.float64) if dtype in HALF else out,
                                      want.astype(np.float64) if dtype in HALF else want)
    else:
        assert _same(out, want, dtype)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([np.dtype(np.float32), np.dtype(np.float16), BF16, np.dtype(np.int64)]),
       st.integers(2, 4), st.integers(1, 5000), st.integers(0, 1), st.data())
def test_the_output_may_be_its_first_or_second_input(dtype, count, size, into, data):
    """(an in-place allreduce folds into its own input: the engine puts it first or second)"""
    inputs = [data.draw(_arrays(dtype, size)) for _ in range(count)]
    want = _reference(inputs, _fold.OP_SUM, dtype)
    out = inputs[into]
    _fold.fold(out, inputs, CODES[dtype], _fold.OP_SUM)
    assert _same(out, want, dtype)


def test_pairs_the_engine_refuses_and_lengths_that_disagree():
    f32, i32, b = CODES[np.dtype(np.float32)], CODES[np.dtype(np.int32)], CODES[np.dtype(bool)]
    assert not _fold.op_fits(i32, _fold.OP_AVG) and not _fold.op_fits(f32, _fold.OP_BAND)
    assert not _fold.op_fits(b, _fold.OP_SUM) and _fold.op_fits(b, _fold.OP_BXOR)
    with pytest.raises(ValueError, match="op 7 does not reduce dtype code 4"):
        _fold.fold(np.zeros(2, np.int32), [np.zeros(2, np.int32)] * 2, i32, _fold.OP_AVG, 2.0)
    with pytest.raises(ValueError, match="input 1 has 4 bytes, the output 8"):
        _fold.fold(np.zeros(2, np.float32), [np.zeros(2, np.float32), np.zeros(1, np.float32)],
                   f32, _fold.OP_SUM)
    with pytest.raises(ValueError, match="unknown dtype code 13"):
        _fold.fold(np.zeros(2, np.float32), [np.zeros(2, np.float32)], 13, _fold.OP_SUM)


def test_bool_folds_as_its_bytes_with_the_bitwise_ops():
    a, c = np.array([True, True, False, False]), np.array([True, False, True, False])
    for op, ufunc in ((_fold.OP_BAND, np.logical_and), (_fold.OP_BOR, np.logical_or),
                      (_fold.OP_BXOR, np.logical_xor)):
        out = np.empty(4, bool)
        _fold.fold(out, [a, c], CODES[np.dtype(bool)], op)
        assert out.tolist() == ufunc(a, c).tolist()
