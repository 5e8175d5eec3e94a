"""reduce_scatter: reduce across ranks, then rank ``r`` keeps the ``r``-th of ``world_size``
equal slices along dim 0 (dim 0 must be divisible by the world size).

Where a call runs (:mod:`.dispatch` picks):

- **the engine's door** (``ferro/engine.h``, from the compiled one-call path or the plan's
  engine body): below 256 KiB (and 4 times the engine's split threshold, which an
  oversubscribed job raises) one step (every rank folds its part of every rank's slot, in rank
  order); from there each rank folds its part of every rank's input from their input rings,
  pipelined in chunks (``_split.h``);
- **hierarchical** (:func:`stages`): the hierarchical allreduce, then this rank's slice;
- **Python**: the ring or the star.
"""

from __future__ import annotations

import numpy as np

from ferro_backend import SizeMismatchError

from . import _onecall, allreduce, gathered, pair
from .arguments import as_array, check_out
from .engine_group import EngineGroup, Step, door_calls
from .ops import CODES, OPS, ReduceOp, as_op, work_dtype
from .p2p import Ctx, fold_at_root, reduce_scatter_ring_into
from .plan import Collective, Plan, choose, gathered_or_first


def prepare(tensor, backend, op, timeout, algorithm, out, seq: int | None = None) -> Plan:
    """The checked plan of one reduce_scatter."""
    x = as_array("reduce_scatter", tensor, backend)
    op = as_op(op)
    wd = work_dtype("reduce_scatter", x.dtype, op)
    n = backend.world_size
    if x.ndim == 0:
        raise SizeMismatchError("reduce_scatter: a 0-d tensor cannot be split across ranks")
    if x.shape[0] % n:
        raise SizeMismatchError(f"reduce_scatter: dim 0 of shape {x.shape} ({x.shape[0]}) is "
                                f"not divisible by world_size {n}")
    algo = choose(REDUCE_SCATTER, algorithm, x.nbytes, n, backend)
    out_shape = (x.shape[0] // n, *x.shape[1:])
    out = check_out("reduce_scatter", out, out_shape, x.dtype)

    def python(ctx: Ctx) -> np.ndarray:
        buf = np.array(x, dtype=wd, order="C", copy=True).reshape(-1)
        if n == 1 or not buf.size:
            mine = buf[: buf.size // n]
        else:
            mine = IMPLEMENTATIONS[algo](ctx, buf, op)
        if out is None:
            return np.array(mine, dtype=x.dtype, copy=True).reshape(out_shape)
        np.copyto(out.reshape(-1), mine, casting="unsafe")
        return out

    def engine(group: EngineGroup, call: Step, header: bytes) -> np.ndarray:
        result = np.empty(out_shape, x.dtype) if out is None else out
        group.door(call, door_calls.REDUCE_SCATTER, np.ascontiguousarray(x), result,
                   CODES[x.dtype], OPS[op].door, shape=x.shape)
        return result

    def two(ctx: Ctx, header: bytes) -> np.ndarray:
        return pair.reduce_scatter(ctx, header, x, wd, op, out, out_shape)

    def many(ctx: Ctx, header: bytes) -> np.ndarray:
        return gathered.reduce_scatter(ctx, header, x, wd, op, out, out_shape)

    nbytes = x.size * wd.itemsize
    return Plan("reduce_scatter", backend, timeout, (x.dtype, x.shape, op, -1), python, engine,
                lambda h: stages(h, x, op, wd, out_shape, timeout, out, backend.rank),
                algorithm, seq,
                (two if 0 < nbytes // 2 <= pair.FUSE_MAX else None) if n == 2 else
                gathered_or_first("reduce_scatter", nbytes, n, backend, many, python))


# ----------------------------------------------------------------------------- Python
def reduce_scatter_ring(ctx: Ctx, buf: np.ndarray, op: ReduceOp) -> np.ndarray:
    n = ctx.n
    size = buf.size // n
    bounds = [(r * size, (r + 1) * size) for r in range(n)]
    mean = n if op is ReduceOp.MEAN else None
    owned = reduce_scatter_ring_into(ctx, buf, op, bounds, mean)
    s, e = bounds[owned]
    return buf[s:e]


def reduce_scatter_star(ctx: Ctx, buf: np.ndarray, op: ReduceOp) -> np.ndarray:
    n, me = ctx.n, ctx.rank
    size = buf.size // n
    tag_up, tag_down = ctx.next_tag(), ctx.next_tag()
    if me == 0:
        fold_at_root(ctx, buf, op, tag_up)
        for r in range(1, n):
            ctx.send(buf[r * size:(r + 1) * size], r, tag_down)
        return buf[:size]
    out = np.empty(size, dtype=buf.dtype)
    req = ctx.irecv(out, 0, tag_down)
    ctx.send(buf, 0, tag_up)
    ctx.wait(req, 0, "its reduced chunk")
    return out


IMPLEMENTATIONS = {"ring": reduce_scatter_ring, "star": reduce_scatter_star}


# ----------------------------------------------------------------------------- hierarchical
def stages(h, x: np.ndarray, op: ReduceOp, wd: np.dtype, out_shape, timeout, out, rank: int):
    """The hierarchical allreduce, then this rank's slice; returns ``run(execute)``."""
    whole = allreduce.stages(h, x, op, wd, timeout, None)

    def run(execute) -> np.ndarray:
        full = whole(execute)
        rows = out_shape[0]
        mine = full[rank * rows:(rank + 1) * rows]
        if out is None:
            return np.array(mine, copy=True)
        out[...] = mine
        return out

    return run



REDUCE_SCATTER = Collective("reduce_scatter", prepare, _onecall.REDUCE_SCATTER,
                            ("auto", "ring", "star"), torch="reduce_scatter_tensor",
                            jax="reduce_scatter")

__all__ = ["IMPLEMENTATIONS", "REDUCE_SCATTER", "prepare", "stages"]
