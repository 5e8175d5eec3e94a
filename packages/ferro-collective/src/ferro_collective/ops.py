"""Reduce operations and the dtypes the collectives compute in."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ferro_backend.kernels import _fold

try:  # bfloat16 is optional
    import ml_dtypes as _ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - exercised only without ml_dtypes
    BFLOAT16 = None


class ReduceOp(enum.Enum):
    """Element-wise reduction of a collective.

    Passed as ``op`` to :func:`allreduce`, :func:`reduce_scatter` and :func:`reduce`; MEAN
    takes float dtypes only, BAND/BOR/BXOR integer and bool dtypes only.

    Parameters
    ----------
    value : str or ReduceOp
        ``ReduceOp("sum")`` is ``ReduceOp.SUM`` (ValueError for an unknown value).
    names, module, qualname, type, start, boundary
        :class:`enum.Enum`'s functional API; not used by ferro.
    """

    SUM = "sum"
    MEAN = "mean"
    AVG = "mean"  #: torch's name for MEAN: the same member (``ReduceOp.AVG is ReduceOp.MEAN``)
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"
    BAND = "band"  #: bitwise AND (integer and bool dtypes only)
    BOR = "bor"  #: bitwise OR (integer and bool dtypes only)
    BXOR = "bxor"  #: bitwise XOR (integer and bool dtypes only)


@dataclass(frozen=True)
class OpSpec:
    """Everything ferro knows about one reduce op, in one place.

    ``kernel``: the reduction kernel's op code for folds over messages (MEAN: a SUM whose
    last step divides); ``door``: the op of the engine's door (``ferro/engine.h``: MEAN is
    AVG); ``wire``: the op's code in a collective header (never 0, which means "no op"). The
    kernel exports its codes, so they are defined once.
    """

    kernel: int
    door: int
    wire: int


OPS: dict[ReduceOp, OpSpec] = {
    ReduceOp.SUM: OpSpec(_fold.OP_SUM, _fold.OP_SUM, 1),
    ReduceOp.MEAN: OpSpec(_fold.OP_SUM, _fold.OP_AVG, 2),  # a SUM whose last pass divides
    ReduceOp.MAX: OpSpec(_fold.OP_MAX, _fold.OP_MAX, 3),
    ReduceOp.MIN: OpSpec(_fold.OP_MIN, _fold.OP_MIN, 4),
    ReduceOp.PRODUCT: OpSpec(_fold.OP_PROD, _fold.OP_PROD, 5),
    ReduceOp.BAND: OpSpec(_fold.OP_BAND, _fold.OP_BAND, 6),
    ReduceOp.BOR: OpSpec(_fold.OP_BOR, _fold.OP_BOR, 7),
    ReduceOp.BXOR: OpSpec(_fold.OP_BXOR, _fold.OP_BXOR, 8),
}
#: the bitwise ops: integer and bool dtypes only (bool reduces as its uint8 view)
BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})

#: dtypes the Cython kernel reduces (every dtype a reduction computes in)
KERNEL_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int8, np.int16,
                                                  np.int32, np.int64, np.uint8, np.uint16,
                                                  np.uint32, np.uint64))
#: half-precision dtypes: accumulated in float32, rounded once at the end
WIDENED = {np.dtype(np.float16): np.dtype(np.float32)}
if BFLOAT16 is not None:
    WIDENED[BFLOAT16] = np.dtype(np.float32)
#: numpy dtype -> the kernel's (and the engine door's) dtype code, for every dtype it takes
CODES = {np.dtype(name): code for name, code in _fold.DTYPE_CODES.items() if name != "bfloat16"}
if BFLOAT16 is not None:
    CODES[BFLOAT16] = _fold.DTYPE_CODES["bfloat16"]


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
    if op in BITWISE:
        if dtype == np.bool_:
            return np.dtype(np.uint8)
        if dtype.kind not in "iu":
            raise TypeError(f"{name}: ReduceOp.{op.name} needs an integer or bool dtype, got "
                            f"{dtype}")
    elif dtype in WIDENED:
        return WIDENED[dtype]
    if dtype.byteorder not in "=|" and dtype.byteorder != ("<" if np.little_endian else ">"):
        raise TypeError(f"{name}: dtype {dtype} is not in native byte order")
    if dtype in KERNEL_DTYPES:
        if op is ReduceOp.MEAN and dtype.kind in "iu":
            raise TypeError(f"{name}: ReduceOp.MEAN on integer dtype {dtype} is not defined; "
                            "use SUM and divide, or cast to a float dtype")
        return dtype
    raise TypeError(f"{name}: cannot reduce dtype {dtype}; supported: float16, bfloat16, float32,"
                    " float64, int8/16/32/64, uint8/16/32/64 (and bool for BAND/BOR/BXOR)")


def accumulate(acc: np.ndarray, x: np.ndarray, op: ReduceOp, mean_divisor: int | None = None
               ) -> None:
    """``acc = op(acc, x)`` in place; with ``mean_divisor`` also divide (MEAN's last pass).

    ``acc`` and ``x`` are 1-d C-contiguous arrays of one dtype (``acc`` writable). The lengths
    are checked here, once: the kernel trusts them.
    """
    if acc.shape != x.shape:
        raise ValueError(f"accumulate: accumulator has {acc.size} elements, input {x.size}")
    if mean_divisor is not None:
        _fold.accumulate_mean(acc, x, CODES[acc.dtype], float(mean_divisor))
    else:
        _fold.accumulate(acc, x, CODES[acc.dtype], OPS[op].kernel)


def fold(out: np.ndarray, inputs: list[np.ndarray], op: ReduceOp, mean_divisor: int | None = None
         ) -> None:
    """``out = inputs[0] op inputs[1] op ...`` in list order, in one pass (MEAN: divide fused
    into the last step). Same bits as the equivalent :func:`accumulate` calls.

    ``out`` and every input: 1-d C-contiguous arrays of one kernel dtype and one length, checked
    here (once: the kernel trusts them).
    """
    for i, x in enumerate(inputs):
        if x.shape != out.shape or x.dtype != out.dtype:
            raise ValueError(f"fold: input {i} is {x.dtype}[{x.size}], expected "
                             f"{out.dtype}[{out.size}]")
    _fold.fold(out, inputs, CODES[out.dtype], OPS[op].kernel, float(mean_divisor or 0))
