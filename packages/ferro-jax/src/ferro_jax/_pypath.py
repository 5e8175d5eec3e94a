"""The Python path: the calls the engine's door does not run, made from inside XLA.

The FFI target ``ferro_jax_py`` (``_handlers.cc``) calls :data:`TRAMPOLINE`, a ctypes callback
(ctypes takes the GIL), with the addresses of the buffers XLA hands over; the call registered
under the call's number (:func:`register`, at lowering) runs on numpy views of them: ferro's
point-to-point calls (send, recv, sendrecv on every backend: the door has none), and every
collective on a backend without an engine (TCP, MPI, several nodes), through ferro-collective
with ``out=`` the output buffer (no copy of ours). An exception becomes the FFI call's error:
``[ferro <its class>] <its message>`` with an XLA error code (:func:`code_for`), which
:mod:`ferro_jax.errors` turns back into the class.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections.abc import Callable, Hashable, Sequence

import numpy as np

import ferro_collective as fc
from ferro_backend import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerClosedError,
)

_calls: list[Callable[[list[int], list[int]], None]] = []
_numbers: dict[Hashable, int] = {}  # a call's description -> its number
_lock = threading.Lock()

_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_int64,
                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_int64)


def register(key: Hashable, make: Callable[[], Callable[[list[int], list[int]], None]]) -> int:
    """The number of the call ``key`` describes, for the FFI call's ``call`` attribute: the one
    given before to the same description (a retrace, another computation with the same call,
    one compiled again after ``jax.clear_caches()``), else ``make()``'s function
    ``fn(in_addresses, out_addresses)`` under a new number. A compiled computation holds only
    the number, so an entry is never dropped (any computation still alive may run it), and
    the entries are bounded by the distinct calls a process lowers, not by its lowerings."""
    with _lock:
        number = _numbers.get(key)
        if number is None:
            _calls.append(make())
            number = _numbers[key] = len(_calls) - 1
        return number


def code_for(exc: BaseException) -> int:
    """The XLA error code (``XLA_FFI_Error_Code``) an exception travels as."""
    if isinstance(exc, CollectiveTimeoutError):
        return 4  # DEADLINE_EXCEEDED
    if isinstance(exc, PeerClosedError):
        return 14  # UNAVAILABLE
    if isinstance(exc, CollectiveMismatchError):
        return 9  # FAILED_PRECONDITION
    if isinstance(exc, (ValueError, TypeError)):
        return 3  # INVALID_ARGUMENT
    return 13  # INTERNAL


def _trampoline(call, n_in, ins, n_out, outs, err, err_len):
    try:
        _calls[call]([ins[i] for i in range(n_in)], [outs[i] for i in range(n_out)])
        return 0
    except BaseException as exc:
        text = f"[ferro {type(exc).__name__}] {exc}".encode(errors="replace")[:err_len - 1]
        ctypes.memmove(err, text + b"\0", len(text) + 1)
        return code_for(exc)


#: the C function pointer ``ferro_jax_py`` calls (kept alive here for the process's life)
TRAMPOLINE = _CALLBACK(_trampoline)


class _At:
    """Memory at an address as numpy reads it (``__array_interface__``): a view in 0.7 us,
    where ``np.frombuffer`` over a ctypes array at the address took 2.9 (two views of a
    4 KiB ``sendrecv`` cost 5.7 of the 8 us it pays over the same call from Python)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, shape: tuple, typestr: str) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": shape,
                                    "typestr": typestr, "version": 3}


@functools.cache
def _typestr_says(dtype: np.dtype) -> bool:
    """Whether numpy reads ``dtype`` back from its type string (float8_e5m2's ``<f1`` is not
    understood: such a type is read as its bytes)."""
    try:
        return np.dtype(dtype.str) == dtype
    except TypeError:
        return False


def view(address: int | None, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """A writable numpy view of XLA's buffer at ``address`` (no copy)."""
    dtype = np.dtype(dtype)
    shape = tuple(shape)
    if not address or dtype.itemsize * math.prod(shape) == 0:
        return np.empty(shape, dtype)
    if dtype.kind != "V" and _typestr_says(dtype):  # numpy's own: their type string says all
        return np.asarray(_At(address, shape, dtype.str))
    # ml_dtypes' (bfloat16, float8...) read as void: their bytes, then the type
    return np.asarray(_At(address, (*shape, dtype.itemsize), "|u1")).view(dtype).reshape(shape)


class Views:
    """A call site's views of XLA's buffers of one shape and dtype, by address: XLA hands the
    same few buffers to a call in a loop, and a view made once serves them again (a dict
    lookup, where :func:`view` takes 1.3 us). Any view of an address is as good as a new one
    (no ownership), so a reused address, whatever buffer it now holds, is read right."""

    __slots__ = ("shape", "dtype", "_made")

    #: views kept a call site; past it they are made again from the start
    KEEP = 8

    def __init__(self, shape: Sequence[int], dtype) -> None:
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self._made: dict[int, np.ndarray] = {}

    def __call__(self, address: int) -> np.ndarray:
        made = self._made.get(address)
        if made is None:
            if len(self._made) >= self.KEEP:
                self._made.clear()
            made = self._made[address] = view(address, self.shape, self.dtype)
        return made


# ---------------------------------------------------------------- what runs there, per kind
_OPS = {"sum": fc.ReduceOp.SUM, "mean": fc.ReduceOp.MEAN, "max": fc.ReduceOp.MAX,
        "min": fc.ReduceOp.MIN, "prod": fc.ReduceOp.PRODUCT, "band": fc.ReduceOp.BAND,
        "bor": fc.ReduceOp.BOR, "bxor": fc.ReduceOp.BXOR}


def _as_native(a: np.ndarray, reduces: bool) -> np.ndarray:
    """A view ferro-collective takes: for a reduction, complex as pairs of floats; a call that
    only moves data takes the array as it is (ferro-collective moves any type, float8 and
    bfloat16 included, and its header names the real dtype, so ranks that pass float8_e4m3fn
    and float8_e5m2 get a mismatch instead of reading each other's bytes in their own type)."""
    if reduces and a.dtype.kind == "c":  # (reshape(-1) first: a 0-d array cannot change size)
        return a.reshape(-1).view(a.dtype.type(0).real.dtype).reshape(*a.shape, 2)
    return a


def _as_bytes(a: np.ndarray, reduces: bool = False) -> np.ndarray:
    """A point-to-point call's view: the array's bytes (a message carries no dtype)."""
    return a.reshape(-1).view(np.uint8).reshape(*a.shape, a.dtype.itemsize)


def run(kind: str, backend, x: np.ndarray | None, y: np.ndarray | None, *, op: str = "sum",
        root: int = 0, src: int = -1, dst: int = -1, tag: int = 0,
        timeout: float | None = None) -> None:
    """One call of ``kind`` on numpy views: ``x`` the input, ``y`` the output XLA gave."""
    reduces = kind in ("allreduce", "reduce", "reduce_scatter")
    if kind == "all_gather" and x is not None and x.ndim == 0:  # gathers to (world_size,)
        x, y = x.reshape(1), y
    native = _as_bytes if kind in ("send", "recv", "sendrecv") else _as_native
    xs = None if x is None else native(x, reduces)
    ys = None if y is None else native(y, reduces)
    if kind == "allreduce":
        fc.allreduce(xs, backend, _OPS[op], timeout=timeout, out=ys)
    elif kind == "reduce":
        mine = backend.rank == root
        fc.reduce(xs, backend, root, _OPS[op], timeout=timeout, out=ys if mine else None)
        if not mine:
            ys[...] = 0
    elif kind == "reduce_scatter":
        fc.reduce_scatter(xs, backend, _OPS[op], timeout=timeout, out=ys)
    elif kind == "all_gather":
        fc.all_gather(xs, backend, timeout=timeout, out=ys)
    elif kind == "broadcast":
        fc.broadcast(xs, backend, root, timeout=timeout, out=ys)
    elif kind == "all_to_all":
        fc.all_to_all_single(xs, backend, timeout=timeout, out=ys)
    elif kind == "barrier":
        fc.barrier(backend, timeout=timeout)
    elif kind == "send":
        backend.send(np.ascontiguousarray(xs), dst, tag=tag)
    elif kind == "recv":
        backend.recv(ys, src, tag=tag, timeout=timeout)
    elif kind == "sendrecv":
        request = backend.irecv(ys, src, tag=tag)
        backend.send(np.ascontiguousarray(xs), dst, tag=tag)
        request.wait(timeout)
    else:  # pragma: no cover - the primitive checks kinds
        raise ValueError(f"ferro_jax: unknown call {kind!r}")
