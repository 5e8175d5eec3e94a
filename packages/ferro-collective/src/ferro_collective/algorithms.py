"""The algorithms behind the collectives, on flat contiguous 1-d buffers.

- ``star``: gather to rank 0, reduce in rank order, send back (the seed's algorithm; a reference).
- ``ring``: reduce-scatter then all-gather around the ring; every rank sends and receives
  2(n-1)/n of the data, whatever n (bandwidth-optimal). Chunks are uneven when the element count
  is not divisible by n.
- ``recursive_doubling``: log2(n) rounds of pairwise exchanges (latency-optimal for small
  messages); ranks beyond the largest power of two fold into a partner first.
- ``tree``: binomial-tree broadcast from the root.

Every algorithm fixes the order in which values are combined, and the final values of a chunk are
computed once (by its owner) and copied to everyone, so every rank returns the same bits, and the
same inputs give the same bits run after run.

Each step posts its receive before sending, so transports deliver straight into the destination.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from ferro_backend import CollectiveTimeoutError
from ferro_backend.partition import split_bounds

from ._state import STEPS_PER_CALL
from .header import HEADER_SIZE, check_all
from .ops import ReduceOp, accumulate

log = logging.getLogger("ferro_collective")

#: fraction of the timeout after which a waiting collective logs a stall report
STALL_FRACTION = 0.5


def set_stall_report(fraction: float) -> None:
    """Log a stall report once a collective has waited ``fraction`` of its timeout (0 < f <= 1)."""
    global STALL_FRACTION
    if not 0 < fraction <= 1:
        raise ValueError(f"stall report fraction {fraction} is not in (0, 1]")
    STALL_FRACTION = fraction


class Ctx:
    """One collective call: its backend, tags, deadlines and names for error messages."""

    def __init__(self, backend, name: str, seq: int, tag_base: int, timeout: float) -> None:
        self.backend = backend
        self.rank = backend.rank
        self.n = backend.world_size
        self.name = name
        self.seq = seq
        self.tag_base = tag_base
        self.timeout = timeout
        self.start = time.monotonic()
        self.deadline = self.start + timeout
        self.soft_deadline = self.start + timeout * STALL_FRACTION
        self.reported = False
        self.step = 1  # tag offset 0 is the header exchange

    def next_tag(self) -> int:
        tag = self.tag_base + self.step
        self.step += 1
        if self.step >= STEPS_PER_CALL:
            self.step = 1
        return tag

    def irecv(self, out: np.ndarray, src: int, tag: int):
        return self.backend.irecv(out, src, tag=tag)

    def send(self, data: np.ndarray, dst: int, tag: int) -> None:
        self.backend.send(data, dst, tag=tag)

    def wait(self, req, src: int, what: str, missing=None) -> None:
        """Wait for ``req`` from ``src``: a stall report at the soft deadline, then the error."""
        if not self.reported:
            if req.poll(max(0.0, self.soft_deadline - time.monotonic())):
                return
            self.reported = True
            waiting = sorted(missing) if missing is not None else [src]
            log.warning("%s (seq %d) on rank %d: still waiting for %s from rank %d after %.1fs; "
                        "ranks not arrived: %s", self.name, self.seq, self.rank, what, src,
                        time.monotonic() - self.start, waiting)
        remaining = self.deadline - time.monotonic()
        try:
            req.wait(max(remaining, 0.0))
        except CollectiveTimeoutError:
            waiting = sorted(missing) if missing is not None else [src]
            raise CollectiveTimeoutError(
                f"{self.name} (seq {self.seq}) on rank {self.rank}: timed out after "
                f"{self.timeout:g}s waiting for {what} from rank {src}; ranks not arrived: "
                f"{waiting}") from None

    def exchange(self, send: np.ndarray, dst: int, recv: np.ndarray, src: int, what: str) -> None:
        tag = self.next_tag()
        req = self.irecv(recv, src, tag)
        self.send(send, dst, tag)
        self.wait(req, src, what)


# ----------------------------------------------------------------------------- header / barrier
def header_exchange(ctx: Ctx, header: bytes) -> None:
    """Bruck all-gather of every rank's header; raises CollectiveMismatchError on disagreement.

    Doubles as the barrier: nobody leaves before every rank has arrived.
    """
    n, me = ctx.n, ctx.rank
    known = bytearray(header)  # headers of ranks me, me+1, ..., me+count-1 (mod n)
    count = 1
    distance = 1
    tag = ctx.tag_base
    while count < n:
        take = min(distance, n - count)
        src, dst = (me + distance) % n, (me - distance) % n
        incoming = bytearray(take * HEADER_SIZE)
        req = ctx.backend.irecv(incoming, src, tag=tag)
        # the receiver (me - distance) knows as many headers as we do and takes the next `take`
        ctx.send(bytes(known[: take * HEADER_SIZE]), dst, tag)
        missing = {(me + count + i) % n for i in range(n - count)}
        ctx.wait(req, src, "the collective header", missing)
        known += incoming
        count += take
        distance *= 2
    headers = [b""] * n
    for i in range(n):
        headers[(me + i) % n] = bytes(known[i * HEADER_SIZE:(i + 1) * HEADER_SIZE])
    check_all(ctx.name, me, headers)


# ----------------------------------------------------------------------------- helpers
def chunk_bounds(numel: int, n: int) -> tuple[tuple[int, int], ...]:
    """n contiguous chunks by ferro's one split rule (the first ``numel % n`` get one extra)."""
    return split_bounds(numel, n)


# ----------------------------------------------------------------------------- allreduce
def _reduce_at_root(ctx: Ctx, buf: np.ndarray, op: ReduceOp, tag: int) -> None:
    """Rank 0 folds every rank's contribution into ``buf`` in rank order (MEAN fused last)."""
    n = ctx.n
    mean = n if op is ReduceOp.MEAN else None
    parts = [np.empty_like(buf) for _ in range(n - 1)]
    reqs = [ctx.irecv(parts[r - 1], r, tag) for r in range(1, n)]
    for r in range(1, n):
        ctx.wait(reqs[r - 1], r, "its contribution",
                 {q for q in range(r, n) if not reqs[q - 1].is_completed()})
        accumulate(buf, parts[r - 1], op, mean if r == n - 1 else None)


def allreduce_star(ctx: Ctx, buf: np.ndarray, op: ReduceOp) -> None:
    n, me = ctx.n, ctx.rank
    tag_up, tag_down = ctx.next_tag(), ctx.next_tag()
    if me == 0:
        _reduce_at_root(ctx, buf, op, tag_up)
        for r in range(1, n):
            ctx.send(buf, r, tag_down)
    else:
        req = ctx.irecv(buf, 0, tag_down)
        ctx.send(buf.copy(), 0, tag_up)
        ctx.wait(req, 0, "the result")


def reduce_scatter_ring_into(ctx: Ctx, buf: np.ndarray, op: ReduceOp,
                             bounds: Sequence[tuple[int, int]], mean: int | None) -> int:
    """Ring reduce-scatter in place; returns the chunk index this rank owns (fully reduced).

    At step s rank r sends chunk (r - s - 1) mod n and folds chunk (r - s - 2) mod n; after n-1
    steps rank r owns chunk r. The MEAN divide is fused into the last fold.
    """
    n, me = ctx.n, ctx.rank
    right, left = (me + 1) % n, (me - 1) % n
    largest = max(e - s for s, e in bounds)
    scratch = np.empty(largest, dtype=buf.dtype)
    for s in range(n - 1):
        send_c = (me - s - 1) % n
        recv_c = (me - s - 2) % n
        rs, re = bounds[recv_c]
        incoming = scratch[: re - rs]
        tag = ctx.next_tag()
        req = ctx.irecv(incoming, left, tag)
        ss, se = bounds[send_c]
        ctx.send(buf[ss:se], right, tag)
        ctx.wait(req, left, f"chunk {recv_c} (reduce-scatter step {s})")
        accumulate(buf[rs:re], incoming, op, mean if s == n - 2 else None)
    return me


def all_gather_ring_into(ctx: Ctx, buf: np.ndarray, bounds: Sequence[tuple[int, int]],
                         owned: int) -> None:
    """Ring all-gather in place: rank r starts with chunk ``owned`` filled, ends with all."""
    n, me = ctx.n, ctx.rank
    right, left = (me + 1) % n, (me - 1) % n
    for s in range(n - 1):
        send_c = (owned - s) % n
        recv_c = (owned - s - 1) % n
        tag = ctx.next_tag()
        rs, re = bounds[recv_c]
        req = ctx.irecv(buf[rs:re], left, tag)
        ss, se = bounds[send_c]
        ctx.send(buf[ss:se], right, tag)
        ctx.wait(req, left, f"chunk {recv_c} (all-gather step {s})")


def allreduce_ring(ctx: Ctx, buf: np.ndarray, op: ReduceOp) -> None:
    bounds = chunk_bounds(buf.size, ctx.n)
    mean = ctx.n if op is ReduceOp.MEAN else None
    owned = reduce_scatter_ring_into(ctx, buf, op, bounds, mean)
    all_gather_ring_into(ctx, buf, bounds, owned)


def allreduce_recursive_doubling(ctx: Ctx, buf: np.ndarray, op: ReduceOp) -> None:
    n, me = ctx.n, ctx.rank
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    mean = n if op is ReduceOp.MEAN else None
    tag_fold, tag_unfold = ctx.next_tag(), ctx.next_tag()
    if me >= p:  # fold into partner me - p, wait for the result
        req = ctx.irecv(buf, me - p, tag_unfold)
        ctx.send(buf.copy(), me - p, tag_fold)
        ctx.wait(req, me - p, "the result")
        return
    incoming = np.empty_like(buf)
    if me + p < n:
        req = ctx.irecv(incoming, me + p, tag_fold)
        ctx.wait(req, me + p, "its contribution")
        accumulate(buf, incoming, op)
    distance = 1
    while distance < p:
        partner = me ^ distance
        tag = ctx.next_tag()
        req = ctx.irecv(incoming, partner, tag)
        ctx.send(buf, partner, tag)
        ctx.wait(req, partner, f"the round-{distance.bit_length()} partial result")
        last = distance * 2 >= p
        # Combine lower-rank operand first on both partners: identical bits on both sides.
        if partner < me:  # the partner's data is the lower operand: fold into it, copy back
            accumulate(incoming, buf, op, mean if last else None)
            buf[...] = incoming
        else:
            accumulate(buf, incoming, op, mean if last else None)
        distance *= 2
    if me + p < n:
        ctx.send(buf, me + p, tag_unfold)


# ----------------------------------------------------------------------------- all_gather
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


# ----------------------------------------------------------------------------- reduce_scatter
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
        _reduce_at_root(ctx, buf, op, tag_up)
        for r in range(1, n):
            ctx.send(buf[r * size:(r + 1) * size], r, tag_down)
        return buf[:size]
    out = np.empty(size, dtype=buf.dtype)
    req = ctx.irecv(out, 0, tag_down)
    ctx.send(buf, 0, tag_up)
    ctx.wait(req, 0, "its reduced chunk")
    return out


# ----------------------------------------------------------------------------- broadcast
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
