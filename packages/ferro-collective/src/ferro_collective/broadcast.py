"""broadcast: every rank returns a copy of the root's array (the others pass its shape and dtype,
or None: :class:`FromRoot`).

Where a call runs (:mod:`.dispatch` picks):

- **the engine's door** (``ferro/engine.h``, from the compiled one-call path or the plan's
  engine body): one step per slot of data (the root writes its slot, every other rank copies
  it out; a large broadcast's steps pipelined two deep, the root filling one slot while the
  others read the other); over half a slot and up to 8 MiB, one step per half slot;
- **hierarchical** (:func:`stages`): across nodes from the root's node, then inside every node
  from the root's local index;
- **Python**: a binomial tree (:func:`broadcast_tree`, ``ceil(log2 n)`` rounds) or the star.
"""

from __future__ import annotations

import numpy as np

from ferro_backend import CollectiveMismatchError, InvalidRankError

from . import _onecall, gathered, pair
from .all_gather import door_bytes
from .arguments import as_array, check_backend, check_out, check_out_known, same_buffer
from .engine_group import OK, EngineGroup, Step, door_calls
from .header import UNKNOWN, check_all, decode_array, mismatch_check_enabled, unknown
from .p2p import Ctx, header_exchange
from .per_backend import reserve
from .plan import Collective, Plan, choose, gathered_or_first, gathers_now


def prepare(tensor, backend, root, timeout, algorithm, out, seq: int | None = None) -> Plan:
    """The checked plan of one broadcast."""
    n = getattr(backend, "world_size", 0)
    if isinstance(root, bool) or not isinstance(root, int | np.integer) or not 0 <= root < n:
        check_backend("broadcast", backend)
        raise InvalidRankError(f"broadcast: root {root!r} is out of range for world_size {n}")
    root = int(root)
    if tensor is None:
        check_backend("broadcast", backend)
        if backend.rank == root:
            raise ValueError(f"broadcast: the root (rank {root}) must pass an array, got None")
        return FromRoot(backend, timeout, root, algorithm, out, seq)
    x = as_array("broadcast", tensor, backend)
    algo = choose(BROADCAST, algorithm, x.nbytes, n, backend)
    out = check_out("broadcast", out, x.shape, x.dtype)

    def result() -> np.ndarray:
        buf = np.empty(x.shape, x.dtype) if out is None else out
        if not same_buffer(buf, x):
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

    def two(ctx: Ctx, header: bytes) -> np.ndarray:
        buf = result() if backend.rank == root else \
            np.empty(x.shape, x.dtype) if out is None else out

        flat = buf.reshape(-1).view(np.uint8)
        # (what a non-root that passed None runs once it has the root's header: FromRoot)
        move = broadcast_tree if n == 2 else IMPLEMENTATIONS[algo]

        def plain() -> None:  # (the header exchange, then the data)
            headers = header_exchange(ctx, header)
            move(ctx, flat, root)
            gathered.none_last(backend, any(h[5] & UNKNOWN for h in headers))

        if n == 2:
            pair.broadcast(ctx, header, flat, root, plain)
        else:  # (three ranks or more: :mod:`.gathered`)
            # (the root sends its result, which holds x as read before an out= overlapping it
            # was written)
            data = flat if backend.rank == root else \
                np.ascontiguousarray(x).reshape(-1).view(np.uint8)
            gathered.broadcast(ctx, header, data, flat, root, plain, lambda: move(ctx, flat, root))
        return buf

    return Plan("broadcast", backend, timeout, (x.dtype, x.shape, None, root), python, engine,
                lambda h: stages(h, x, root, timeout, out), algorithm, seq,
                (two if 0 < x.nbytes <= pair.BROADCAST_FUSE_MAX else None) if n == 2 else
                gathered_or_first("broadcast", x.nbytes, n, backend, two, python))


class FromRoot(Plan):
    """A broadcast on a non-root that passed None (mpi4py's ``bcast`` habit): it publishes a
    header without dtype or shape (:func:`.header.unknown`) and takes the root's, then
    receives as a rank that passed an array of them. On the engine it reads the root's header
    of the call's first step before posting its own (``Steps.peek``), then runs the door's
    broadcast; over point-to-point messages, the header exchange gives it every rank's header.
    The root's header names its shape whole up to six dims; beyond, every rank raises a
    mismatch saying so. Needs the header exchange (the mismatch check on) off the engine.

    An ``out=`` that is not a writable C-contiguous ndarray is refused before the call (on
    every rank); one of another shape or dtype than the root's is known only from its header:
    the rank then receives into a new array, as its peers expect, and raises
    SizeMismatchError once the data moved, on this rank alone (its peers return)."""

    __slots__ = ("root", "algorithm", "out", "late")

    def __init__(self, backend, timeout, root: int, algorithm, out, seq: int | None) -> None:
        if getattr(backend, "engine", None) is None and getattr(backend, "hierarchy", None):
            raise ValueError("broadcast: a non-root may pass None on a single node's engine or "
                             "a flat job, not on a multi-node job's stages: pass an array of "
                             "the root's shape and dtype")
        if getattr(backend, "engine", None) is None and not mismatch_check_enabled():
            raise ValueError("broadcast: a non-root may pass None only with the mismatch check "
                             "on (the root's header gives the shape; set_mismatch_check(False) "
                             "skips it): pass an array of the root's shape and dtype")
        if out is not None:  # (its shape and dtype: once the root's header is in)
            check_out_known("broadcast", out, None, None)
        super().__init__("broadcast", backend, timeout, (None, (), None, root),
                         lambda ctx: None, self._engine, None, algorithm, seq)
        self.root, self.algorithm, self.out = root, algorithm, out
        self.late: BaseException | None = None

    def encoded(self) -> bytes:
        return unknown("broadcast", self.root, self.seq)

    def _plan(self, header: bytes) -> Plan | None:
        """The broadcast of the root's ``header`` (as this rank would have called it), or
        None where that header does not name one this rank can receive."""
        found = decode_array(header)
        if found is None or header[2] != self.encoded()[2] or header[16:28] != \
                self.encoded()[16:28]:
            return None
        dtype, shape = found
        buf = self.out
        if buf is not None:  # a bad one still takes part (its peers, the tree's children
            try:             # among them, wait for it), then raises: :attr:`late`
                check_out("broadcast", buf, shape, dtype)
            except (TypeError, ValueError) as exc:
                self.late, buf = exc, None
        if buf is None:
            buf = np.empty(shape, dtype)
        return prepare(buf, self.backend, self.root, self.timeout, self.algorithm, buf, self.seq)

    def run_python(self) -> np.ndarray:
        ctx = self.context()
        if ctx.n == 2:  # (a root of two ranks may send its data with its header: :mod:`.pair`)
            root_header = pair.from_root(ctx, self.encoded())
        else:
            try:  # (raises on every rank if no root's)
                root_header = header_exchange(ctx, self.encoded())[self.root]
            except gathered.FromRootMet as met:  # (the others sent their data in its rounds)
                root_header = met.headers[self.root]
        plan = self._plan(root_header)
        assert plan is not None  # (header_exchange checked it)
        result = plan.python(ctx)
        if not gathered.none_was_last(self.backend) and self._took_pair(plan, result.nbytes):
            gathered.none_last(self.backend, True)  # (as the others record it: .gathered)
        ctx.release()
        if self.late is not None:
            raise self.late
        return result

    def _took_pair(self, plan: Plan, nbytes: int) -> bool:
        """Whether the ranks that passed an array ran this call through its :attr:`Plan.pair`
        (where they record whether a non-root passed None: :func:`.gathered.none_last`): on
        two ranks where it has one, on more where the cost model rates it gathered, as
        :func:`.plan.gathered_or_first` decides."""
        if plan.pair is None:
            return False
        n = self.backend.world_size
        return n == 2 or gathers_now("broadcast", nbytes, n, self.backend)

    def _engine(self, group: EngineGroup, call: Step, header: bytes) -> np.ndarray:
        rc, theirs = group.steps.peek(self.root, call.hard)
        if rc != OK:
            group.exchange(call, header)  # the step's own error (a timeout, a dead peer)
        plan = self._plan(theirs)
        if plan is None:  # publish ours: every rank then raises the mismatch
            group.exchange(call, header)
            check_all("broadcast", group.me, group.steps.headers())
            raise CollectiveMismatchError(f"broadcast (seq {self.seq}): the root's header "
                                          "does not name an array this rank can receive")
        result = plan.engine(group, call, plan.encoded())
        if self.late is not None:
            raise self.late
        return result


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
        if not same_buffer(buf, x):
            buf[...] = x
        if first:
            execute(prepare(buf, cross, root_node, timeout, None, buf, s1))
        execute(prepare(buf, node, root_local, timeout, None, buf, s2))
        return buf

    return run


BROADCAST = Collective("broadcast", prepare, _onecall.BROADCAST, ("auto", "tree", "star"),
                       torch="broadcast", jax="broadcast")

__all__ = ["BROADCAST", "IMPLEMENTATIONS", "FromRoot", "broadcast_tree", "prepare", "stages"]
