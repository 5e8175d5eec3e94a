"""Compressed collectives: ``allreduce``, ``reduce_scatter`` and ``all_gather`` with a wire
format (``wire="bf16"``, ``"fp16"``, ``"int8"`` or ``"int4"``), for links slow enough that
the bytes sent are the step's time.

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

from ferro_backend import Backend
from ferro_backend import timeline as _timeline

from . import _wire as _kernel
from .api_uneven import all_to_all_single
from .dispatch import run
from .ops import BFLOAT16, ReduceOp
from .records import ALL_GATHER, REDUCE_SCATTER

#: the wire formats
WIRES = ("bf16", "fp16", "int8", "int4")
#: values per int8 block (one float32 scale each)
BLOCK = _kernel.BLOCK
#: the kernel's fold code of each op (MEAN: a SUM, divided at the end)
_FOLD = {ReduceOp.SUM: _kernel.SUM, ReduceOp.MEAN: _kernel.SUM, ReduceOp.MAX: _kernel.MAX,
         ReduceOp.MIN: _kernel.MIN, ReduceOp.PRODUCT: _kernel.PRODUCT}


def check_wire(wire: str, name: str) -> str:
    if wire not in WIRES:
        raise ValueError(f"{name}: wire={wire!r} is not a wire format; expected one of "
                         f"{', '.join(map(repr, WIRES))} (or None: exact)")
    return wire


def _check(x: np.ndarray, op: ReduceOp | None, name: str) -> None:
    if x.dtype.kind != "f" and x.dtype != BFLOAT16:
        raise TypeError(f"{name}: wire formats compress float dtypes, not {x.dtype} "
                        "(send integers exactly: wire=None)")
    if op is not None and op not in _FOLD:
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
    _encode_into(x, wire, out)
    return out


def _encode_into(x: np.ndarray, wire: str, out: np.ndarray) -> None:
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
    _decode_into(np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1), wire, out, _kernel.COPY)
    return out


def _decode_into(buf: np.ndarray, wire: str, acc: np.ndarray, op: int) -> None:
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


# ---------------------------------------------------------------------------- collectives
def _chunk(count: int, n: int, wire: str) -> int:
    """Values per chunk when ``count`` values are cut in ``n`` (int8: whole blocks)."""
    c = max(1, -(-count // n))
    return -(-c // BLOCK) * BLOCK if wire in ("int8", "int4") else c


def _encode_chunks(flat: np.ndarray, n: int, c: int, wire: str) -> np.ndarray:
    """``flat`` cut in ``n`` chunks of ``c`` values (the last padded with zeros), each encoded:
    one row of bytes per chunk."""
    sent = np.empty((n, encoded_bytes(c, wire)), np.uint8)
    for r in range(n):
        chunk = flat[r * c:(r + 1) * c]
        if chunk.size < c:
            chunk = np.concatenate([chunk, np.zeros(c - chunk.size, np.float32)])
        _encode_into(chunk, wire, sent[r])
    return sent


def _fold_rows(rows: np.ndarray, c: int, wire: str, op: ReduceOp, n: int) -> np.ndarray:
    """Decode every rank's chunk and fold them in rank order, in float32."""
    acc = np.empty(c, np.float32)
    _decode_into(rows[0], wire, acc, _kernel.COPY)
    for r in range(1, n):
        _decode_into(rows[r], wire, acc, _FOLD[op])
    if op is ReduceOp.MEAN:
        acc /= np.float32(n)
    return acc


def traced(name: str, wire: str, tensor, backend: Backend, call, *args):
    """``call(*args)``; while tracing, one timeline event for the compressed call: the input's
    bytes and the bytes of its encoding (``wire_bytes``), beside the events of the collectives
    it runs. (The public calls pass the function and its arguments, not a closure: a closure
    would make each of their arguments a cell on every call, compressed or not.)"""
    if not _timeline.active():
        return call(*args)
    x = np.asarray(tensor)
    t0 = _timeline._now_us()
    try:
        return call(*args)
    finally:
        _timeline.record(f"{name}[{wire}]", "collective", t0, _timeline._now_us() - t0,
                         bytes=int(x.nbytes), dtype=str(x.dtype), wire=wire,
                         wire_bytes=encoded_bytes(int(x.size), wire), rank=backend.rank,
                         world=backend.world_size)


def _finish(result32: np.ndarray, like: np.ndarray, shape: tuple, out: np.ndarray | None,
            name: str) -> np.ndarray:
    result = result32.reshape(shape)
    if out is None:
        return result if like.dtype == np.float32 else result.astype(like.dtype)
    if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != like.dtype:
        raise ValueError(f"{name}: out= must be an array of shape {shape} and dtype "
                         f"{like.dtype}")
    out[...] = result
    return out


def allreduce(tensor, backend: Backend, op: ReduceOp, wire: str, timeout: float | None,
              out: np.ndarray | None) -> np.ndarray:
    """:func:`~ferro_collective.allreduce` with ``wire`` (module docstring)."""
    x = np.asarray(tensor)
    _check(x, op, "allreduce")
    h = getattr(backend, "hierarchy", None)
    if h is not None and h.num_nodes > 1:  # exact inside the nodes, compressed across them
        flat = x.reshape(-1)
        local = h.local_world
        per = -(-max(1, flat.size) // local)
        padded = np.zeros(per * local, x.dtype)
        padded[:flat.size] = flat
        node_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
        part = run(REDUCE_SCATTER, padded, h.node, node_op, timeout, None, None)
        part = allreduce(part, h.cross, node_op, wire, timeout, None)
        whole = run(ALL_GATHER, part, h.node, None, timeout, None, None)[:flat.size]
        if op is ReduceOp.MEAN:
            whole = whole / np.asarray(backend.world_size, whole.dtype)
        return _finish(np.asarray(whole, np.float32), x, x.shape, out, "allreduce")
    n = backend.world_size
    flat = np.ascontiguousarray(x.reshape(-1), dtype=np.float32)
    c = _chunk(flat.size, n, wire)
    rows = all_to_all_single(_encode_chunks(flat, n, c, wire), backend, timeout=timeout)
    mine = encode(_fold_rows(rows, c, wire, op, n), wire)
    gathered = run(ALL_GATHER, mine, backend, None, timeout, None, None).reshape(n, -1)
    result = np.empty(n * c, np.float32)
    for r in range(n):
        _decode_into(gathered[r], wire, result[r * c:(r + 1) * c], _kernel.COPY)
    return _finish(result[:flat.size], x, x.shape, out, "allreduce")


def reduce_scatter_wire(tensor, backend: Backend, op: ReduceOp, wire: str,
                        timeout: float | None, out: np.ndarray | None) -> np.ndarray:
    """:func:`~ferro_collective.reduce_scatter` with ``wire`` (module docstring)."""
    x = np.asarray(tensor)
    _check(x, op, "reduce_scatter")
    n = backend.world_size
    if x.ndim == 0 or x.shape[0] % n:
        from ferro_backend.errors import SizeMismatchError

        raise SizeMismatchError(f"reduce_scatter: dim 0 of shape {x.shape} is not divisible by "
                                f"the world size {n}")
    shape = (x.shape[0] // n, *x.shape[1:])
    per = int(np.prod(shape))
    chunks = np.ascontiguousarray(x.reshape(n, per), dtype=np.float32)
    c = _chunk(per, 1, wire)
    sent = np.empty((n, encoded_bytes(c, wire)), np.uint8)
    for r in range(n):
        chunk = chunks[r] if c == per else np.concatenate([chunks[r],
                                                           np.zeros(c - per, np.float32)])
        _encode_into(chunk, wire, sent[r])
    rows = all_to_all_single(sent, backend, timeout=timeout)
    return _finish(_fold_rows(rows, c, wire, op, n)[:per], x, shape, out, "reduce_scatter")


def all_gather_wire(tensor, backend: Backend, wire: str, timeout: float | None,
                    out: np.ndarray | None) -> np.ndarray:
    """:func:`~ferro_collective.all_gather` with ``wire`` (module docstring)."""
    x = np.asarray(tensor)
    _check(x, None, "all_gather")
    n = backend.world_size
    gathered = run(ALL_GATHER, encode(x.reshape(-1), wire), backend, None, timeout, None,
                   None).reshape(n, -1)
    result = np.empty(n * x.size, np.float32)
    for r in range(n):
        _decode_into(gathered[r], wire, result[r * x.size:(r + 1) * x.size], _kernel.COPY)
    shape = (n,) if x.ndim == 0 else (n * x.shape[0], *x.shape[1:])
    return _finish(result, x, shape, out, "all_gather")


# (the compressed collectives are reached through the public calls' ``wire=``)
__all__ = ["BLOCK", "WIRES", "decode", "encode", "encoded_bytes"]
