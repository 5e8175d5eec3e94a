"""An alpha-beta cost model of every point-to-point algorithm of the collectives.

A message of ``b`` bytes on a link costs ``alpha + b / beta`` (latency, bandwidth); a rank's
interface sends one message at a time; ranks on one node (``ranks_per_node`` consecutive ranks)
use the faster intra-node link, and a step in which any message crosses nodes costs what the
slower link costs (the steps of a ring or a tree wait for their slowest message). Local work
(copies, reductions) is left out: :class:`ferro_backend.netsim.Network`'s virtual time counts
the same, and the tests hold the model to the simulated network within 10% at 8-256 ranks.

Every collective first exchanges its header (mismatch detection, Bruck's all-gather:
``ceil(log2 n)`` rounds of growing blocks of ``HEADER_SIZE`` bytes); the model includes it.

:func:`predict` gives one algorithm's time, :func:`best` the fastest; :func:`choose_auto` is
what ``algorithm="auto"`` uses beyond the few ranks the fixed thresholds were measured on.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass

from .header import HEADER_SIZE


@dataclass(frozen=True)
class Params:
    """``alpha`` seconds and ``beta`` bytes/s between nodes; ``intra_alpha``/``intra_beta``
    within a node of ``ranks_per_node`` consecutive ranks (None: one link kind); ``gamma``
    seconds per byte a rank folds into its buffer (the reduction kernel; 0: free, as in the
    simulated network)."""

    alpha: float
    beta: float
    intra_alpha: float | None = None
    intra_beta: float | None = None
    ranks_per_node: int = 1
    gamma: float = 0.0

    @classmethod
    def of(cls, network) -> Params:
        """The parameters of a :class:`ferro_backend.netsim.Network`."""
        intra = network.intra
        return cls(network.inter.latency, network.inter.bandwidth,
                   intra.latency if intra is not None else None,
                   intra.bandwidth if intra is not None else None, network.ranks_per_node)

    def link(self, crosses: bool) -> tuple[float, float]:
        if crosses or self.intra_alpha is None:
            return self.alpha, self.beta
        return self.intra_alpha, self.intra_beta

    def msg(self, nbytes: float, crosses: bool) -> float:
        a, b = self.link(crosses)
        return a + nbytes / b


#: a 25 Gb/s, 5 us cluster of 16-rank nodes with a 10 GB/s, 0.5 us shared-memory link: what
#: "auto" assumes beyond the sizes its thresholds were measured at
DEFAULT = Params(5e-6, 25e9 / 8, 0.5e-6, 10e9, 16)


def params_for(backend) -> Params:
    """The link parameters "auto" plans with on ``backend``: its modelled network when it is a
    :class:`~ferro_backend.SimulatedBackend` made with one; else :data:`DEFAULT`'s links with the
    backend's node layout (``backend.nodes``: consecutive ranks per node, the same number on
    each), or every link between nodes when the layout is unknown or irregular."""
    network = getattr(backend, "network", None)
    if network is not None:
        return Params.of(network)
    nodes = getattr(backend, "nodes", None)
    if nodes:
        runs = [len(list(g)) for _, g in itertools.groupby(nodes)]
        if len(set(runs)) == 1 and len(runs) == len(set(nodes)):
            return dataclasses.replace(DEFAULT, ranks_per_node=runs[0])
    return Params(DEFAULT.alpha, DEFAULT.beta)


ALGORITHMS_MODELLED = {
    "allreduce": ("ring", "recursive_doubling", "star"),
    "broadcast": ("tree", "star"),
    "all_gather": ("ring",),
    "reduce_scatter": ("ring",),
}


def _cost(p: Params, src: int, dst: int, nbytes: float) -> tuple[float, float]:
    """(latency, seconds on the sender's interface) of one message ``src -> dst``."""
    L = p.ranks_per_node if p.intra_alpha is not None else 0
    same = L > 0 and src // L == dst // L
    a, b = p.link(not same)
    return a, nbytes / b


class _Schedule:
    """Each rank's clock and the time its interface is free, as the simulated network keeps
    them: a send leaves at ``max(clock, interface free)``, occupies the interface for its bytes
    over the bandwidth and arrives a latency later; a receive moves the clock to the arrival."""

    def __init__(self, p: Params, clock: list[float]) -> None:
        self.p, self.clock, self.nic = p, clock[:], clock[:]

    def send(self, src: int, dst: int, nbytes: float) -> float:
        lat, busy = _cost(self.p, src, dst, nbytes)
        self.nic[src] = max(self.clock[src], self.nic[src]) + busy
        return self.nic[src] + lat

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
            work = self.p.gamma * nbytes if fold else 0.0
            self.clock = [c if a is None else max(c, a) + work
                          for c, a in zip(self.clock, arrivals)]


def _header(p: Params, n: int) -> list[float]:
    """Bruck's all-gather of the headers: round ``k`` (distance ``d = 2^k``), rank ``me``
    sends ``min(d, n - count)`` headers to ``me - d``."""
    rounds, count, d = [], 1, 1
    while count < n:
        take = min(d, n - count)
        rounds.append((lambda me, d=d: (me - d) % n, take * HEADER_SIZE))
        count += take
        d *= 2
    s = _Schedule(p, [0.0] * n)
    s.rounds(rounds)
    return s.clock


def header_time(p: Params, n: int) -> float:
    """The header exchange every collective starts with (mismatch detection)."""
    return max(_header(p, n)) if n > 1 else 0.0


def _ring(s: _Schedule, steps: int, nbytes: float, folds: int = 0) -> None:
    """``steps`` ring steps, the first ``folds`` of them reducing what arrives."""
    n = len(s.clock)
    s.rounds([(lambda me: (me + 1) % n, nbytes)] * folds, fold=True)
    s.rounds([(lambda me: (me + 1) % n, nbytes)] * (steps - folds))


def _recursive_doubling(s: _Schedule, nbytes: float) -> None:
    n = len(s.clock)
    q = 1 << (n.bit_length() - 1)
    for me in range(q, n):  # fold into me - q
        s.clock[me - q] = max(s.clock[me - q], s.send(me, me - q, nbytes)) \
            + s.p.gamma * nbytes
    d = 1
    while d < q:
        s.rounds([(lambda me, d=d: (me ^ d) if me < q else None, nbytes)], fold=True)
        d *= 2
    for me in range(q, n):  # the result back
        s.clock[me] = max(s.clock[me], s.send(me - q, me, nbytes))


def _gather_to_root(s: _Schedule, nbytes: float, fold: bool = False) -> None:
    n = len(s.clock)
    for r in range(1, n):
        s.clock[0] = max(s.clock[0], s.send(r, 0, nbytes))
    if fold:
        s.clock[0] += s.p.gamma * nbytes * (n - 1)


def _from_root(s: _Schedule, nbytes: float) -> None:
    for r in range(1, len(s.clock)):
        s.clock[r] = max(s.clock[r], s.send(0, r, nbytes))


def _tree(s: _Schedule, nbytes: float) -> None:
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


@functools.lru_cache(maxsize=4096)
def predict(name: str, algorithm: str, nbytes: int, n: int, p: Params = DEFAULT,
            *, header: bool = True) -> float:
    """Seconds for ``name`` with ``algorithm`` on ``n`` ranks, ``nbytes`` per rank (the
    input: the whole buffer for allreduce/broadcast/reduce_scatter, the block for all_gather),
    from the algorithm's message schedule on ``p``'s links."""
    if n <= 1:
        return 0.0
    s = _Schedule(p, _header(p, n) if header else [0.0] * n)
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
    return max(s.clock)


def best(name: str, nbytes: int, n: int, p: Params = DEFAULT) -> tuple[str, float]:
    """The modelled fastest algorithm and its time (ties: the first listed)."""
    times = [(predict(name, a, nbytes, n, p), i, a)
             for i, a in enumerate(ALGORITHMS_MODELLED[name])]
    t, _, a = min(times)
    return a, t


@functools.lru_cache(maxsize=1024)
def _auto(name: str, bucket: int, n: int, p: Params) -> str:
    return best(name, bucket, n, p)[0]


def choose_auto(name: str, nbytes: int, n: int, p: Params = DEFAULT) -> str:
    """``algorithm="auto"`` beyond 4 ranks: the model's best for this world size and the size
    rounded up to a power of two (so one size always gets one algorithm, and the model runs
    once per size class)."""
    bucket = 1 << max(0, int(nbytes) - 1).bit_length()
    return _auto(name, bucket, n, p)


__all__ = ["ALGORITHMS_MODELLED", "DEFAULT", "Params", "best", "choose_auto", "header_time",
           "params_for", "predict"]
