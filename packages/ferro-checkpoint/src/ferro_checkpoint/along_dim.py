"""``concat_along_dim`` and ``slice_along_dim`` on top of the ``_along_dim`` kernel.

All validation of the kernel's input happens here, once; the kernel assumes valid input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from . import _along_dim
from .errors import InvalidArgumentError, TensorError


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _geometry(shape: tuple[int, ...], dim: int, itemsize: int) -> tuple[int, int]:
    return math.prod(shape[:dim]), math.prod(shape[dim + 1:]) * itemsize


def _check_dim(op: str, ndim: int, dim: int) -> int:
    if not -ndim <= dim < ndim:
        raise InvalidArgumentError(f"{op}: dim {dim} is out of range for {ndim}-d arrays")
    return dim % ndim


def _check_plain(op: str, what: str, dtype: np.dtype) -> None:
    """TensorError for a dtype of Python objects: their bytes are references, not data."""
    if dtype.hasobject:
        raise TensorError(f"{op}: {what} has dtype {dtype}, which holds Python objects: only "
                          "arrays of plain data (numbers, bool, fixed-size bytes) are copied")


def copy_slab_into(src: np.ndarray, dst: np.ndarray, dim: int, src_start: int, dst_start: int,
                   count: int) -> None:
    """``dst[(..., dst_start:dst_start+count along dim, ...)] = src[... src_start ...]``.

    The caller has validated the input (the kernel checks nothing): ``dim`` is in range and
    non-negative, ``dst`` is C-contiguous with ``src``'s dtype and the same shape outside
    ``dim``, and the slab lies inside both arrays. :func:`concat_along_dim` and
    :func:`slice_along_dim` check user input; ``load.assemble`` derives it from verified shards.
    """
    outer, inner = _geometry(src.shape, dim, src.dtype.itemsize)
    _along_dim.copy_slab(_bytes(np.ascontiguousarray(src)), _bytes(dst), outer, src.shape[dim],
                         dst.shape[dim], inner, src_start, dst_start, count)


def concat_along_dim(arrays: Sequence[np.ndarray], dim: int,
                     out: np.ndarray | None = None) -> np.ndarray:
    """``np.concatenate(arrays, axis=dim)``, written into ``out`` if given (any dtype of plain
    data).

    Parameters
    ----------
    arrays : sequence of numpy.ndarray
        The arrays to join, in order: one dtype, the same shape outside ``dim``.
    dim : int
        The dimension to join along (negative counts from the end).
    out : numpy.ndarray, optional
        A C-contiguous array of the result's shape and dtype to write into (default: a new one).

    Returns
    -------
    numpy.ndarray
        ``out`` if given, else a new C-contiguous array.

    Raises
    ------
    InvalidArgumentError
        No arrays, or ``dim`` out of range.
    TensorError
        The dtypes or the shapes outside ``dim`` differ, the dtype holds Python objects, or
        ``out`` does not fit (another shape or dtype, not C-contiguous, or read-only).

    Examples
    --------
    >>> concat_along_dim([np.zeros((2, 3)), np.ones((1, 3))], 0).shape
    (3, 3)
    """
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if not arrays:
        raise InvalidArgumentError("concat_along_dim: no arrays")
    first = arrays[0]
    dim = _check_dim("concat_along_dim", first.ndim, dim)
    _check_plain("concat_along_dim", "array 0", first.dtype)
    for i, a in enumerate(arrays):
        if a.dtype != first.dtype:
            raise TensorError(f"concat_along_dim: array {i} has dtype {a.dtype}, "
                              f"expected {first.dtype}")
        if a.ndim != first.ndim or a.shape[:dim] + a.shape[dim + 1:] != \
                first.shape[:dim] + first.shape[dim + 1:]:
            raise TensorError(f"concat_along_dim: array {i} has shape {a.shape}, incompatible "
                              f"with {first.shape} along dim {dim}")
    shape = list(first.shape)
    shape[dim] = sum(a.shape[dim] for a in arrays)
    if out is None:
        out = np.empty(shape, dtype=first.dtype)
    elif out.shape != tuple(shape) or out.dtype != first.dtype or not out.flags.c_contiguous:
        raise TensorError(f"concat_along_dim: out is {out.dtype}{out.shape}, expected a "
                          f"C-contiguous {first.dtype}{tuple(shape)}")
    elif not out.flags.writeable:
        raise TensorError(f"concat_along_dim: out ({out.dtype}{out.shape}) is read-only")
    offset = 0
    for a in arrays:
        copy_slab_into(a, out, dim, 0, offset, a.shape[dim])
        offset += a.shape[dim]
    return out


def slice_along_dim(array: np.ndarray, dim: int, start: int, stop: int) -> np.ndarray:
    """A new C-contiguous copy of ``array[start:stop]`` along ``dim`` (any dtype of plain data).

    Parameters
    ----------
    array : numpy.ndarray
        The array to slice.
    dim : int
        The dimension to slice along (negative counts from the end).
    start, stop : int
        The half-open range ``[start, stop)`` of ``dim`` to copy,
        ``0 <= start <= stop <= array.shape[dim]``.

    Returns
    -------
    numpy.ndarray
        A new C-contiguous array, ``stop - start`` long along ``dim``.

    Raises
    ------
    InvalidArgumentError
        ``dim`` or the range is out of bounds.
    TensorError
        The dtype holds Python objects.

    Examples
    --------
    >>> slice_along_dim(np.arange(12).reshape(3, 4), 1, 1, 3).tolist()
    [[1, 2], [5, 6], [9, 10]]
    """
    array = np.ascontiguousarray(array)
    _check_plain("slice_along_dim", "array", array.dtype)
    dim = _check_dim("slice_along_dim", array.ndim, dim)
    if not 0 <= start <= stop <= array.shape[dim]:
        raise InvalidArgumentError(f"slice_along_dim: [{start}, {stop}) is out of range for "
                                   f"dim {dim} of shape {array.shape}")
    shape = list(array.shape)
    shape[dim] = stop - start
    out = np.empty(shape, dtype=array.dtype)
    copy_slab_into(array, out, dim, start, 0, stop - start)
    return out
