"""The wire formats of the compressed collectives: ``allreduce``, ``reduce_scatter`` and
``all_gather`` (and their ``*_async`` forms) with a wire format (``wire="bf16"``, ``"fp16"``,
``"int8"`` or ``"int4"``), for links slow enough that the bytes sent are the step's time. (The
calls themselves: ``ferro_collective.compressed``.)

Every rank encodes what it sends, decodes what it receives and folds in float32, in rank order,
so every rank gets the same bits on every transport:

* allreduce: each rank's input (flattened, padded to ``world_size`` equal chunks) is encoded
  chunk by chunk; an all-to-all gives rank ``r`` every rank's chunk ``r``, which it decodes and
  folds; the folded chunk is encoded again and all-gathered, and every rank decodes every
  chunk (its own too), so the results are identical. Bytes per rank: 2 (n-1)/n of the encoded
  size, as a ring allreduce of the encoded data.
* reduce_scatter: the first half (its chunks are the input's dim-0 slices).
* all_gather: each rank's block encoded, gathered, decoded.

On a multi-node job (a backend with a :class:`~ferro_backend.hierarchy.Hierarchy`) only the
cross-node stage of an allreduce is compressed: an exact reduce_scatter inside each node, the
compressed allreduce of each local rank's slice across nodes, an exact all_gather inside the
node.

The formats (:func:`encode`, :func:`decode`):

* ``"bf16"``: bfloat16, rounded to nearest even (NaN stays NaN, inf stays inf).
* ``"fp16"``: IEEE half, rounded to nearest even; a value beyond its range (65504) becomes
  inf, a NaN a quiet NaN (its payload's top bits kept). The codec is compiled (the CPU's F16C
  instructions where it has them, else plain C giving the same bits).
* ``"int8"``: blocks of :data:`BLOCK` values, each an int8 times its block's float32 scale
  (``max |x| / 127``, rounded to nearest even): 1.02 bytes a value. A block holding a NaN or
  an inf decodes to NaN throughout (its scale is NaN): a non-finite value poisons its block,
  never the others.
* ``"int4"``: the same with 4-bit values (``max |x| / 7``, -7..7, two a byte): 0.52 bytes a
  value, an error of up to 1/14 of its block's largest magnitude (int8: 1/254).
"""

from __future__ import annotations

import numpy as np

from . import _wire as _kernel
from .ops import BFLOAT16, ReduceOp, as_op

#: the wire formats
WIRES = ("bf16", "fp16", "int8", "int4")
#: values per int8 block (one float32 scale each)
BLOCK = _kernel.BLOCK
#: the kernel's fold code of each op (MEAN: a SUM, divided at the end)
FOLD = {ReduceOp.SUM: _kernel.SUM, ReduceOp.MEAN: _kernel.SUM, ReduceOp.MAX: _kernel.MAX,
         ReduceOp.MIN: _kernel.MIN, ReduceOp.PRODUCT: _kernel.PRODUCT}


def check_wire(wire: str, name: str) -> str:
    if wire not in WIRES:
        raise ValueError(f"{name}: wire={wire!r} is not a wire format; expected one of "
                         f"{', '.join(map(repr, WIRES))} (or None: exact)")
    return wire


def wire_op(op):
    """``op`` as the exact calls take it (a :class:`ReduceOp`, its name in any case, or its
    value), for a compressed call: its ReduceOp, or ``op`` itself where it names none (the
    call's :func:`check_floats` refuses it then, on every rank of the call)."""
    try:
        return as_op(op)
    except ValueError:
        return op


def check_floats(x: np.ndarray, op: ReduceOp | None, name: str) -> None:
    if x.dtype.kind != "f" and x.dtype != BFLOAT16:
        raise TypeError(f"{name}: wire formats compress float dtypes, not {x.dtype} "
                        "(send integers exactly: wire=None)")
    if op is not None and not isinstance(op, ReduceOp):
        as_op(op)  # (the exact calls' ValueError: an op that names none)
    if op is not None and op not in FOLD:
        raise TypeError(f"{name}: {op} is not defined with a wire format (SUM, MEAN, MAX, MIN, "
                        "PRODUCT)")


# ---------------------------------------------------------------------------- the formats
def encoded_bytes(count: int, wire: str) -> int:
    """The size of ``count`` values in ``wire``'s format.

    Parameters
    ----------
    count : int
        Values.
    wire : {"bf16", "fp16", "int8", "int4"}

    Returns
    -------
    int
        Bytes :func:`encode` makes of them (int8: whole blocks, each with its 4-byte scale).
    """
    if wire == "int8":
        return -(-count // BLOCK) * (BLOCK + 4)
    if wire == "int4":
        return -(-count // BLOCK) * (BLOCK // 2 + 4)
    return 2 * count


def encode(x: np.ndarray, wire: str) -> np.ndarray:
    """Values in a wire format (the module docstring says each format's rounding and its
    non-finite values).

    Parameters
    ----------
    x : array_like
        Values, taken as float32 and flattened.
    wire : {"bf16", "fp16", "int8", "int4"}

    Returns
    -------
    numpy.ndarray
        uint8, :func:`encoded_bytes` of them (int8: the blocks' scales first, then the
        values, the last block padded with zeros).
    """
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty(encoded_bytes(x.size, wire), np.uint8)
    encode_into(x, wire, out)
    return out


def encode_into(x: np.ndarray, wire: str, out: np.ndarray) -> None:
    """:func:`encode` of float32 ``x`` (1-d, C-contiguous) into the bytes ``out``."""
    if wire == "bf16":
        _kernel.encode_bf16(x, out.view(np.uint16))
    elif wire == "fp16":
        _kernel.encode_fp16(x, out.view(np.uint16))
    elif wire == "int8":
        blocks = -(-x.size // BLOCK)
        _kernel.encode_int8(x, out[:blocks * 4].view(np.float32), out[blocks * 4:].view(np.int8))
    else:
        blocks = -(-x.size // BLOCK)
        _kernel.encode_int4(x, out[:blocks * 4].view(np.float32), out[blocks * 4:])


def decode(buf: np.ndarray, wire: str, count: int) -> np.ndarray:
    """The values :func:`encode` put in ``buf``.

    Parameters
    ----------
    buf : array_like
        uint8, as :func:`encode` made it.
    wire : {"bf16", "fp16", "int8", "int4"}
    count : int
        Values to read (what was encoded).

    Returns
    -------
    numpy.ndarray
        float32, ``count`` values.
    """
    out = np.empty(count, np.float32)
    decode_into(np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1), wire, out, _kernel.COPY)
    return out


def decode_into(buf: np.ndarray, wire: str, acc: np.ndarray, op: int) -> None:
    """``acc`` = fold(``acc``, the values of ``buf``) (``op``: the kernel's COPY, SUM, ...)."""
    count = acc.size
    if wire == "bf16":
        _kernel.decode_bf16_into(buf.view(np.uint16), acc, op)
    elif wire == "fp16":
        _kernel.decode_fp16_into(buf.view(np.uint16)[:count], acc, op)
    elif wire == "int8":
        blocks = -(-count // BLOCK)
        _kernel.decode_int8_into(buf[:blocks * 4].view(np.float32),
                                 buf[blocks * 4:blocks * (BLOCK + 4)].view(np.int8), acc, op)
    else:
        blocks = -(-count // BLOCK)
        _kernel.decode_int4_into(buf[:blocks * 4].view(np.float32),
                                 buf[blocks * 4:blocks * (BLOCK // 2 + 4)], acc, op)


class Feedback:
    """Error feedback for a compressed allreduce (its ``feedback=``): what this rank's
    encodings rounded away in one call, added to what they encode in the next, so the error
    of a sum over many calls (gradients over steps) stays that of one call instead of growing
    with their count.

    A compressed allreduce encodes twice: each rank's input (its contribution, ``sent``) and,
    on the rank that folds it, each folded chunk before the all-gather (``folded``; on a
    multi-node job, the cross-node stage's contribution and folded chunk). A rank keeps both
    residuals here, as float32 arrays that the calls it is passed to replace once they have
    succeeded (a failed call leaves them as they were; None before the first; zeros when a
    call's sizes differ from the last one's), each kept in one of two buffers it swaps. Pass
    one to a single series of calls with the same size, world and wire (one per gradient
    buffer), never to two calls in flight at once (the second would add residuals the first
    has not replaced yet). SUM and MEAN only.

    Parameters
    ----------
    sent, folded : numpy.ndarray, optional
        Residuals to start from (a resumed run's saved ones); float32 copies are kept.

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> from ferro_collective import allreduce
    >>> def error_of_100_calls(b, feedback):
    ...     g = np.linspace(-1, 1, 1000)  # on both ranks: the sum is 2 g
    ...     total = sum(allreduce(g, b, wire="int4", feedback=feedback) for _ in range(100))
    ...     return round(float(np.abs(total - 100 * 2 * g).max()), 2)
    >>> run_ranks(lambda b: error_of_100_calls(b, None), 2)
    [14.27, 14.27]
    >>> run_ranks(lambda b: error_of_100_calls(b, Feedback()), 2)
    [0.15, 0.15]
    """

    __slots__ = ("_spares", "folded", "sent")

    def __init__(self, sent: np.ndarray | None = None, folded: np.ndarray | None = None) -> None:
        self.sent = None if sent is None else np.array(sent, np.float32).reshape(-1)
        self.folded = None if folded is None else np.array(folded, np.float32).reshape(-1)
        #: per residual, the buffer a call writes its new one into (swapped with the current
        #: one when the call succeeded: no new memory per call)
        self._spares: dict[str, np.ndarray] = {}

    def spare(self, name: str, size: int) -> np.ndarray:
        """The buffer a call writes residual ``name``'s (``"sent"`` or ``"folded"``) new
        values into, of ``size`` float32 values (never the current residual).

        Parameters
        ----------
        name : str
            ``"sent"`` or ``"folded"``.
        size : int
            The number of values.

        Returns
        -------
        numpy.ndarray
            A flat float32 array, its values unspecified.
        """
        buf = self._spares.get(name)
        if buf is None or buf.size != size:
            buf = self._spares[name] = np.empty(size, np.float32)
        return buf

    def replace(self, name: str, new: np.ndarray) -> None:
        """Make ``new`` (from :meth:`spare`) residual ``name``; the old one becomes the spare.

        Parameters
        ----------
        name : str
            ``"sent"`` or ``"folded"``.
        new : numpy.ndarray
            The new residual.
        """
        old = getattr(self, name)
        setattr(self, name, new)
        if old is not None and old is not new:
            self._spares[name] = old
        else:
            self._spares.pop(name, None)

    def add_sent(self, x: np.ndarray) -> np.ndarray:
        """``x`` plus the last contribution's residual (zeros where there was none, or of
        another size).

        Parameters
        ----------
        x : numpy.ndarray
            float32 values, flat (not changed: it may be the caller's input).

        Returns
        -------
        numpy.ndarray
            A new float32 array.
        """
        if self.sent is None or self.sent.size != x.size:
            self.sent = np.zeros(x.size, np.float32)
        return np.add(x, self.sent, dtype=np.float32)

    def add_folded(self, acc: np.ndarray) -> None:
        """Add the last folded chunk's residual to ``acc`` in place (zeros where there was
        none, or of another size).

        Parameters
        ----------
        acc : numpy.ndarray
            float32, flat: a folded chunk.
        """
        if self.folded is None or self.folded.size != acc.size:
            self.folded = np.zeros(acc.size, np.float32)
        acc += self.folded

    def __repr__(self) -> str:
        sizes = [None if a is None else a.size for a in (self.sent, self.folded)]
        return f"<Feedback sent={sizes[0]} folded={sizes[1]}>"


def check_feedback(feedback, op: ReduceOp, name: str) -> None:
    """``feedback`` is None or a :class:`Feedback`, with SUM or MEAN (else TypeError,
    ValueError naming the call)."""
    if feedback is None:
        return
    if not isinstance(feedback, Feedback):
        raise TypeError(f"{name}: feedback= must be a ferro_collective.wire.Feedback, not "
                        f"{type(feedback).__name__}")
    if op not in (ReduceOp.SUM, ReduceOp.MEAN):
        raise ValueError(f"{name}: feedback= with op {op.name}: error feedback is for SUM "
                         "and MEAN")


# (the compressed collectives, ferro_collective.compressed, are reached through the public calls'
# ``wire=``)
__all__ = ["BLOCK", "WIRES", "Feedback", "decode", "encode", "encoded_bytes"]
