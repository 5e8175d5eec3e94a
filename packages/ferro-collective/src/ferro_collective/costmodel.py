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

Several nodes: ``predict(name, "hierarchical", ...)`` composes the stages of
:mod:`ferro_collective.hierarchical` (node stage, cross stages of every local index at once,
node stage; each with its header exchange and auto's algorithm for its group and links) on one
schedule of the job's ranks, as a simulated hierarchy runs them
(``SimulatedBackend.create_group(..., hierarchical=True)``), and :func:`choose_hierarchical`
is how "auto" decides between them and the flat algorithm on a backend with a node layout.
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
    simulated network); ``call`` seconds every call costs each rank outside its messages
    (argument checks, buffers, the Python around them: fitted to real runs by
    ``benchmarks/scale_validate.py``; 0 on the simulated network)."""

    alpha: float
    beta: float
    intra_alpha: float | None = None
    intra_beta: float | None = None
    ranks_per_node: int = 1
    gamma: float = 0.0
    call: float = 0.0

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
    params = getattr(backend, "params", None)
    if isinstance(params, Params):  # a stand-in the model plans with (flat_time)
        return params
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


class _Clocks:
    """A group's clocks as a list indexed by local rank, stored in the whole job's schedule."""

    def __init__(self, s: _Schedule, members: tuple[int, ...]) -> None:
        self.s, self.members = s, members

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, i: int) -> float:
        return self.s.clock[self.members[i]]

    def __setitem__(self, i: int, value: float) -> None:
        self.s.clock[self.members[i]] = value

    def __iter__(self):
        return (self.s.clock[m] for m in self.members)


class _View(_Schedule):
    """A subgroup of a job's :class:`_Schedule` (local rank ``i`` is global ``members[i]``):
    the algorithms run on it as on a schedule of their own, their messages charged to the
    global ranks' links and interfaces (as a SubBackend's are by the simulated network)."""

    def __init__(self, s: _Schedule, members) -> None:  # not _Schedule.__init__: no clocks of its own
        self.s, self.p, self.members = s, s.p, tuple(members)

    @property
    def clock(self) -> _Clocks:
        return _Clocks(self.s, self.members)

    @clock.setter
    def clock(self, values) -> None:
        for m, v in zip(self.members, list(values)):
            self.s.clock[m] = v

    def send(self, src: int, dst: int, nbytes: float) -> float:
        return self.s.send(self.members[src], self.members[dst], nbytes)


def _header_rounds(n: int) -> list:
    """Bruck's all-gather of the headers: round ``k`` (distance ``d = 2^k``), rank ``me``
    sends ``min(d, n - count)`` headers to ``me - d``."""
    rounds, count, d = [], 1, 1
    while count < n:
        take = min(d, n - count)
        rounds.append((lambda me, d=d: (me - d) % n, take * HEADER_SIZE))
        count += take
        d *= 2
    return rounds


def _header(p: Params, n: int) -> list[float]:
    s = _Schedule(p, [0.0] * n)
    s.rounds(_header_rounds(n))
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


def _run(s: _Schedule, name: str, algorithm: str, nbytes: float) -> None:
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


#: the collectives that have a hierarchical form (ferro_collective.hierarchical); "barrier" is
#: modelled as "flat" (the header exchange alone) and "hierarchical"
HIERARCHICAL = ("allreduce", "broadcast", "all_gather", "reduce_scatter", "barrier")


@functools.lru_cache(maxsize=4096)
def predict(name: str, algorithm: str, nbytes: int, n: int, p: Params = DEFAULT,
            *, header: bool = True) -> float:
    """Seconds for ``name`` with ``algorithm`` on ``n`` ranks, ``nbytes`` per rank (the
    input: the whole buffer for allreduce/broadcast/reduce_scatter, the block for all_gather),
    from the algorithm's message schedule on ``p``'s links.

    ``algorithm="hierarchical"``: the stages :mod:`ferro_collective.hierarchical` runs on nodes
    of ``p.ranks_per_node`` ranks, each stage with its own header exchange and the algorithm
    "auto" picks for it (:func:`hierarchical_stages`), the node stages over the intra-node
    links (as on a simulated network); ``"hierarchical_engine"``: the same with each node stage
    one step through the node's shared-memory engine (a real multi-node job).
    """
    if n <= 1:
        return 0.0
    if algorithm in ("hierarchical", "hierarchical_engine"):
        return _hierarchical(name, nbytes, n, p, algorithm == "hierarchical_engine",
                             header)
    if name == "barrier" and algorithm == "flat":
        return header_time(p, n) + p.call
    s = _Schedule(p, _header(p, n) if header else [0.0] * n)
    _run(s, name, algorithm, nbytes)
    return max(s.clock) + p.call


def terms(name: str, algorithm: str, nbytes: int, n: int) -> tuple[float, float, float]:
    """The flat algorithm's critical path on one kind of link as (messages, bytes sent,
    bytes folded) in a row: its time is ``call + messages * alpha + bytes / beta + folded *
    gamma``, linear in the parameters (every rank's path of these symmetric schedules is
    the same), which is what lets ``benchmarks/scale_validate.py`` fit them to real runs."""
    big = 1e30
    msgs = predict(name, algorithm, nbytes, n, Params(1.0, big))
    sent = predict(name, algorithm, nbytes, n, Params(0.0, 1.0))
    folded = predict(name, algorithm, nbytes, n, Params(0.0, big, gamma=1.0))
    return msgs, sent, folded


def _layout(n: int, p: Params) -> tuple[int, int]:
    L = p.ranks_per_node
    if L < 2 or n % L or n // L < 2:
        raise ValueError(f"costmodel: {n} ranks at {L} per node have no hierarchy (it needs "
                         "at least 2 nodes of at least 2 ranks)")
    return L, n // L


def _auto_pick(name: str, nbytes: int, n: int, p: Params) -> str:
    """What ``algorithm="auto"`` runs (``call.choose``: its thresholds up to 4 ranks, the
    model beyond) for ``n`` ranks on ``p``'s links."""
    from types import SimpleNamespace

    from .call import choose

    return choose(name, None, int(nbytes), n, SimpleNamespace(params=p))


def _stage_pick(name: str, nbytes: int, n: int, alpha: float, beta: float) -> str:
    """auto's pick for a stage of ``n`` ranks on one kind of link (a stage's group carries its
    link as its network: ferro_backend.hierarchy)."""
    return _auto_pick(name, nbytes, n, Params(alpha, beta))


def hierarchical_stages(name: str, nbytes: int, n: int, p: Params = DEFAULT) -> list:
    """The stages of the hierarchical ``name`` on ``n`` ranks in nodes of ``p.ranks_per_node``:
    ``(group, stage collective, algorithm, bytes)`` with group "node" or "cross" (for
    allreduce's cross stage, local rank 0's slice; the others' differ by at most one element).
    ``algorithm`` is auto's pick for the stage's group size and links."""
    L, N = _layout(n, p)
    ia, ib = p.link(False)
    xa, xb = p.link(True)
    if name in ("allreduce", "reduce_scatter"):
        piece = math.ceil(nbytes / L)
        return [("node", "allreduce", _stage_pick("allreduce", nbytes, L, ia, ib), nbytes),
                ("cross", "allreduce", _stage_pick("allreduce", piece, N, xa, xb), piece),
                ("node", "all_gather", _stage_pick("all_gather", piece, L, ia, ib), piece)]
    if name == "broadcast":
        return [("cross", "broadcast", _stage_pick("broadcast", nbytes, N, xa, xb), nbytes),
                ("node", "broadcast", _stage_pick("broadcast", nbytes, L, ia, ib), nbytes)]
    if name == "all_gather":
        return [("node", "all_gather", _stage_pick("all_gather", nbytes, L, ia, ib), nbytes),
                ("cross", "all_gather", _stage_pick("all_gather", L * nbytes, N, xa, xb),
                 L * nbytes)]
    if name == "barrier":
        return [("node", "barrier", "flat", 0), ("cross", "barrier", "flat", 0),
                ("node", "barrier", "flat", 0)]
    raise ValueError(f"costmodel: no hierarchical model for {name!r}")


def _hierarchical(name: str, nbytes: int, n: int, p: Params, engine: bool,
                  header: bool) -> float:
    """The stages on the job's schedule (global ranks, node ``k`` = ranks ``kL .. kL+L-1``):
    every node's (or every local index's) group runs the stage on its own ranks; groups share
    no rank, so they run concurrently, each from its ranks' clocks."""
    from ferro_backend.partition import split_sizes

    L, N = _layout(n, p)
    nodes = [tuple(range(k * L, (k + 1) * L)) for k in range(N)]
    crosses = [tuple(range(j, n, L)) for j in range(L)]
    s = _Schedule(p, [0.0] * n)
    pieces = split_sizes(int(nbytes), L)  # allreduce's slices (bytes; the call splits elements)
    ia, ib = p.link(False)
    xa, xb = p.link(True)
    for group, stage, algorithm, size in hierarchical_stages(name, nbytes, n, p):
        if group == "node" and engine:
            # one step through the node's segment: everyone arrives, then copies the stage's
            # bytes over the intra-node link (the engine checks headers in the same step)
            for members in nodes:
                t = max(s.clock[m] for m in members) + ia + size / ib
                for m in members:
                    s.clock[m] = t
            continue
        if group == "node":
            groups = [(members, size) for members in nodes]
        elif name == "broadcast":
            groups = [(crosses[0], size)]  # the root's local index only (root 0)
        elif stage == "allreduce":
            groups = [(members, pieces[j]) for j, members in enumerate(crosses)]
        else:
            groups = [(members, size) for members in crosses]
        for members, size_j in groups:
            view = _View(s, members)
            if header:
                view.rounds(_header_rounds(len(members)))
            if stage == "barrier":
                continue
            if group == "cross" and stage == "allreduce" and size_j != size:
                algorithm = _stage_pick("allreduce", size_j, N, xa, xb)
            _run(view, stage, algorithm, size_j)
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


def flat_time(name: str, nbytes: int, n: int, p: Params = DEFAULT) -> float:
    """The flat call's modelled time with the algorithm "auto" runs (barrier: the header
    exchange)."""
    if name == "barrier":
        return predict("barrier", "flat", 0, n, p)
    return predict(name, _auto_pick(name, nbytes, n, p), nbytes, n, p)


#: a real job (the engine in each node, whose cost the model only estimates) leaves its stages
#: for the flat algorithm only when the model rates the flat one this much faster
ENGINE_MARGIN = 0.9


@functools.lru_cache(maxsize=1024)
def _hier_wins(name: str, bucket: int, n: int, p: Params, engine: bool) -> bool:
    if engine:
        return not flat_time(name, bucket, n, p) < ENGINE_MARGIN * predict(
            name, "hierarchical_engine", bucket, n, p)
    return predict(name, "hierarchical", bucket, n, p) < flat_time(name, bucket, n, p)


def choose_hierarchical(name: str, nbytes: int, n: int, p: Params = DEFAULT, *,
                        engine: bool = False) -> bool:
    """Whether ``algorithm="auto"`` runs ``name`` as node and cross stages
    (:mod:`ferro_collective.hierarchical`) rather than flat on ``n`` ranks in nodes of
    ``p.ranks_per_node``: when the model rates the stages faster than the flat algorithm auto
    would run, at the size rounded up to a power of two (so one (size class, world, layout)
    always gets one answer, the same on every rank). ``engine``: the node stages run on a
    shared-memory engine (a real job) rather than over intra-node messages (a simulated one);
    such a job keeps its stages unless the flat algorithm is rated :data:`ENGINE_MARGIN` times
    their time or less. False where the layout has no hierarchy (one node, or one rank per node)."""
    L = p.ranks_per_node
    if name not in HIERARCHICAL or L < 2 or n % L or n // L < 2:
        return False
    bucket = 1 << max(0, int(nbytes) - 1).bit_length()
    return _hier_wins(name, bucket if name != "barrier" else 0, n, p, engine)


__all__ = ["ALGORITHMS_MODELLED", "DEFAULT", "ENGINE_MARGIN", "HIERARCHICAL", "Params", "best",
           "choose_auto", "choose_hierarchical", "flat_time", "header_time",
           "hierarchical_stages", "params_for", "predict", "terms"]
