"""What every rank works out alike from a call's metadata (:mod:`.metadata_step`): a scatter's
block, from the root's descriptor; all_to_all_single's rows and byte sizes, from every rank's
splits; the arrays an uneven call returns, from every rank's rows. The same answer on every
rank, or the same error, whichever path (the general one or the compiled twin,
:mod:`._metacall`) the rank took.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ferro_backend import SizeMismatchError

from .metadata_step import sent_bytes, unpack_desc, unpack_ints


def scatter_block(desc: bytes, root: int, n: int) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and shape of every rank's block, from the root's descriptor (its metadata,
    :func:`.metadata_step.pack_desc`); or the SizeMismatchError every rank raises alike."""
    dtype, full = unpack_desc(desc)
    if len(full) == 0:
        raise SizeMismatchError(f"scatter: root {root}'s tensor is 0-d; it cannot be split "
                                "across ranks")
    if full[0] % n:
        raise SizeMismatchError(f"scatter: dim 0 of root {root}'s shape {full} ({full[0]}) "
                                f"is not divisible by world_size {n}")
    return dtype, (full[0] // n, *full[1:])


_plans: dict[tuple, tuple[list[int], list[int], list[int]]] = {}


def split_plan(name: str, metas: list[bytes], n: int, me: int,
               rb: int) -> tuple[list[int], list[int], list[int]]:
    """From every rank's ``send_splits + recv_splits`` (metadata): the rows this rank gets from
    each rank, and the engine's byte sizes (:func:`.metadata_step.sent_bytes`); or the
    SizeMismatchError every rank raises alike. Cached: the same splits come back call after
    call."""
    key = (me, rb, *metas)
    got = _plans.get(key)
    if got is not None:
        return got
    sends = [unpack_ints(m, n) for m in metas]
    for d, m in enumerate(metas):  # every rank checks every pair: the same error everywhere
        declared = unpack_ints(m, n, 8 * n)
        recv = [sends[r][d] for r in range(n)]
        if declared[0] < 0:
            if len(set(recv)) > 1:
                raise SizeMismatchError(
                    f"{name}: rank {d} passed recv_splits=None (equal splits) but ranks "
                    f"0..{n - 1} send it {recv} rows; pass recv_splits")
        elif declared != recv:
            r = next(r for r in range(n) if declared[r] != recv[r])
            raise SizeMismatchError(f"{name}: rank {r} sends {recv[r]} rows to rank {d}, "
                                    f"whose recv_splits[{r}] is {declared[r]}")
    got = ([sends[r][me] for r in range(n)],
           *sent_bytes([[k * rb for k in row] for row in sends], me))
    if len(_plans) > 256:
        _plans.clear()
    _plans[key] = got
    return got


def row_bytes(dtype: np.dtype, trailing: tuple[int, ...]) -> int:
    """The bytes of one row: the trailing shape's items of ``dtype``."""
    return math.prod(trailing) * dtype.itemsize


def row_views(buf: np.ndarray, rows: Sequence[int], dtype: np.dtype, trailing: tuple[int, ...],
              zero_d: bool) -> list[np.ndarray]:
    """``buf`` (bytes) cut into consecutive arrays of ``rows[r]`` rows each (0-d ones where
    every rank sent a 0-d array)."""
    rb = row_bytes(dtype, trailing)
    cast = dtype != buf.dtype
    out, start = [], 0
    for k in rows:
        piece = buf[start:start + k * rb]
        if cast:
            piece = piece.view(dtype)
        if zero_d or trailing:  # (1-d pieces have their shape already)
            piece = piece.reshape(()) if zero_d else piece.reshape(k, *trailing)
        out.append(piece)
        start += k * rb
    return out


__all__ = ["row_bytes", "row_views", "scatter_block", "split_plan"]
