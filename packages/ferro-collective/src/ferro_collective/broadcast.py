"""broadcast: every rank returns a copy of the root's array (all ranks pass its shape/dtype).

Where a call runs (:mod:`.dispatch` picks):

- **one engine call** (:func:`.all_gather.copy_plan`, run by the compiled path) when the data
  fits a slot: the root writes its slot, every other rank copies it out;
- **staged on the engine** (:func:`engine_broadcast`): larger data (or from
  ``FERRO_SHM_BROADCAST_DIRECT_BYTES``) by cross-memory copies with the work shared: every
  reader pulls the first ``(n-1)/n`` of the buffer from the root while the root pushes the
  last ``1/n`` into each reader; without cross-memory copies, slot-sized pieces;
- **hierarchical** (:func:`stages`): across nodes from the root's node, then inside every node
  from the root's local index;
- **Python**: a binomial tree (:func:`broadcast_tree`, ``ceil(log2 n)`` rounds) or the star.
"""

from __future__ import annotations

import os

import numpy as np

from ferro_backend import InvalidRankError

from . import _fastcall
from ._state import reserve
from .all_gather import copy_plan
from .checks import as_array, check_out
from .engine import EngineGroup, Step
from .p2p import Ctx
from .plan import Plan, choose


def _staged(group: EngineGroup, call: Step, header: bytes, x: np.ndarray, out: np.ndarray,
            root: int) -> None:
    src, dst = x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
    if group.me == root and not np.may_share_memory(dst, src):
        dst[...] = src
    engine_broadcast(group, call, header, dst, root)


_fastcall.register(_fastcall.BROADCAST,
                   lambda group, x, root: copy_plan(group, x, root, "broadcast", _staged))


def prepare(tensor, backend, root, timeout, algorithm, out, seq: int | None = None) -> Plan:
    """The checked plan of one broadcast."""
    x = as_array("broadcast", tensor, backend)
    n = backend.world_size
    if not isinstance(root, int | np.integer) or not 0 <= root < n:
        raise InvalidRankError(f"broadcast: root {root!r} is out of range for world_size {n}")
    root = int(root)
    algo = choose("broadcast", algorithm, x.nbytes, n, backend)
    out = check_out("broadcast", out, x.shape, x.dtype)

    def result() -> np.ndarray:
        buf = np.empty(x.shape, x.dtype) if out is None else out
        if not np.may_share_memory(buf, x):
            buf[...] = x
        return buf

    def python(ctx: Ctx) -> np.ndarray:
        buf = result()
        flat = buf.reshape(-1).view(np.uint8) if buf.size else buf.reshape(-1)
        if n > 1 and buf.size:
            IMPLEMENTATIONS[algo](ctx, flat, root)
        return buf

    def engine(group: EngineGroup, call: Step, header: bytes) -> np.ndarray:
        buf = result() if backend.rank == root else (np.empty(x.shape, x.dtype) if out is None
                                                      else out)
        engine_broadcast(group, call, header, buf.reshape(-1).view(np.uint8), root)
        return buf

    return Plan("broadcast", backend, timeout, (x.dtype, x.shape, None, root), python, engine,
                lambda h: stages(h, x, root, timeout, out), algorithm, seq)


# ----------------------------------------------------------------------------- Python
def broadcast_star(ctx: Ctx, buf: np.ndarray, root: int) -> None:
    tag = ctx.next_tag()
    if ctx.rank == root:
        for r in range(ctx.n):
            if r != root:
                ctx.send(buf, r, tag)
    else:
        ctx.wait(ctx.irecv(buf, root, tag), root, "the broadcast data")


def broadcast_tree(ctx: Ctx, buf: np.ndarray, root: int) -> None:
    """Binomial tree: ceil(log2 n) rounds, relative ranks v receive from v - 2^k."""
    n = ctx.n
    v = (ctx.rank - root) % n
    tag = ctx.next_tag()
    mask = 1
    while mask < n:  # receive phase: from the parent that clears our lowest set bit
        if v & mask:
            parent = ((v - mask) + root) % n
            ctx.wait(ctx.irecv(buf, parent, tag), parent, "the broadcast data")
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < n and not (v & mask) and v % (mask * 2) == 0:
            ctx.send(buf, (v + mask + root) % n, tag)
        mask >>= 1


IMPLEMENTATIONS = {"tree": broadcast_tree, "star": broadcast_star}


# ----------------------------------------------------------------------------- engine
def engine_broadcast(g: EngineGroup, call: Step, header: bytes, buf: np.ndarray,
                     root: int) -> None:
    """Every rank's ``buf`` (1-d bytes) becomes ``root``'s (see the module docstring); a last
    step without data keeps every buffer alive until nobody copies from it any more."""
    size = buf.size
    if size <= g.slot_bytes and not (g.cma_ok and size >= g.broadcast_direct_bytes):
        step = g.exchange(call, header, buf if g.me == root else None, span=size)
        if g.me != root:  # placed as the compiled path places it
            buf[...] = g.data(root, step, size, buf.dtype, size)
    elif g.cma_ok:
        g.exchange(call, header, extra=(os.getpid(), buf.ctypes.data, buf.ctypes.data))
        extras = g.extras()
        cut = size - (size // g.n) // 64 * 64  # the readers pull [0, cut), the root pushes
        if g.me == root:
            for r in range(g.n):
                if r != root:
                    g.write(r, extras[r][2] + cut, buf[cut:])
        else:
            g.read(root, extras[root][1], buf[:cut])
        g.sync(call)
    else:
        for s in range(0, buf.size, g.slot_bytes):
            engine_broadcast(g, call, header, buf[s:s + g.slot_bytes], root)


# ----------------------------------------------------------------------------- hierarchical
def stages(h, x: np.ndarray, root: int, timeout, out):
    """Across nodes from the root's node (its cross group only), then inside every node;
    returns ``run(execute)``."""
    node, cross = h.node, h.cross
    root_node = next(k for k, m in enumerate(h.members) if root in m)
    root_local = h.members[root_node].index(root)
    first = node.rank == root_local  # this rank's cross group holds the root
    s1 = reserve(cross)[0] if first else None
    (s2,) = reserve(node)

    def run(execute) -> np.ndarray:
        buf = np.empty(x.shape, x.dtype) if out is None else out
        if not np.may_share_memory(buf, x):
            buf[...] = x
        if first:
            execute(prepare(buf, cross, root_node, timeout, None, buf, s1))
        execute(prepare(buf, node, root_local, timeout, None, buf, s2))
        return buf

    return run


__all__ = ["IMPLEMENTATIONS", "broadcast_tree", "engine_broadcast", "prepare",
           "stages"]
