"""The argument checks every collective shares: the backend, the array, ``out=``, the root.

Each raises ferro's typed error naming what was wrong (the collective, the shapes, dtypes and
ranks involved); collectives make them before a call takes its sequence number, so a bad call
fails on the rank that made it with nothing taken.
"""

from __future__ import annotations

import numpy as np

from ferro_backend import Backend, InvalidRankError, SizeMismatchError

#: what a collective takes as a scalar: a Python int, float or bool, or a numpy scalar
SCALARS = (int, float, np.generic)


def as_array(name: str, tensor, backend) -> np.ndarray:
    """``tensor`` as an array (no copy when it is one), on a real backend."""
    check_backend(name, backend)
    x = np.asarray(tensor)
    if x.dtype.hasobject or x.dtype.itemsize == 0:
        raise TypeError(f"{name}: dtype {x.dtype} cannot be sent")
    return x


def fast_array(tensor) -> np.ndarray | None:
    """``tensor`` when it is an ndarray, a Python or numpy scalar as the 0-d array the general
    path would make of it (so that a scalar, e.g. a loss to average, takes the engine's
    one-call path too); None otherwise (the general path checks it)."""
    if type(tensor) is np.ndarray:
        return tensor
    return np.asarray(tensor) if isinstance(tensor, SCALARS) else None


def check_out_like(name: str, out, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """``out=`` an ndarray (else TypeError) of the result's shape and dtype (else
    SizeMismatchError, naming both). An ndarray subclass whose flat view is not 1-d
    (``numpy.matrix``: its reshape stays 2-d) is a TypeError too: the collectives write
    ``out`` through its flat view (a subclass that keeps ndarray's views, such as
    ``numpy.memmap``, is written as an ndarray)."""
    check_out_type(name, out)
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise SizeMismatchError(f"{name}: out is {out.dtype}{list(out.shape)}, the result is "
                                f"{np.dtype(dtype)}{list(shape)}")


def check_out_type(name: str, out) -> None:
    """``out=`` an ndarray whose flat view is 1-d (else TypeError naming its type)."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name}: out must be a numpy array, got {type(out).__name__}")
    if type(out) is not np.ndarray and _flat_dims(out) != 1:
        raise TypeError(f"{name}: out must be a numpy array whose views behave as ndarray's, "
                        f"got {type(out).__module__}.{type(out).__name__} (its reshape(-1) is "
                        "not 1-d); pass np.asarray(out)")


def check_out_known(name: str, out, shape: tuple[int, ...] | None,
                    dtype: np.dtype | None) -> None:
    """What :func:`check_out` checks of ``out=`` that a rank knows before the data moves, for
    a call whose result's size only its metadata round tells (the uneven collectives, a
    non-root's broadcast(None) and scatter): its type (TypeError), writable and C-contiguous
    (ValueError), ``dtype`` unless None and ``shape``'s dims unless None, a -1 among them
    unknown (SizeMismatchError, the unknown dims shown as ``*``)."""
    check_out_type(name, out)
    if (dtype is not None and out.dtype != dtype) or (shape is not None and (
            out.ndim != len(shape) or any(k >= 0 and k != m for k, m in zip(shape, out.shape)))):
        want = "*" if shape is None else ", ".join("*" if k < 0 else str(k) for k in shape)
        raise SizeMismatchError(f"{name}: out is {out.dtype}{list(out.shape)}, the result is "
                                f"{'?' if dtype is None else np.dtype(dtype)}[{want}]")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name}: out must be writable and C-contiguous")


def _flat_dims(out: np.ndarray) -> int:
    """The dimensions of ``out.reshape(-1)`` (-1 where the subclass cannot make it)."""
    try:
        return out.reshape(-1).ndim
    except Exception:  # (a subclass's own reshape: refused, whatever it raised)
        return -1


def check_out(name: str, out, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
    """``out=`` checked: a writable C-contiguous ndarray of the result's shape and dtype."""
    if out is None:
        return None
    check_out_like(name, out, shape, dtype)
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name}: out must be writable and C-contiguous")
    return out


def check_root(name: str, root, n: int) -> int:
    if isinstance(root, bool) or not isinstance(root, int | np.integer) or not 0 <= root < n:
        raise InvalidRankError(f"{name}: root {root!r} is out of range for world_size {n}")
    return int(root)


def check_backend(name: str, backend) -> None:
    """A real backend, not closed or aborted (closed means closed: nothing is published)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"{name}: backend must be a ferro_backend.Backend, got "
                        f"{type(backend).__name__}")
    failure = backend.peer_failure(name, backend.rank)
    if failure is not None:
        raise failure


def same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the same bytes in the same layout (an in-place call), not
    merely arrays that share some bytes (an ``out=`` overlapping the input elsewhere, which
    must be written as if the input were read first)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype)


def finish(result: np.ndarray, dtype: np.dtype, out: np.ndarray | None) -> np.ndarray:
    """``result`` in ``dtype``, in ``out`` when given (no copy when it already is ``out``)."""
    if out is None:
        return result if result.dtype == dtype else result.astype(dtype)
    if result is not out and not same_buffer(result, out):
        np.copyto(out, result, casting="unsafe")
    return out


def deliver(res: np.ndarray, out: np.ndarray | None, late: BaseException | None) -> np.ndarray:
    """The end of a call whose ``out=`` was checked once the sizes were known (the uneven
    collectives): this rank's ``late`` error, raised after the data moved; else ``res``, copied
    into ``out`` where it is not ``out`` itself (it was apart from an ``out`` that overlapped the
    input)."""
    if late is not None:
        raise late
    if out is not None and res is not out:
        out[...] = res
        return out
    return res


__all__ = ["SCALARS", "as_array", "check_backend", "check_out", "check_out_known",
           "check_out_type", "check_root", "deliver",
           "fast_array", "finish", "same_buffer"]
