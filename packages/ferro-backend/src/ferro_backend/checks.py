"""Argument checks shared by every transport: ranks, world sizes, tags, timeouts, buffers.

Each raises ferro's typed error naming what was wrong (:mod:`ferro_backend.errors`); the
transports call them before a message moves, so a bad call fails on the rank that made it.
"""

from __future__ import annotations

import math
import numbers
import sys
import threading
from typing import Any

from .errors import InvalidRankError, InvalidWorldSizeError, SizeMismatchError

MAX_TAG = (1 << 64) - 1


def _no_objects(op: str, data: Any, mv: memoryview) -> None:
    """TypeError for a buffer of Python objects: its bytes are pointers, valid in this process
    alone (a receiver that used them crashed)."""
    dtype = getattr(mv.obj if isinstance(data, memoryview) else data, "dtype", None)
    if getattr(dtype, "hasobject", False) or mv.format.lstrip("@=<>!|") == "O":
        raise TypeError(f"{op}: a buffer of Python objects (dtype {dtype or 'O'}) holds pointers "
                        "valid in this process alone: send its values in a numeric dtype, or "
                        "pickle it (ferro_collective.broadcast_object / all_gather_object)")


def _array_view(op: str, data: Any) -> tuple[Any, memoryview]:
    """``(array, view)`` for what has no buffer protocol but that :func:`numpy.asarray` turns
    into an array sharing its memory (a torch CPU tensor, an object with
    ``__array_interface__`` or ``__array__``); TypeError naming its type when that would copy
    (a list, an ``__array__`` returning a fresh array) or fail (a GPU tensor)."""
    import numpy as np

    try:
        arr = np.asarray(data)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"{op}: this {type(data).__name__} is not a buffer and numpy.asarray "
                        f"cannot view it ({exc}); pass bytes, a bytearray, a memoryview, a "
                        "numpy array or a CPU tensor") from None
    # A copy is a fresh array owning its memory that nothing else holds (2: ``arr`` and the
    # argument); an array ``__array__`` returns from its object is held by that object too.
    if arr.flags.owndata and sys.getrefcount(arr) <= 2:
        raise TypeError(f"{op}: numpy.asarray would copy this {type(data).__name__} (it holds no "
                        "buffer of its own): pass bytes, a bytearray, a memoryview, a numpy "
                        "array or a CPU tensor" + (", the receive would fill the copy and "
                                                   "leave it unchanged" if op == "recv" else ""))
    return arr, _memoryview(op, arr)


def _memoryview(op: str, data: Any) -> memoryview:
    """``memoryview(data)``; for a numpy array whose dtype the buffer protocol cannot describe
    (bfloat16 and the float8 kinds of ml_dtypes, datetime64, timedelta64: numpy raises
    ValueError "cannot include dtype ... in a buffer"), a flat byte view of its memory, so it
    moves as its bytes, bit-exact, like any fixed-size dtype (a non-contiguous one: ValueError;
    one holding Python objects is refused after, by :func:`_no_objects`, as it has the array)."""
    try:
        return memoryview(data)
    except ValueError:
        import numpy as np

        if not isinstance(data, np.ndarray):
            raise
        if not data.flags.c_contiguous:
            raise ValueError(f"{op}: {'output ' if op == 'recv' else ''}buffer of shape "
                             f"{data.shape} is not C-contiguous"
                             + ("; pass np.ascontiguousarray(x)" if op == "send" else "")) from None
        return memoryview(data.reshape(-1).view(np.uint8))


def as_send_view(data: Any) -> memoryview:
    """A flat byte view of ``data`` without copying; non-contiguous buffers and buffers of Python
    objects are refused; what has no buffer protocol but that :func:`numpy.asarray` views
    without copying (a torch CPU tensor) is taken as that array."""
    try:
        mv = data if isinstance(data, memoryview) else _memoryview("send", data)
    except TypeError:
        data, mv = _array_view("send", data)
    _no_objects("send", data, mv)
    if not mv.c_contiguous:
        raise ValueError(
            f"send: buffer of shape {mv.shape} is not C-contiguous; pass np.ascontiguousarray(x)"
        )
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B") if mv.nbytes else memoryview(b"")  # (no cast of a zero in a shape)
    return mv


def as_recv_view(out: Any) -> memoryview:
    """A flat writable byte view of ``out`` without copying; read-only buffers and buffers of
    Python objects are refused; what :func:`numpy.asarray` views without copying (a torch CPU
    tensor) is taken as that array, so the bytes land in its memory."""
    try:
        mv = out if isinstance(out, memoryview) else _memoryview("recv", out)
    except TypeError:
        out, mv = _array_view("recv", out)
    _no_objects("recv", out, mv)
    if mv.readonly:
        raise ValueError(f"recv: the output buffer ({type(out).__name__}) is read-only")
    if not mv.c_contiguous:
        raise ValueError(f"recv: output buffer of shape {mv.shape} is not C-contiguous")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B") if mv.nbytes else memoryview(bytearray())  # (as send's)
    return mv


def check_tag(tag: int, limit: int = MAX_TAG) -> int:
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= limit:
        raise ValueError(f"tag {tag!r} is not an integer in [0, {limit}]{_not_int(tag)}")
    return tag


def _not_int(value) -> str:
    """The hint for a numpy integer where Python's int is taken (its value may be right)."""
    return (f" (numpy.{type(value).__name__}, not an int: pass int(...))"
            if hasattr(value, "dtype") and getattr(value.dtype, "kind", "") in "iu" else "")


def check_world_size(world_size: int, minimum: int = 1) -> int:
    if not isinstance(world_size, int) or world_size < minimum:
        raise InvalidWorldSizeError(f"world_size {world_size!r} is invalid, expected >= {minimum}")
    return world_size


def check_rank(rank: int, world_size: int, what: str = "rank") -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise InvalidRankError(f"{what} {rank!r} is " + (
            _not_int(rank)[2:-1] if _not_int(rank) else f"out of range for world_size {world_size}"))
    return rank


def check_peer(op: str, peer: int, rank: int, world_size: int, what: str = "peer") -> int:
    """A valid peer of ``rank`` for a point-to-point ``op`` (never ``rank`` itself)."""
    check_rank(peer, world_size, f"{op}: {what}")
    if peer == rank:
        raise InvalidRankError(f"{op}: rank {peer} cannot {op} to/from itself")
    return peer


def size_mismatch(op: str, src: int, dst: int, tag: int, expected: int, got: int):
    return SizeMismatchError(
        f"{op}: message {src} -> {dst} (tag {tag}) has {got} bytes, "
        f"the receive buffer has {expected}"
    )


def check_timeout(timeout: Any, what: str = "timeout") -> float:
    """``timeout`` as a float number of seconds, or ValueError naming it.

    The one validation of every timeout in ferro: NaN, negative numbers, booleans and
    non-numbers are refused (a NaN deadline would otherwise never expire: a hang). ``inf`` is
    allowed and means "wait for ever".
    """
    if type(timeout) is float and timeout >= 0:  # the common case, fast (NaN fails >= 0)
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise ValueError(f"{what} {timeout!r} is not a number of seconds")
    value = float(timeout)
    if math.isnan(value) or value < 0:
        raise ValueError(f"{what} {timeout!r} is invalid, expected a number of seconds >= 0")
    return value


def wait_limit(seconds: float) -> float:
    """``seconds`` as blocking calls take it: at most :data:`threading.TIMEOUT_MAX` (about 292
    years). A timeout of inf is allowed (:func:`check_timeout`), but ``socket.settimeout``,
    ``Lock.acquire`` and ``Condition.wait`` raise OverflowError for it (or for any number past
    that limit), so every wait derived from a deadline that may be inf goes through here."""
    return min(seconds, threading.TIMEOUT_MAX)


def timeout_from_env() -> float | None:
    """``FERRO_TIMEOUT`` (set by ``ferrorun --timeout``) validated, or None when unset."""
    from . import settings

    return settings.TIMEOUT.get()


__all__ = ["MAX_TAG", "as_recv_view", "as_send_view", "check_peer", "check_rank", "check_tag",
           "check_timeout", "check_world_size", "size_mismatch", "timeout_from_env", "wait_limit"]
