"""Pack many arrays into one little-endian wire buffer, and unpack it into destination arrays.

The collective and fsdp layers fuse many small tensors into one message with these. On a
little-endian host each array is one ``memcpy``; on a big-endian host the bytes of every word are
reversed on the way in and out, so the wire format is the same everywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from . import _wire
from .errors import SizeMismatchError

WIRE_BYTEORDER = "little"
_NATIVE_IS_WIRE = sys.byteorder == WIRE_BYTEORDER

#: dtype kinds the wire format carries: bool, signed and unsigned integers, floats, complex
SUPPORTED_KINDS = frozenset("biufc")


def _check_dtype(op: str, index: int, dtype: np.dtype) -> None:
    if dtype.kind not in SUPPORTED_KINDS and dtype.name != "bfloat16":
        raise TypeError(f"{op}: array {index} has dtype {dtype}, which the wire format cannot carry")


def _swap_size(dtype: np.dtype, native_is_wire: bool) -> int:
    """0 for a plain copy, else the word size whose bytes must be reversed."""
    little = dtype.byteorder == "<" or (dtype.byteorder == "=" and native_is_wire)
    if dtype.byteorder == "|" or little:
        return 0
    size = dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize
    if size == 1:
        return 0
    if size not in (2, 4, 8):
        raise TypeError(f"wire: cannot byte-swap items of {size} bytes ({dtype})")
    return size


def _byte_view(op: str, index: int, arr: np.ndarray, *, writable: bool) -> memoryview:
    if not arr.flags.c_contiguous:
        raise ValueError(f"{op}: array {index} of shape {arr.shape} is not C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{op}: destination array {index} is read-only")
    return memoryview(arr.reshape(-1).view(np.uint8))


def packed_nbytes(arrays: Sequence[np.ndarray]) -> int:
    """Bytes that :func:`pack` writes for ``arrays``.

    Parameters
    ----------
    arrays : sequence of array_like
        The arrays to pack (any shape and supported dtype).

    Returns
    -------
    int
        The sum of the arrays' ``nbytes``: the size of :func:`pack`'s buffer.

    Examples
    --------
    >>> packed_nbytes([np.zeros(3, np.float32), np.zeros(2, np.int8)])
    14
    """
    return sum(np.asarray(a).nbytes for a in arrays)


def pack(arrays: Sequence[np.ndarray], out: np.ndarray | None = None, *,
         native_is_wire: bool = _NATIVE_IS_WIRE) -> np.ndarray:
    """Copy ``arrays`` back to back into one little-endian ``uint8`` buffer.

    Parameters
    ----------
    arrays : sequence of numpy.ndarray
        C-contiguous numpy arrays (any shape) of numeric or bool dtype.
    out : numpy.ndarray, optional
        Optional writable ``uint8`` buffer of exactly :func:`packed_nbytes` bytes.
    native_is_wire : bool, default: this host is little-endian
        Whether native-order arrays are already in wire (little-endian) order; for tests of
        the byte-swapping path.

    Returns
    -------
    numpy.ndarray
        ``out``, or a new ``uint8`` array.

    Raises
    ------
    SizeMismatchError
        ``out`` has the wrong number of bytes.
    ValueError, TypeError
        A non-contiguous array or an unsupported dtype.

    Examples
    --------
    >>> buf = pack([np.arange(3, dtype=np.float32), np.array([7], np.int64)])
    >>> buf.dtype, buf.nbytes
    (dtype('uint8'), 20)
    """
    arrays = [np.asarray(a) for a in arrays]
    total = 0
    views, swaps = [], []
    for i, arr in enumerate(arrays):
        _check_dtype("pack", i, arr.dtype)
        views.append(_byte_view("pack", i, arr, writable=False))
        swaps.append(_swap_size(arr.dtype, native_is_wire))
        total += arr.nbytes
    if out is None:
        out = np.empty(total, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.ndim != 1 or out.nbytes != total:
        raise SizeMismatchError(
            f"pack: out has {out.nbytes} bytes ({out.dtype}, shape {out.shape}), "
            f"expected a 1-d uint8 array of {total} bytes"
        )
    _wire.pack_into(views, memoryview(out), swaps)
    return out


def unpack(buffer, outs: Sequence[np.ndarray], *,
           native_is_wire: bool = _NATIVE_IS_WIRE) -> None:
    """Fill each array of ``outs`` from consecutive bytes of the wire ``buffer``.

    Parameters
    ----------
    buffer : buffer-like
        The wire bytes (:func:`pack`'s result, or any buffer: ``bytes``, ``memoryview``, numpy
        array).
    outs : sequence of numpy.ndarray
        Writable C-contiguous destinations, in :func:`pack`'s order; their total ``nbytes``
        must equal the buffer's length.
    native_is_wire : bool, default: this host is little-endian
        As for :func:`pack`.

    Raises
    ------
    SizeMismatchError
        The arrays' total size differs from the buffer's length.
    ValueError, TypeError
        A destination that is read-only, not contiguous, or of an unsupported dtype.

    Examples
    --------
    >>> a, b = np.empty(3, np.float32), np.empty(1, np.int64)
    >>> unpack(pack([np.arange(3, dtype=np.float32), np.array([7], np.int64)]), [a, b])
    >>> a.tolist(), b.tolist()
    ([0.0, 1.0, 2.0], [7])
    """
    src = memoryview(buffer).cast("B") if not isinstance(buffer, np.ndarray) else memoryview(
        np.ascontiguousarray(buffer).reshape(-1).view(np.uint8))
    views, swaps, total = [], [], 0
    for i, arr in enumerate(outs):
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"unpack: destination {i} is a {type(arr).__name__}, not an ndarray")
        _check_dtype("unpack", i, arr.dtype)
        views.append(_byte_view("unpack", i, arr, writable=True))
        swaps.append(_swap_size(arr.dtype, native_is_wire))
        total += arr.nbytes
    if total != len(src):
        raise SizeMismatchError(
            f"unpack: destinations hold {total} bytes, the buffer has {len(src)}"
        )
    _wire.unpack_from(src, views, swaps)
