"""all_gather: every rank's array, concatenated along dim 0 in rank order, on every rank.

Where a call runs (:mod:`.dispatch` picks):

- **the engine's door** (``ferro/engine.h``, from the compiled one-call path or the plan's
  engine body): a block up to a slot in one step (every rank copies every rank's slot into its
  result); larger blocks stream through the slots, pipelined in chunks (two plain copies on two
  cores at once beat one cross-memory read, which pins the owner's pages one by one);
- **hierarchical** (:func:`stages`): all_gather inside the node, then across nodes (blocks
  put back in rank order);
- **Python**: the ring (bandwidth-optimal) or the star.
"""

from __future__ import annotations

import numpy as np

from . import _onecall, gathered, pair
from .arguments import as_array, check_out
from .engine_group import EngineGroup, Step, door_calls
from .header import dtype_code
from .ops import CODES
from .p2p import Ctx, all_gather_ring_into
from .per_backend import reserve
from .plan import Collective, Plan, choose, gathered_or_first


def gathered_shape(x: np.ndarray, n: int) -> tuple[int, ...]:
    """The result's shape: dim 0 times ``n`` (a 0-d input gathers to ``[n]``)."""
    return (n,) if x.ndim == 0 else (x.shape[0] * n, *x.shape[1:])


def door_bytes(group: EngineGroup, call: Step, kind: int, x: np.ndarray, out: np.ndarray | None,
               root: int = 0, send: bool = True) -> None:
    """A copy collective of ``x`` (all_gather, gather, broadcast: ``kind``) through the
    engine's door: in its dtype where the door knows it, else as its bytes naming the dtype
    (``send``: this rank's input is read; ``out`` None: this rank gets nothing)."""
    block = np.ascontiguousarray(x)
    code = CODES.get(x.dtype)
    name = None if code is not None else dtype_code(x.dtype)
    if code is None:
        code = CODES[np.dtype(np.uint8)]
        block = block.reshape(-1).view(np.uint8)
        out = None if out is None else out.reshape(-1).view(np.uint8)
    group.door(call, kind, block if send else None, out, code, root=root, shape=x.shape,
               type_name=name)


def prepare(tensor, backend, arg, timeout, algorithm, out, seq: int | None = None) -> Plan:
    """The checked plan of one all_gather (``arg`` unused)."""
    x = as_array("all_gather", tensor, backend)
    n = backend.world_size
    algo = choose(ALL_GATHER, algorithm, x.nbytes, n, backend)
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
        door_bytes(group, call, door_calls.ALL_GATHER, x, result)
        return result

    def two(ctx: Ctx, header: bytes) -> np.ndarray:  # (or more: :mod:`.gathered`)
        block = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
        result = np.empty(shape, dtype=x.dtype) if out is None else out
        return (pair if n == 2 else gathered).all_gather(ctx, header, block, result)

    return Plan("all_gather", backend, timeout, (x.dtype, x.shape, None, -1), python, engine,
                lambda h: stages(h, x, shape, timeout, out), algorithm, seq,
                (two if 0 < x.nbytes <= pair.FUSE_MAX else None) if n == 2 else
                gathered_or_first("all_gather", x.nbytes, n, backend, two, python))


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


ALL_GATHER = Collective("all_gather", prepare, _onecall.ALL_GATHER, ("auto", "ring", "star"),
                        torch="all_gather_into_tensor", jax="all_gather")

__all__ = ["ALL_GATHER", "IMPLEMENTATIONS", "door_bytes", "gathered_shape", "prepare",
           "stages"]
