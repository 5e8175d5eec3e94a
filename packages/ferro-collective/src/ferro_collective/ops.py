"""Reduce operations and the dtypes the collectives compute in."""

from __future__ import annotations

import enum

import numpy as np

from . import _reduce

try:  # bfloat16 is optional
    import ml_dtypes as _ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - exercised only without ml_dtypes
    BFLOAT16 = None


class ReduceOp(enum.Enum):
    """Element-wise reduction of a collective."""

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"


_KERNEL_CODE = {ReduceOp.SUM: 0, ReduceOp.MEAN: 0, ReduceOp.PRODUCT: 1, ReduceOp.MAX: 2,
                ReduceOp.MIN: 3}
_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.MEAN: np.add, ReduceOp.PRODUCT: np.multiply,
          ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}

#: dtypes the Cython kernel reduces directly
KERNEL_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int8, np.int16,
                                                  np.int32, np.int64, np.uint8))
#: dtypes reduced through numpy's ufuncs (still exact and deterministic)
UFUNC_DTYPES = frozenset(np.dtype(t) for t in (np.uint16, np.uint32, np.uint64))
#: half-precision dtypes: accumulated in float32, rounded once at the end
WIDENED = {np.dtype(np.float16): np.dtype(np.float32)}
if BFLOAT16 is not None:
    WIDENED[BFLOAT16] = np.dtype(np.float32)


def as_op(op) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp[str(op).upper()] if isinstance(op, str) else ReduceOp(op)
    except (KeyError, ValueError):
        raise ValueError(f"unknown reduce op {op!r}; expected one of "
                         f"{[o.name for o in ReduceOp]}") from None


def work_dtype(name: str, dtype: np.dtype, op: ReduceOp) -> np.dtype:
    """The dtype a reduction computes in, or a TypeError naming what is unsupported."""
    dtype = np.dtype(dtype)
    if dtype in WIDENED:
        return WIDENED[dtype]
    if dtype.byteorder not in "=|" and dtype.byteorder != ("<" if np.little_endian else ">"):
        raise TypeError(f"{name}: dtype {dtype} is not in native byte order")
    if dtype in KERNEL_DTYPES or dtype in UFUNC_DTYPES:
        if op is ReduceOp.MEAN and dtype.kind in "iu":
            raise TypeError(f"{name}: ReduceOp.MEAN on integer dtype {dtype} is not defined; "
                            "use SUM and divide, or cast to a float dtype")
        return dtype
    raise TypeError(f"{name}: cannot reduce dtype {dtype}; supported: float16, bfloat16, float32,"
                    " float64, int8/16/32/64, uint8/16/32/64")


def accumulate(acc: np.ndarray, x: np.ndarray, op: ReduceOp, mean_divisor: int | None = None
               ) -> None:
    """``acc = op(acc, x)`` in place; with ``mean_divisor`` also divide (MEAN's last pass)."""
    if acc.dtype in KERNEL_DTYPES:
        if mean_divisor is not None:
            _reduce.accumulate_mean(acc, x, float(mean_divisor))
        else:
            _reduce.accumulate(acc, x, _KERNEL_CODE[op])
        return
    _UFUNC[op](acc, x, out=acc)
    if mean_divisor is not None:
        np.divide(acc, mean_divisor, out=acc)


def divide(acc: np.ndarray, divisor: int) -> None:
    if acc.dtype in KERNEL_DTYPES:
        _reduce.divide(acc, float(divisor))
    else:
        np.divide(acc, divisor, out=acc)
