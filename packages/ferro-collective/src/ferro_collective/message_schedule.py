"""The message schedules of the point-to-point algorithms, on the alpha-beta model's links.

:class:`Schedule` keeps each rank's clock and the time its interface is free, as the simulated
network (``ferro_backend.netsim``) keeps them; :func:`run` plays one flat algorithm's messages
on it (or on a :class:`View` of a subgroup: a hierarchical stage), :func:`header_rounds` the
header exchange every collective starts with. :mod:`.costmodel` turns the clocks into times.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .header import HEADER_SIZE

if TYPE_CHECKING:
    from .costparams import Params


def _cost(p: Params, src: int, dst: int, nbytes: float) -> tuple[float, float]:
    """(latency, seconds on the sender's interface) of one message ``src -> dst``."""
    same = p.intra_alpha is not None and p.node(src) == p.node(dst)
    a, b = p.link(not same)
    return a, nbytes / b


class Schedule:
    """Each rank's clock and the time its interface is free, as the simulated network keeps
    them: a send leaves at ``max(clock, interface free)``, occupies the interface for its bytes
    over the bandwidth and arrives a latency later; a receive moves the clock to the arrival."""

    def __init__(self, p: Params, clock: list[float]) -> None:
        self.p, self.clock, self.nic = p, clock[:], clock[:]
        #: ``p.shared_link``: when each node's link is next free, leaving and entering, and
        #: its token bucket (``p.burst``) as (bytes, at time)
        self.out: dict[int, float] = {}
        self.into: dict[int, float] = {}
        self.tokens: dict[tuple[str, int], tuple[float, float]] = {}

    def send(self, src: int, dst: int, nbytes: float) -> float:
        lat, busy = _cost(self.p, src, dst, nbytes)
        sn, dn = self.p.node(src), self.p.node(dst)
        if self.p.shared_link and sn != dn:
            # one link per node: a message waits for the node's earlier ones to leave, and
            # for those entering the receiver's node (in the order this schedule sends them)
            start = max(self.clock[src], self.nic[src], self.out.get(sn, 0.0))
            leave = start + self._shaped("out", sn, start, nbytes, busy)
            self.nic[src] = self.out[sn] = leave
            start_in = max(start, self.into.get(dn, 0.0))
            enter = max(leave, start_in + self._shaped("in", dn, start_in, nbytes, busy))
            self.into[dn] = enter
            return enter + lat
        self.nic[src] = max(self.clock[src], self.nic[src]) + busy
        return self.nic[src] + lat

    def _shaped(self, way: str, node: int, start: float, nbytes: float, busy: float) -> float:
        """Seconds ``nbytes`` occupy a node's link from ``start`` (``busy`` at the link's
        rate): the bytes its token bucket holds pass at once, the rest at the rate. The bucket
        is full at a link's first message and refills at the rate while the link rests."""
        burst = self.p.burst
        if burst <= 0 or nbytes <= 0:
            return busy
        have, since = self.tokens.get((way, node), (burst, start))
        have = min(burst, have + (start - since) * self.p.beta)
        used = min(have, nbytes)
        busy *= (nbytes - used) / nbytes
        self.tokens[way, node] = (have - used, start + busy)
        return busy

    def rounds(self, rounds, fold: bool = False) -> None:
        """Rounds in which every rank sends one message, then waits for one: ``rounds`` yields
        ``(dst_of, nbytes)``; ``dst_of(me)`` is the rank ``me`` sends to (None: sits out).
        ``fold``: the receiver then reduces what it got into its buffer (``gamma`` per byte)."""
        n = len(self.clock)
        for dst_of, nbytes in rounds:
            arrivals = [None] * n
            for me in range(n):
                dst = dst_of(me)
                if dst is not None:
                    arrivals[dst] = max(arrivals[dst] or 0.0, self.send(me, dst, nbytes))
            work = self.p.fold(nbytes) if fold else 0.0
            self.clock = [c if a is None else max(c, a) + work
                          for c, a in zip(self.clock, arrivals)]


class Clocks:
    """A group's clocks as a list indexed by local rank, stored in the whole job's schedule."""

    def __init__(self, s: Schedule, members: tuple[int, ...]) -> None:
        self.s, self.members = s, members

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, i: int) -> float:
        return self.s.clock[self.members[i]]

    def __setitem__(self, i: int, value: float) -> None:
        self.s.clock[self.members[i]] = value

    def __iter__(self):
        return (self.s.clock[m] for m in self.members)


class View(Schedule):
    """A subgroup of a job's :class:`Schedule` (local rank ``i`` is global ``members[i]``):
    the algorithms run on it as on a schedule of their own, their messages charged to the
    global ranks' links and interfaces (as a SubBackend's are by the simulated network)."""

    def __init__(self, s: Schedule, members) -> None:  # not Schedule.__init__: no clocks of its own
        self.s, self.p, self.members = s, s.p, tuple(members)

    @property
    def clock(self) -> Clocks:
        return Clocks(self.s, self.members)

    @clock.setter
    def clock(self, values) -> None:
        for m, v in zip(self.members, list(values)):
            self.s.clock[m] = v

    def send(self, src: int, dst: int, nbytes: float) -> float:
        return self.s.send(self.members[src], self.members[dst], nbytes)


def header_rounds(n: int, unit: int = HEADER_SIZE, extra: int = 0) -> list:
    """Bruck's all-gather of the headers: round ``k`` (distance ``d = 2^k``), rank ``me``
    sends ``min(d, n - count)`` headers to ``me - d`` (``unit``: each with a small call's
    data before it, :mod:`.gathered`; ``extra``: bytes each message carries besides, a
    broadcast's data on the ranks it passes, counted in every message)."""
    rounds, count, d = [], 1, 1
    while count < n:
        take = min(d, n - count)
        rounds.append((lambda me, d=d: (me - d) % n, take * unit + extra))
        count += take
        d *= 2
    return rounds


def header_clocks(p: Params, n: int) -> list[float]:
    s = Schedule(p, [0.0] * n)
    View(s, p.node_major(n) or range(n)).rounds(header_rounds(n))  # (node by node: .gathered)
    return s.clock


def header_time(p: Params, n: int) -> float:
    """The header exchange every collective starts with (mismatch detection)."""
    return max(header_clocks(p, n)) if n > 1 else 0.0


#: from this many ranks a ring's rounds run as array arithmetic (:func:`_ring_rounds`)
RING_ARRAYS_FROM = 16


def _ring(s: Schedule, steps: int, nbytes: float, folds: int = 0) -> None:
    """``steps`` ring steps, the first ``folds`` of them reducing what arrives."""
    n = len(s.clock)
    if n >= RING_ARRAYS_FROM and type(s) is Schedule and not s.p.shared_link:
        _ring_rounds(s, folds, nbytes, True)
        _ring_rounds(s, steps - folds, nbytes, False)
        return
    s.rounds([(lambda me: (me + 1) % n, nbytes)] * folds, fold=True)
    s.rounds([(lambda me: (me + 1) % n, nbytes)] * (steps - folds))


def _ring_rounds(s: Schedule, count: int, nbytes: float, fold: bool) -> None:
    """``count`` rounds of :meth:`Schedule.rounds` in which rank ``me`` sends to ``me + 1``,
    as array arithmetic: each element goes through the same float operations in the same
    order (so the times are equal to the bit), in O(n) array steps per round instead of n
    Python calls (a 256-rank allreduce: 130,000 calls)."""
    if count <= 0:
        return
    n = len(s.clock)
    lat = np.empty(n)
    busy = np.empty(n)
    for me in range(n):
        lat[me], busy[me] = _cost(s.p, me, (me + 1) % n, nbytes)
    clock, nic = np.array(s.clock, np.float64), np.array(s.nic, np.float64)
    work = s.p.fold(nbytes) if fold else 0.0
    for _ in range(count):
        nic = np.maximum(clock, nic) + busy
        clock = np.maximum(clock, np.roll(nic + lat, 1)) + work
    s.clock, s.nic = clock.tolist(), nic.tolist()


def _recursive_doubling(s: Schedule, nbytes: float) -> None:
    n = len(s.clock)
    q = 1 << (n.bit_length() - 1)
    for me in range(q, n):  # fold into me - q
        s.clock[me - q] = max(s.clock[me - q], s.send(me, me - q, nbytes)) \
            + s.p.fold(nbytes)
    d = 1
    while d < q:
        s.rounds([(lambda me, d=d: (me ^ d) if me < q else None, nbytes)], fold=True)
        d *= 2
    for me in range(q, n):  # the result back
        s.clock[me] = max(s.clock[me], s.send(me - q, me, nbytes))


def _gather_to_root(s: Schedule, nbytes: float, fold: bool = False) -> None:
    n = len(s.clock)
    for r in range(1, n):
        s.clock[0] = max(s.clock[0], s.send(r, 0, nbytes))
    if fold:
        s.clock[0] += s.p.fold(nbytes) * (n - 1)


def _from_root(s: Schedule, nbytes: float) -> None:
    for r in range(1, len(s.clock)):
        s.clock[r] = max(s.clock[r], s.send(0, r, nbytes))


def _tree(s: Schedule, nbytes: float) -> None:
    """Binomial tree from rank 0: ``v`` gets the data from ``v - m`` (``m`` its lowest set
    bit), then sends to ``v + m'`` for every ``m' < m``, largest first."""
    n = len(s.clock)
    top = 1 << max(0, (n - 1).bit_length() - 1)
    for v in range(n):  # parents come before their children
        mask = top if v == 0 else (v & -v) >> 1
        while mask:
            if v + mask < n:
                s.clock[v + mask] = max(s.clock[v + mask], s.send(v, v + mask, nbytes))
            mask >>= 1


def run(s: Schedule, name: str, algorithm: str, nbytes: float) -> None:
    """One flat algorithm's messages on ``s`` (a schedule or a group's view of one)."""
    n = len(s.clock)
    if n <= 1 or nbytes <= 0:
        return  # nothing to send (the calls skip the algorithm for an empty buffer)
    chunk = math.ceil(nbytes / n)
    if name == "allreduce" and algorithm == "ring":
        _ring(s, 2 * (n - 1), chunk, folds=n - 1)
    elif name == "allreduce" and algorithm == "recursive_doubling":
        _recursive_doubling(s, nbytes)
    elif name == "allreduce" and algorithm == "star":
        _gather_to_root(s, nbytes, fold=True)
        _from_root(s, nbytes)
    elif name == "broadcast" and algorithm == "tree":
        _tree(s, nbytes)
    elif name == "broadcast" and algorithm == "star":
        _from_root(s, nbytes)
    elif name == "all_gather" and algorithm == "ring":
        _ring(s, n - 1, nbytes)
    elif name == "reduce_scatter" and algorithm == "ring":
        _ring(s, n - 1, chunk, folds=n - 1)
    else:
        raise ValueError(f"costmodel: no model for {name} {algorithm!r}")


__all__ = ["Clocks", "Schedule", "View", "header_clocks", "header_rounds", "header_time", "run"]
