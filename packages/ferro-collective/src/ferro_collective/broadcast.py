"""broadcast: every rank returns a copy of the root's array (all ranks pass its shape/dtype).

Where a call runs (:mod:`.dispatch` picks):

- **the engine's door** (``ferro/engine.h``, from the compiled one-call path or the plan's
  engine body): one step per slot of data (the root writes its slot, every other rank copies
  it out; a large broadcast's steps pipelined two deep, the root filling one slot while the
  others read the other);
- **hierarchical** (:func:`stages`): across nodes from the root's node, then inside every node
  from the root's local index;
- **Python**: a binomial tree (:func:`broadcast_tree`, ``ceil(log2 n)`` rounds) or the star.
"""

from __future__ import annotations

import numpy as np

from ferro_backend import InvalidRankError

from ._state import reserve
from .all_gather import door_bytes
from .checks import as_array, check_out
from .engine import EngineGroup, Step, door_calls
from .p2p import Ctx
from .plan import Plan, choose


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
        buf = np.empty(x.shape, x.dtype) if out is None else out
        door_bytes(group, call, door_calls.BROADCAST, x, buf, root, send=backend.rank == root)
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


__all__ = ["IMPLEMENTATIONS", "broadcast_tree", "prepare", "stages"]
