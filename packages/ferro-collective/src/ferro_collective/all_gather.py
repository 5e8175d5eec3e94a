"""all_gather: every rank's array, concatenated along dim 0 in rank order, on every rank.

Where a call runs (:mod:`.dispatch` picks):

- **one engine call** (:func:`copy_plan`, run by the compiled path) when a block fits a slot:
  every rank copies every rank's slot into its result;
- **staged on the engine** (:func:`engine_all_gather`): blocks beyond a slot stream through the
  slots, pipelined in chunks (two plain copies on two cores at once beat one cross-memory read,
  which pins the owner's pages one by one); from ``FERRO_SHM_DIRECT_COPY_BYTES`` they are read
  straight from their owners' memory instead, where ranks may read each other's;
- **hierarchical** (:func:`stages`): all_gather inside the node, then across nodes (blocks
  put back in rank order);
- **Python**: the ring (bandwidth-optimal) or the star.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from ferro_backend import _wire

from . import _fastcall
from ._state import reserve
from .checks import as_array, check_out
from .engine import OK, EngineGroup, FastPlan, Step, one_call_header
from .p2p import Ctx, all_gather_ring_into
from .plan import Plan, choose

#: an own block at least this large is copied with non-temporal stores (well past the cache:
#: 8 MiB copies in 0.45 ms instead of 0.51, 32 MiB in 3.1 instead of 5.1, one process here)
STREAM_COPY_BYTES = 4 << 20


def gathered_shape(x: np.ndarray, n: int) -> tuple[int, ...]:
    """The result's shape: dim 0 times ``n`` (a 0-d input gathers to ``[n]``)."""
    return (n,) if x.ndim == 0 else (x.shape[0] * n, *x.shape[1:])


def copy_plan(group: EngineGroup, x: np.ndarray, root: int, name: str,
              staged: Callable[..., None]) -> FastPlan | None:
    """The one-call plan of a broadcast (``root`` >= 0) or all_gather (-1) of ``x``'s
    signature, made once per signature by the compiled path: one engine step when the data fits
    a slot (and is not better read straight from the peer), else ``staged`` (the staged engine
    path); None for object arrays (the general path refuses them)."""
    if x.dtype.hasobject:
        return None
    nbytes = x.nbytes
    direct = group.broadcast_direct_bytes if root >= 0 else group.direct_copy_bytes
    one_step = nbytes <= group.slot_bytes and not (group.cma_ok and nbytes >= direct)
    header, h = one_call_header(name, x.dtype, x.shape, None, root)
    shape = x.shape if root >= 0 else gathered_shape(x, group.n)
    return FastPlan.copy(name, header, shape, h, root, one_step, staged)


def _staged(group: EngineGroup, call: Step, header: bytes, x: np.ndarray, out: np.ndarray,
            root: int = -1) -> None:
    engine_all_gather(group, call, header, x.reshape(-1).view(np.uint8),
                      out.reshape(-1).view(np.uint8))


_fastcall.register(_fastcall.ALL_GATHER,
                   lambda group, x, arg: copy_plan(group, x, -1, "all_gather", _staged))


def gather_plan(group: EngineGroup, x: np.ndarray, root: int) -> FastPlan | None:
    """The one-call plan of a gather to ``root`` of ``x``'s signature: one all_gather step
    under the gather's header (the general path's, root included) when a block fits a slot;
    larger blocks take the general path (the root reads them straight from their owners)."""
    if x.dtype.hasobject:
        return None
    header, h = one_call_header("gather", x.dtype, x.shape, None, root)
    return FastPlan.copy("gather", header, gathered_shape(x, group.n), h, -1,
                         x.nbytes <= group.slot_bytes, None)


_fastcall.register(_fastcall.GATHER, gather_plan)


def prepare(tensor, backend, arg, timeout, algorithm, out, seq: int | None = None) -> Plan:
    """The checked plan of one all_gather (``arg`` unused)."""
    x = as_array("all_gather", tensor, backend)
    n = backend.world_size
    algo = choose("all_gather", algorithm, x.nbytes, n, backend)
    shape = gathered_shape(x, n)
    out = check_out("all_gather", out, shape, x.dtype)

    def python(ctx: Ctx) -> np.ndarray:
        block = np.ascontiguousarray(x).reshape(-1)
        result = np.empty(shape, dtype=x.dtype) if out is None else out
        flat = result.reshape(-1)
        if n == 1 or not block.size:
            flat[...] = block
            return result
        IMPLEMENTATIONS[algo](ctx, block.view(np.uint8), flat.view(np.uint8))
        return result

    def engine(group: EngineGroup, call: Step, header: bytes) -> np.ndarray:
        result = np.empty(shape, dtype=x.dtype) if out is None else out
        _staged(group, call, header, np.ascontiguousarray(x), result)
        return result

    return Plan("all_gather", backend, timeout, (x.dtype, x.shape, None, -1), python, engine,
                lambda h: stages(h, x, shape, timeout, out), algorithm, seq)


# ----------------------------------------------------------------------------- Python
def all_gather_star(ctx: Ctx, block: np.ndarray, out: np.ndarray) -> None:
    n, me = ctx.n, ctx.rank
    size = block.size
    tag_up, tag_down = ctx.next_tag(), ctx.next_tag()
    if me == 0:
        out[:size] = block
        reqs = [ctx.irecv(out[r * size:(r + 1) * size], r, tag_up) for r in range(1, n)]
        for r in range(1, n):
            ctx.wait(reqs[r - 1], r, "its block")
        for r in range(1, n):
            ctx.send(out, r, tag_down)
    else:
        req = ctx.irecv(out, 0, tag_down)
        ctx.send(block, 0, tag_up)
        ctx.wait(req, 0, "the gathered result")


def all_gather_ring(ctx: Ctx, block: np.ndarray, out: np.ndarray) -> None:
    size = block.size
    me = ctx.rank
    out[me * size:(me + 1) * size] = block
    bounds = [(r * size, (r + 1) * size) for r in range(ctx.n)]
    all_gather_ring_into(ctx, out, bounds, me)


IMPLEMENTATIONS = {"ring": all_gather_ring, "star": all_gather_star}


# ----------------------------------------------------------------------------- engine
def engine_all_gather(g: EngineGroup, call: Step, header: bytes, block: np.ndarray,
                      out: np.ndarray) -> None:
    """``out`` (1-d bytes) = every rank's ``block`` (1-d bytes), in rank order."""
    size = block.size
    direct = g.cma_ok and size >= g.direct_copy_bytes
    if size <= g.slot_bytes and not direct:
        step = g.exchange(call, header, block, span=size)  # placed as the compiled path's
        for r in range(g.n):
            out[r * size:(r + 1) * size] = block if r == g.me else g.data(r, step, size,
                                                                          block.dtype, size)
    elif not direct:  # beyond a slot: streamed through the slots, pipelined (_stream.h)
        rc = g.slots.step_gather(header, call.seq & 0xFFFFFFFF, block, out, call.soft)
        if rc != OK:
            g._settle(rc, call)
            rc = g.slots.resume(call.hard)
            if rc != OK:
                g._late(rc, call.name, call.seq, call.timeout, call.start)
    else:
        # this rank's own block first: while the peers arrive, and from a hot source; a block
        # far larger than the cache with non-temporal stores (no read of the lines it writes)
        mine = out[g.me * size:(g.me + 1) * size]
        if size >= STREAM_COPY_BYTES:
            _wire.stream_copy(block, mine)
        else:
            mine[...] = block
        g.exchange(call, header, extra=(os.getpid(), block.ctypes.data, 0))
        extras = g.extras()
        for r in range(g.n):
            if r != g.me:
                g.read(r, extras[r][1], out[r * size:(r + 1) * size])
        g.sync(call)


# ----------------------------------------------------------------------------- hierarchical
def stages(h, x: np.ndarray, shape: tuple[int, ...], timeout, out):
    """Inside the node, then across nodes; returns ``run(execute)``."""
    node, cross = h.node, h.cross
    (s1,) = reserve(node)
    (s2,) = reserve(cross)
    order = [r for m in h.members for r in m]  # block k of the result belongs to rank order[k]

    def run(execute) -> np.ndarray:
        inner = execute(prepare(x, node, None, timeout, None, None, s1))
        both = execute(prepare(inner, cross, None, timeout, None, None, s2))
        result = np.empty(shape, x.dtype) if out is None else out
        if order == sorted(order):
            result.reshape(-1)[...] = both.reshape(-1)
            return result
        blocks = both.reshape(len(order), -1)
        dst = result.reshape(len(order), -1)
        for k, r in enumerate(order):
            dst[r] = blocks[k]
        return result

    return run


__all__ = ["IMPLEMENTATIONS", "copy_plan", "engine_all_gather", "gathered_shape",
           "prepare", "stages"]
