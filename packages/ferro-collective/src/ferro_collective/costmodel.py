"""An alpha-beta cost model of every point-to-point algorithm of the collectives.

A message of ``b`` bytes on a link costs ``alpha + b / beta`` (latency, bandwidth); a rank's
interface sends one message at a time; ranks on one node (``ranks_per_node`` consecutive ranks,
or as ``Params.node_of`` places them) use the faster intra-node link, and a step in which any
message crosses nodes costs what the slower link costs (the steps of a ring or a tree wait for
their slowest message). Local work costs what :class:`~.costparams.Params` says (free on a
simulated network, whose virtual time counts the same: the tests hold the model to it within
10% at 8-256 ranks; what :func:`.learn.learn_network` measured on a real job).

Every collective first exchanges its header (mismatch detection, Bruck's all-gather:
``ceil(log2 n)`` rounds of growing blocks of ``HEADER_SIZE`` bytes, the ranks numbered node by
node, :meth:`.Params.node_major`); the model includes it (a call or stage of two ranks that
sends it with its data, :mod:`.pair`, and a small one of more gathered in its rounds,
:mod:`.gathered`, :func:`gathers`, as such).

:func:`predict` gives one algorithm's time, :func:`best` the fastest; :func:`choose_auto` is
what ``algorithm="auto"`` uses beyond the few ranks the fixed thresholds were measured on.

Several nodes: ``predict(name, "hierarchical", ...)`` composes the whole-call check (the
call's header exchanged on every node, then across nodes: :mod:`.stage_check`) and the
hierarchical stages of the collectives (node stage, cross stages of every local index at once,
node stage; each with auto's algorithm for its group and links, and no header exchange of its
own: the check covered it) on one schedule of the job's ranks, as a simulated hierarchy runs them
(``SimulatedBackend.create_group(..., hierarchical=True)``), and :func:`choose_hierarchical`
is how "auto" decides between them and the flat algorithm on a backend with a node layout.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import weakref

from . import message_schedule
from .costparams import DEFAULT, Params, placement
from .gathered import GATHER_MAX, PAD, gathered_bytes
from .header import HEADER_SIZE
from .pair import BROADCAST_FUSE_MAX, FUSE_MAX

#: backend -> the parameters :func:`ferro_collective.learn_network` measured on it
_LEARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember(backend, p: Params) -> None:
    """From now on "auto" plans with ``p`` on ``backend`` (what :func:`.learn.learn_network` found)."""
    _LEARNED[backend] = p


def forget(backend) -> Params | None:
    """Plan on ``backend`` as if nothing had been learned (returns what was)."""
    return _LEARNED.pop(backend, None)


def learned(backend) -> Params | None:
    """The parameters learned on ``backend``, if :func:`.learn.learn_network` ran on it."""
    try:
        return _LEARNED.get(backend)
    except TypeError:  # a backend that cannot be weakly referenced learned nothing
        return None


def params_for(backend) -> Params:
    """The link parameters "auto" plans with on ``backend``: what :func:`.learn.learn_network` measured
    on it, if it ran; its modelled network when it is a
    :class:`~ferro_backend.SimulatedBackend` made with one; else :data:`DEFAULT`'s links with the
    backend's node layout (``backend.nodes``: the same number of ranks on each node, consecutive
    or, with ``Params.node_of``, dealt out as ``srun --distribution=cyclic`` does), or every
    link between nodes when the layout is unknown or the nodes hold different numbers."""
    p = learned(backend)
    if p is not None:
        return p
    network = getattr(backend, "network", None)
    if network is not None:
        return Params.of(network)
    nodes = getattr(backend, "nodes", None)
    return _of_nodes(tuple(nodes)) if nodes else _UNKNOWN


#: the links "auto" plans with where the layout is unknown: every link between nodes
_UNKNOWN = Params(DEFAULT.alpha, DEFAULT.beta)


@functools.lru_cache(maxsize=64)
def _of_nodes(nodes: tuple) -> Params:
    """:data:`DEFAULT`'s links with the node layout ``nodes`` (each rank's node's name)."""
    index = {name: k for k, name in enumerate(dict.fromkeys(nodes))}
    node_of = tuple(index[v] for v in nodes)
    counts = set(collections.Counter(node_of).values())
    if len(counts) != 1:
        return _UNKNOWN
    per_node = counts.pop()
    return dataclasses.replace(DEFAULT, ranks_per_node=per_node,
                               node_of=placement(node_of, per_node))


def node_major(backend, n: int) -> tuple[int, ...] | None:
    """The order in which the header exchange of ``n`` ranks on ``backend`` numbers them
    (:meth:`.Params.node_major` of what "auto" plans with); None: rank order."""
    return params_for(backend).node_major(n)


ALGORITHMS_MODELLED = {
    "allreduce": ("ring", "recursive_doubling", "star"),
    "broadcast": ("tree", "star"),
    "all_gather": ("ring",),
    "reduce_scatter": ("ring",),
}


#: the collectives that have a hierarchical form (node and cross stages); "barrier" is
#: modelled as "flat" (the header exchange alone) and "hierarchical"
HIERARCHICAL = ("allreduce", "broadcast", "all_gather", "reduce_scatter", "barrier")
#: the hierarchical collectives whose stages start on the node (its first stage carries the
#: node's whole-call check, :mod:`.stage_check`); a broadcast's start across nodes for the
#: ranks of the root's local index, and check the node on their own first
NODE_FIRST = frozenset({"allreduce", "reduce_scatter", "all_gather", "barrier"})


@functools.lru_cache(maxsize=4096)
def predict(name: str, algorithm: str, nbytes: int, n: int, p: Params = DEFAULT,
            *, header: bool = True) -> float:
    """Seconds for ``name`` with ``algorithm`` on ``n`` ranks, ``nbytes`` per rank (the
    input: the whole buffer for allreduce/broadcast/reduce_scatter, the block for all_gather),
    from the algorithm's message schedule on ``p``'s links.

    ``algorithm="hierarchical"``: the whole-call check, then the stages the collectives run
    on nodes of ``p.ranks_per_node`` ranks, each with the algorithm "auto" picks for it
    (:func:`hierarchical_stages`; a barrier's last node stage alone follows the check), the
    node stages over the intra-node links (as on a simulated network);
    ``"hierarchical_engine"``: the same with each node stage one step through the node's
    shared-memory engine (a real multi-node job).
    """
    if n <= 1:
        return 0.0
    if algorithm in ("hierarchical", "hierarchical_engine"):
        return _hierarchical(name, nbytes, n, p, algorithm == "hierarchical_engine",
                             header)
    if name == "barrier" and algorithm == "flat":
        return message_schedule.header_time(p, n) + p.call
    s = message_schedule.Schedule(p, message_schedule.header_clocks(p, n) if header else [0.0] * n)
    message_schedule.run(s, name, algorithm, nbytes)
    # an allreduce first copies its input into the buffer it folds in (every rank alike)
    return max(s.clock) + p.call + (p.copy(nbytes) if name == "allreduce" else 0.0)


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
    if L < 2 or n % L or n // L < 2 or any(len(m) != L for m in p.members(n)):
        raise ValueError(f"costmodel: {n} ranks at {L} per node have no hierarchy (it needs "
                         "at least 2 nodes of at least 2 ranks)")
    return L, n // L


#: allreduce messages up to this size use recursive doubling (latency), larger ones the ring
#: (measured, up to 4 ranks; rooted collectives scale it)
SMALL_MESSAGE_BYTES = 256 << 10


def measured_pick(name: str, nbytes: int, n: int) -> str:
    """What ``algorithm="auto"`` runs up to 4 ranks (and for the collectives the model does not
    describe): the thresholds measured on this machine's kind."""
    if name == "allreduce":
        return "recursive_doubling" if nbytes <= SMALL_MESSAGE_BYTES or n <= 2 and \
            nbytes <= 4 * SMALL_MESSAGE_BYTES else "ring"
    if name == "reduce":  # binomial tree; reduce-scatter + gather (bandwidth) when large
        return "tree" if nbytes <= SMALL_MESSAGE_BYTES or n <= 2 else "ring"
    if name in ("gather", "scatter"):  # nbytes: one rank's block
        return "tree" if nbytes <= SMALL_MESSAGE_BYTES // 4 else "star"
    if name == "all_to_all":
        return "pairwise"
    return "tree" if name == "broadcast" else "ring"


def auto_pick(name: str, nbytes: int, n: int, p: Params | None) -> str:
    """What ``algorithm="auto"`` runs for ``n`` ranks: the measured thresholds up to 4 ranks,
    beyond them the model's best on ``p``'s links (``p`` is not needed up to 4 ranks, nor for
    the collectives the model does not describe)."""
    if n > 4 and name in ALGORITHMS_MODELLED:
        return choose_auto(name, nbytes, n, DEFAULT if p is None else p)
    return measured_pick(name, int(nbytes), n)


def _stage_pick(name: str, nbytes: int, n: int, alpha: float, beta: float) -> str:
    """auto's pick for a stage of ``n`` ranks on one kind of link (a stage's group carries its
    link as its network: ferro_backend.hierarchy)."""
    return auto_pick(name, nbytes, n, Params(alpha, beta))


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
    nodes = p.members(n)  # node k's ranks (consecutive ones unless p.node_of says otherwise)
    crosses = [tuple(members[j] for members in nodes) for j in range(L)]
    s = message_schedule.Schedule(p, [0.0] * n)
    pieces = split_sizes(int(nbytes), L)  # allreduce's slices (bytes; the call splits elements)
    ia, ib = p.link(False)
    xa, xb = p.link(True)
    step = ia if p.engine_step is None else p.engine_step
    stages = hierarchical_stages(name, nbytes, n, p)
    # the whole-call check: each group's first stage exchanges it (across nodes on every cross
    # group at once: a broadcast's others check alone), a broadcast's node first on its own
    carries = {"node": header and name in NODE_FIRST, "cross": header}
    if header and name not in NODE_FIRST:
        stages = [("node", "check", "flat", 0)] + stages
    for group, stage, algorithm, size in stages:
        first, carries[group] = carries[group], False
        if group == "node" and engine:
            # one step through the node's segment: everyone arrives, then copies the stage's
            # bytes over the intra-node link (the engine checks headers in the same step)
            for members in nodes:
                t = max(s.clock[m] for m in members) + step + (
                    size / ib if p.copy_beta is None else p.copy(size))
                for m in members:
                    s.clock[m] = t
            continue
        if group == "node":
            groups = [(members, size) for members in nodes]
        elif name == "broadcast" and stage != "check":
            groups = [(crosses[0], size)]  # the root's local index only (root 0)
        elif stage == "allreduce":
            groups = [(members, pieces[j]) for j, members in enumerate(crosses)]
        else:
            groups = [(members, size) for members in crosses]
        link = Params(xa, xb) if group == "cross" else Params(ia, ib)
        if group == "cross" and first:
            sizes = dict(groups)
            for members in crosses:  # (a stage that sends it with its data: below)
                m = len(members)
                if not (paired(stage, m, sizes.get(members, -1)) or
                        members in sizes and gathers(stage, sizes[members], m, link)):
                    message_schedule.View(s, members).rounds(message_schedule.header_rounds(m))
        for members, size_j in groups:
            view = message_schedule.View(s, members)
            fused = first and paired(stage, len(members), size_j)
            gathered = first and not fused and stage != "check" and \
                gathers(stage, size_j, len(members), link)
            if (group == "node" and first and not fused and not gathered) or \
                    stage == "check" or (stage == "barrier" and not first):
                view.rounds(message_schedule.header_rounds(len(members)))
            if stage in ("check", "barrier"):  # (a barrier's exchange is the barrier)
                continue
            if gathered:  # (the data in the header exchange's rounds: :mod:`.gathered`)
                view.rounds(gathered_rounds(stage, size_j, len(members)))
                continue
            if group == "cross" and stage == "allreduce" and size_j != size:
                algorithm = _stage_pick("allreduce", size_j, N, xa, xb)
            message_schedule.run(view, stage, algorithm, size_j + (HEADER_SIZE if fused else 0))
    return max(s.clock)


def paired(stage: str, n: int, nbytes: int) -> bool:
    """Whether a stage of ``n`` ranks and ``nbytes`` (a block for all_gather) sends its header
    with its data (:mod:`.pair`: two ranks, up to ``FUSE_MAX``; a broadcast's other rank sends
    its header alone meanwhile, which the root's longer message covers)."""
    most = BROADCAST_FUSE_MAX if stage == "broadcast" else FUSE_MAX
    return n == 2 and stage in ("allreduce", "all_gather", "broadcast") and \
        0 <= nbytes <= most and (nbytes > 0 or stage == "allreduce")


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
    exchange; a small allreduce, all_gather or reduce_scatter gathered in its rounds where
    :func:`gathers`)."""
    if name == "barrier":
        return predict("barrier", "flat", 0, n, p)
    if gathers(name, nbytes, n, p):
        return gathered_time(name, nbytes, n, p)
    return predict(name, auto_pick(name, nbytes, n, p), nbytes, n, p)


def gathered_time(name: str, nbytes: int, n: int, p: Params = DEFAULT) -> float:
    """A small allreduce, all_gather, reduce_scatter or broadcast of ``n`` ranks gathered with
    the headers in the header exchange's rounds (:mod:`.gathered`, :func:`gathered_rounds`;
    ``nbytes``: each rank's input); an allreduce copies its input first and folds the ``n``
    arrays last, a reduce_scatter folds its own part of them."""
    s = message_schedule.Schedule(p, [0.0] * n)
    message_schedule.View(s, p.node_major(n) or range(n)).rounds(
        gathered_rounds(name, nbytes, n))
    local = 0.0 if name in ("all_gather", "broadcast") else \
        p.copy(nbytes) + p.fold((n - 1) * nbytes / (n if name == "reduce_scatter" else 1))
    return max(s.clock) + p.call + local


def gathered_rounds(name: str, nbytes: int, n: int) -> list:
    """The rounds of a call gathered in the header exchange's (:mod:`.gathered`): every rank's
    unit ``nbytes`` and a header; a broadcast's units :data:`.gathered.PAD` bytes and a header
    but the root's, whose data each message carries on the path it takes."""
    if name == "broadcast":
        return message_schedule.header_rounds(n, PAD + HEADER_SIZE, nbytes)
    return message_schedule.header_rounds(n, nbytes + HEADER_SIZE)


@functools.lru_cache(maxsize=4096)
def gathers(name: str, nbytes: int, n: int, p: Params = DEFAULT) -> bool:
    """Whether "auto" runs a call of ``n`` > 2 ranks gathered in the header exchange's rounds
    (:mod:`.gathered`): an allreduce, all_gather, reduce_scatter or broadcast of up to
    ``GATHER_MAX`` bytes gathered a rank (``nbytes``: each rank's input; a broadcast gathers
    the root's alone: :func:`.gathered.gathered_bytes`), where the model rates it faster than
    the header exchange and auto's algorithm."""
    if n < 3 or name not in ("allreduce", "all_gather", "reduce_scatter", "broadcast") or \
            not 0 < gathered_bytes(name, nbytes, n) <= GATHER_MAX:
        return False
    return gathered_time(name, nbytes, n, p) < predict(name, auto_pick(name, nbytes, n, p),
                                                        nbytes, n, p)


#: a real job (the engine in each node, whose cost the model only estimates) leaves its stages
#: for the flat algorithm only when the model rates the flat one this much faster
ENGINE_MARGIN = 0.9


@functools.lru_cache(maxsize=1024)
def _hier_wins(name: str, bucket: int, n: int, p: Params, engine: bool) -> bool:
    flat = flat_time(name, bucket, n, p)
    if engine:
        return not flat < ENGINE_MARGIN * predict(name, "hierarchical_engine", bucket, n, p)
    return predict(name, "hierarchical", bucket, n, p) < flat


def choose_hierarchical(name: str, nbytes: int, n: int, p: Params = DEFAULT, *,
                        engine: bool = False) -> bool:
    """Whether ``algorithm="auto"`` runs ``name`` as node and cross stages
    (the collectives' hierarchical stages) rather than flat on ``n`` ranks in nodes of
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


__all__ = ["ALGORITHMS_MODELLED", "DEFAULT", "ENGINE_MARGIN", "HIERARCHICAL",
           "SMALL_MESSAGE_BYTES", "Params", "auto_pick", "best", "choose_auto",
           "choose_hierarchical", "flat_time", "forget", "gathered_rounds", "gathered_time",
           "gathers", "hierarchical_stages", "learned", "measured_pick", "node_major",
           "params_for", "predict", "remember", "terms"]
