"""The pipeline of a large hierarchical allreduce (:func:`.allreduce.stages`): its pieces, the
one order in which every rank issues the node stages, and where the result can be written.

Piece k crosses the network (on the cross group's worker thread) while the node reduces piece
k + 1 and gathers piece k - 1, so the node stages hide behind the link
(``benchmarks/emulated.py``).
"""

from __future__ import annotations

import numpy as np

from .arguments import same_buffer

#: a hierarchical allreduce of at least PIPELINE_MIN bytes runs as a pipeline of pieces of about
#: PIPELINE_PIECE bytes
PIPELINE_PIECE = 4 << 20
PIPELINE_MIN = 2 * PIPELINE_PIECE


def schedule(k: int) -> list[tuple[str, int]]:
    """The node group's calls of a k-piece pipeline, in the one order every rank issues them:
    reduce-scatter 0, then for each piece the next reduce-scatter before its all-gather."""
    order = [("rs", 0)]
    for p in range(k):
        if p + 1 < k:
            order.append(("rs", p + 1))
        order.append(("ag", p))
    return order


def writable_into(out: np.ndarray | None, x: np.ndarray) -> bool:
    """Whether the stages can write the result straight into ``out``: C-contiguous, x's dtype,
    and either apart from x or x itself (each piece is read before its result is written)."""
    return (out is not None and out.dtype == x.dtype and out.flags.c_contiguous
            and (not np.may_share_memory(out, x)
                 or (x.flags.c_contiguous and same_buffer(out, x))))


__all__ = ["PIPELINE_MIN", "PIPELINE_PIECE", "schedule", "writable_into"]
