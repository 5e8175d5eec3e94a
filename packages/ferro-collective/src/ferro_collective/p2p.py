"""The building blocks of the collectives over point-to-point messages.

- :class:`Ctx`: one call's backend, tags, deadlines and names for its errors and stall reports;
- :func:`bruck_all_gather`: every rank's fixed-size block, in ``ceil(log2 n)`` rounds; the
  mismatch header's exchange (:func:`header_exchange`, which is also the barrier; on two ranks
  one message each way, :mod:`.pair`, which some calls send their data with) and the metadata
  round of the collectives whose sizes only some ranks know run on it;
- the two phases of the ring (:func:`reduce_scatter_ring_into`, :func:`all_gather_ring_into`),
  shared by allreduce, reduce_scatter, all_gather and reduce, and the star's rank-order fold at
  rank 0 (:func:`fold_at_root`), shared by allreduce and reduce_scatter.

Every algorithm fixes the order in which values are combined, and the final values of a chunk
are computed once (by its owner) and copied to everyone, so every rank returns the same bits,
and the same inputs give the same bits run after run. Each step posts its receive before
sending, so transports deliver straight into the destination.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from ferro_backend import CollectiveTimeoutError, PeerClosedError
from ferro_backend.partition import split_bounds

from . import costmodel, gathered, pair
from .header import HEADER_SIZE
from .ops import ReduceOp, accumulate
from .per_backend import STEPS_PER_CALL
from .scratch import POOL

log = logging.getLogger("ferro_collective")

#: fraction of the timeout after which a waiting collective logs a stall report
STALL_FRACTION = 0.5
#: a header exchange's missing ranks are those whose headers have not come, directly or
#: relayed (Bruck's rounds): one absent rank holds back the others it would have relayed
_RELAYED = (" (headers come directly or relayed by another rank, so one absent rank holds "
            "back the ones it relays: the absent one is among these)")


def set_stall_report(fraction: float) -> None:
    """Log a stall report once a collective has waited ``fraction`` of its timeout (0 < f <= 1).

    Parameters
    ----------
    fraction : float
        The share of the timeout after which a waiting collective logs what it waits for.

    Raises
    ------
    ValueError
        ``fraction`` is not in ``(0, 1]``.
    """
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
        self._borrowed: list[np.ndarray] = []
        self._order: tuple[int, ...] | None | bool = False

    @property
    def order(self) -> tuple[int, ...] | None:
        """The order in which the header exchange's rounds number the ranks (node by node,
        :func:`.costmodel.node_major`); None: rank order."""
        if self._order is False:
            self._order = costmodel.node_major(self.backend, self.n)
        return self._order

    def take(self, count: int, dtype) -> np.ndarray:
        """A 1-d working array of ``count`` items (contents undefined), borrowed from the
        scratch pool (:mod:`.scratch`) until :meth:`release`."""
        arr = POOL.take(count, dtype)
        self._borrowed.append(arr)
        return arr

    def copy(self, buf: np.ndarray) -> np.ndarray:
        """A borrowed copy of ``buf`` (1-d)."""
        mine = self.take(buf.size, buf.dtype)
        mine[...] = buf
        return mine

    def release(self) -> None:
        """Give the call's working arrays back to the pool, once the call has succeeded (after
        a failure a receive posted into one may still land: they are not given back)."""
        if self._borrowed:
            POOL.give(*self._borrowed)
            self._borrowed.clear()

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

    def name_failure(self, exc: PeerClosedError) -> None:
        """Name this call in ``exc``'s message (the transport's names only its own operation,
        ``recv`` or ``send``, and the two ranks), keeping its type and attributes."""
        prefix = f"{self.name} (seq {self.seq}) on rank {self.rank}"
        if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith(prefix):
            exc.args = (f"{prefix}: {exc.args[0]}",) + exc.args[1:]

    def wait(self, req, src: int, what: str, missing=None) -> None:
        """Wait for ``req`` from ``src``: a stall report at the soft deadline, then the error."""
        if not self.reported:
            if req.poll(max(0.0, self.soft_deadline - time.monotonic())):
                req.wait(0.0)  # (done: returns, or raises how it failed, as a wrong size)
                return
            self.reported = True
            waiting = sorted(missing) if missing is not None else [src]
            log.warning("%s (seq %d) on rank %d: still waiting for %s from rank %d after %.1fs; "
                        "ranks not heard from yet: %s", self.name, self.seq, self.rank, what, src,
                        time.monotonic() - self.start, waiting)
        remaining = self.deadline - time.monotonic()
        try:
            req.wait(max(remaining, 0.0))
        except CollectiveTimeoutError:
            waiting = sorted(missing) if missing is not None else [src]
            raise CollectiveTimeoutError(
                f"{self.name} (seq {self.seq}) on rank {self.rank}: timed out after "
                f"{self.timeout:g}s waiting for {what} from rank {src}; ranks not heard from "
                f"yet: {waiting}{_RELAYED if missing is not None and len(waiting) > 1 else ''}"
            ) from None


# ----------------------------------------------------------------------------- Bruck
def bruck_all_gather(ctx: Ctx, block: bytes, tag: int, what: str) -> list[bytes]:
    """Every rank's ``block`` (all of one length), in rank order: Bruck's all-gather."""
    n, me, size = ctx.n, ctx.rank, len(block)
    known = bytearray(block)  # blocks of ranks me, me+1, ..., me+count-1 (mod n)
    count, distance = 1, 1
    while count < n:
        take = min(distance, n - count)
        src, dst = (me + distance) % n, (me - distance) % n
        incoming = bytearray(take * size)
        req = ctx.backend.irecv(incoming, src, tag=tag)
        # the receiver (me - distance) knows as many blocks as we do and takes the next `take`
        ctx.send(bytes(known[: take * size]), dst, tag)
        ctx.wait(req, src, what, {(me + count + i) % n for i in range(n - count)})
        known += incoming
        count += take
        distance *= 2
    blocks = [b""] * n
    for i in range(n):
        blocks[(me + i) % n] = bytes(known[i * size:(i + 1) * size])
    return blocks


def header_exchange(ctx: Ctx, header: bytes) -> list[bytes]:
    """Bruck all-gather of every rank's header (on the call's first tag); raises
    CollectiveMismatchError on every rank when they disagree (a rank whose call takes fewer
    sequence numbers than a peer's catching up first: :func:`.per_backend.check_headers`), else
    returns them in rank order. Doubles as the barrier: nobody leaves before every rank has
    arrived."""
    assert len(header) == HEADER_SIZE
    if ctx.n == 2:  # (the message a call of two ranks may send its data with: :mod:`.pair`)
        return pair.header_exchange(ctx, header)
    return gathered.header_exchange(ctx, header)  # (the rounds small calls send data in)


# ----------------------------------------------------------------------------- ring and star
#: a ring step's chunk travels in segments of at least SEGMENT_BYTES, at most MAX_SEGMENTS of
#: them: segment g of step s + 1 leaves as soon as segment g of step s has arrived (and been
#: folded), so the folds and each step's wait overlap the link instead of adding to it
#: (benchmarks/emulated.py: the 4-node ring of 64 MiB on 1 Gbit/s links)
SEGMENT_BYTES = 128 << 10
MAX_SEGMENTS = 8


def ring_segments(n: int, largest_bytes: int) -> int:
    """How many segments each ring step's chunk travels in (every rank computes the same from
    the largest chunk): within the call's tags for the 2 (n - 1) steps of an allreduce."""
    budget = (STEPS_PER_CALL - 64) // (2 * max(1, n - 1))
    return max(1, min(MAX_SEGMENTS, largest_bytes // SEGMENT_BYTES, budget))


def _ring(ctx: Ctx, buf: np.ndarray, bounds: Sequence[tuple[int, int]], first: int,
          op: ReduceOp | None, mean: int | None, what: str) -> None:
    """``n - 1`` ring steps: at step s this rank sends chunk ``first - s`` to the right and
    receives chunk ``first - s - 1`` from the left (the one it sends at step s + 1), in place,
    or, with ``op``, through scratch and folded into ``buf`` (MEAN's divide in the last
    step). Segmented (:func:`ring_segments`); every step's receives are posted before the
    previous step's segments are waited for, so they land straight in their destination."""
    n, steps = ctx.n, ctx.n - 1
    if steps < 1:
        return
    right, left = (ctx.rank + 1) % n, (ctx.rank - 1) % n
    largest = max(e - s for s, e in bounds)
    count = ring_segments(n, largest * buf.itemsize)
    segs = [[(s + a, s + b) for a, b in split_bounds(e - s, count)] for s, e in bounds]
    tags = [[ctx.next_tag() for _ in range(count)] for _ in range(steps)]
    scratch = [ctx.take(largest, buf.dtype) for _ in range(min(2, steps))] if op else []

    def post(s: int) -> list:
        c = (first - s - 1) % n
        base = bounds[c][0]
        return [None if a == b else
                ctx.irecv(scratch[s % 2][a - base:b - base] if op else buf[a:b], left,
                          tags[s][g])
                for g, (a, b) in enumerate(segs[c])]

    def send(s: int, g: int) -> None:
        a, b = segs[(first - s) % n][g]
        if a < b:
            ctx.send(buf[a:b], right, tags[s][g])

    reqs = post(0)
    for g in range(count):
        send(0, g)
    for s in range(steps):
        following = post(s + 1) if s + 1 < steps else None
        c = (first - s - 1) % n
        base = bounds[c][0]
        for g, req in enumerate(reqs):
            if req is not None:
                ctx.wait(req, left, f"chunk {c} ({what} step {s})")
                if op is not None:
                    a, b = segs[c][g]
                    accumulate(buf[a:b], scratch[s % 2][a - base:b - base], op,
                               mean if s == steps - 1 else None)
            if following is not None:
                send(s + 1, g)
        reqs = following


def reduce_scatter_ring_into(ctx: Ctx, buf: np.ndarray, op: ReduceOp,
                             bounds: Sequence[tuple[int, int]], mean: int | None) -> int:
    """Ring reduce-scatter in place; returns the chunk index this rank owns (fully reduced).

    At step s rank r sends chunk (r - s - 1) mod n and folds chunk (r - s - 2) mod n; after n-1
    steps rank r owns chunk r. The MEAN divide is fused into the last fold.
    """
    _ring(ctx, buf, bounds, ctx.rank - 1, op, mean, "reduce-scatter")
    return ctx.rank


def all_gather_ring_into(ctx: Ctx, buf: np.ndarray, bounds: Sequence[tuple[int, int]],
                         owned: int) -> None:
    """Ring all-gather in place: rank r starts with chunk ``owned`` filled, ends with all."""
    _ring(ctx, buf, bounds, owned, None, None, "all-gather")


def fold_at_root(ctx: Ctx, buf: np.ndarray, op: ReduceOp, tag: int) -> None:
    """Rank 0 folds every rank's contribution into ``buf`` in rank order (MEAN fused last)."""
    n = ctx.n
    mean = n if op is ReduceOp.MEAN else None
    parts = [ctx.take(buf.size, buf.dtype).reshape(buf.shape) for _ in range(n - 1)]
    reqs = [ctx.irecv(parts[r - 1], r, tag) for r in range(1, n)]
    for r in range(1, n):
        ctx.wait(reqs[r - 1], r, "its contribution",
                 {q for q in range(r, n) if not reqs[q - 1].is_completed()})
        accumulate(buf, parts[r - 1], op, mean if r == n - 1 else None)


__all__ = ["MAX_SEGMENTS", "SEGMENT_BYTES", "STALL_FRACTION", "Ctx", "all_gather_ring_into",
           "bruck_all_gather", "fold_at_root", "header_exchange", "reduce_scatter_ring_into",
           "ring_segments", "set_stall_report"]
