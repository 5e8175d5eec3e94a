"""The cost model learns the job's machines and network, and "auto" plans with what it learned.

:func:`learn_network` is a collective (every rank calls it, at the same point of the job, like any other
collective). It measures, on this job's own ranks and links:

- **the link** between nodes (``alpha``, ``beta``, ``burst``): the first ranks of nodes 0 and
  1 (ranks 0 and 1 on one node) exchange messages of PING_SIZES bytes both ways at once, each
  after the link has rested (:func:`_ping`);
- **a round**: the time of one step of a point-to-point algorithm across the whole job (an
  8-byte allreduce by recursive doubling, each call after a barrier as a job's calls start, the
  median over ``3 x reps`` calls after 3 warm-up calls of each call's slowest rank, divided by
  its rounds), which is what a small message really costs here: on an oversubscribed host it is the
  wait for the peer to be scheduled, far above the link's own latency. The model's ``alpha`` is
  the round (the ping's 8-byte exchange meets a peer asleep after the link's rest: 0.11-0.21 ms
  on 2 emulated nodes where a call's round took 0.05-0.1), and a message between a node's ranks
  (``intra_alpha``) costs at least the round too;
- **the local terms**: ``call``, one collective's cost outside its messages (a 1-rank
  allreduce); ``gamma``, seconds per byte of the reduction kernel; the node engine's step as a
  staged call meets it (``engine_step``: a staged allreduce less its cross stage, halved; at
  least a barrier on the node's engine) and its copy bandwidth (``copy_beta``);
- **the local rates beyond the cache** (``gamma_mem``, ``copy_beta_mem``, on arrays that
  stream from memory; ``cache_bytes``, a rank's share of the host's caches), timed by node 0's
  ranks at once, as a call's ranks fold at once (the slowest rank's): a 64 MiB fold ran at
  8-16 GB/s where 4 MiB ones ran at 40, and recursive doubling on 2 emulated nodes x 2 ranks
  was modelled 7-14% short of its 64 MiB calls with the cache's rates;
- **the route inside a node** (``intra_beta``): the first two ranks of node 0 exchange 1 and
  16 MiB both ways at once (the engine's rings copy a message in and out: 1-1.6 GB/s for 64
  MiB on 2 emulated nodes, where one copy runs at 10-40).

Where the host's ranks (its node's, or all of those of the emulated nodes sharing it:
``FERRO_HOST_RANKS``) outnumber its cores, a call's ranks all work at once on them: each local
rate is scaled to a rank's share of the cores then against its share when timed
(:func:`crowding`; 4 emulated nodes x 2 ranks on 2 cores: 4x). Ranks within the cores: as timed.

The parameters place each rank on its node as the job's hierarchy has it (``node_of``, where
the nodes do not hold consecutive ranks). Rank 0's figures are broadcast, so every rank holds
the same :class:`~.costmodel.Params` and "auto" picks the same algorithm everywhere. From then
on :func:`.costmodel.params_for` returns them for this backend and its hierarchy's node and
cross groups: the flat algorithm is the model's best at every world size (not the fixed
thresholds), and on several nodes the stages run only where the model rates them faster than
the flat call.
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path

import numpy as np

from ferro_backend import SimulatedBackend
from ferro_backend.engine import binding

from . import costmodel, costparams, message_schedule
from .api import allreduce, barrier, broadcast
from .background import usable_cores
from .ops import ReduceOp, accumulate

#: message sizes the link is timed with (bytes)
PING_SIZES = (8, 64 << 10, 1 << 20, 4 << 20)
#: message sizes the link's burst is timed with, one way (bytes)
BURST_SIZES = (8, 64 << 10, 256 << 10, 1 << 20)
_TAG = 0x7E57


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


#: seconds the link rests before each timed ping, so a token-bucket link (a shaped one, as
#: ``ferrorun --emulate-nodes`` makes: a millisecond of traffic) is full again
REST_S = 0.004


def fit_link(sizes, times, burst_sizes=None, burst_times=None) -> tuple[float, float, float]:
    """alpha, beta and burst from pings after the link rested: ``sizes`` bytes (ascending) both
    ways at once taking ``times`` seconds (alpha, the smallest one's time; beta, the slope
    between the two largest) and ``burst_sizes`` one way, answered by a byte, taking
    ``burst_times`` (default: the pings both ways). Burst: the bytes the link passed for free
    in the smallest ping that paid for at least half its bytes at the rate (0 on a plain link;
    a bucket of half the largest ping or more reads as that ping). A small paying ping keeps
    the error small: an error in beta weighs on the bytes paid for, and a ping that paid for
    less could be jitter alone (a 64 KiB ping's 60-100 us of it read as 50-59 KB of a 125 KB
    bucket). One way, because a link's bucket also pays for the acks of the traffic coming the
    other way (2 emulated nodes: 115-122 KB of a 125 KB bucket one way, 81-91 KB both ways)."""
    (_, *_, b1, b2), (t0, *_, t1, t2) = sizes, times
    beta = (b2 - b1) / max(t2 - t1, 1e-12)
    alpha = max(t0, 1e-7)
    if burst_sizes is None:
        burst_sizes, burst_times = sizes, times
    base, cap = burst_times[0], float(burst_sizes[-1])
    burst = cap
    for size, t in zip(burst_sizes[1:], burst_times[1:]):
        free = size - (t - base) * beta
        if free < 0.5 * size:
            burst = min(max(0.0, free), cap)
            break
    return alpha, beta, burst


def _after_barrier(backend, fn) -> float:
    """Seconds of ``fn()`` started as a job's calls start: the ranks leave a barrier, no rank
    spinning in the call before it (back to back, a round cost 0.10-0.14 ms on 2 emulated
    nodes, where calls after a barrier met 0.16-0.26 ms)."""
    barrier(backend)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _settled(fn, reps: int) -> float:
    """The median of ``3 x reps`` calls after 3 warm-up calls: a noisy moment weighs less (2
    emulated nodes: one job learned 0.35 ms a round from 7 calls, where later jobs measured
    0.12-0.15 ms)."""
    for _ in range(3):
        fn()
    return _median_time(fn, 3 * reps)


def _exchange(backend, peer: int, out: np.ndarray, inc: np.ndarray, timeout: float) -> None:
    """``out`` to ``peer`` and ``inc`` from it, both ways at once (both ranks call this)."""
    req = backend.irecv(inc, peer, tag=_TAG)
    backend.send(out, peer, tag=_TAG)
    req.wait(timeout)


def _ping(backend, peer: int, reps: int, timeout: float) -> tuple[float, float, float]:
    """alpha, beta and burst of the link to ``peer`` (both ranks call this at once; each ping
    after the link has rested; :func:`fit_link`)."""
    def exchange(out, inc):
        _exchange(backend, peer, out, inc, timeout)

    wake = np.zeros(1, np.uint8), np.empty(1, np.uint8)

    def one_way(out, inc):  # the lower rank's bytes, then the peer's one-byte answer
        if backend.rank < peer:
            backend.send(out, peer, tag=_TAG)
            backend.recv(wake[1], peer, tag=_TAG, timeout=timeout)
        else:
            backend.recv(inc, peer, tag=_TAG, timeout=timeout)
            backend.send(wake[0], peer, tag=_TAG)

    def rested(ping, sizes) -> list[float]:
        """The median time of ``ping(out, inc)`` at each size, each after the link rested and
        both ranks met again (a byte each way: the bucket stays full); one untimed first."""
        medians = []
        for nbytes in sizes:
            out, inc = np.zeros(nbytes, np.uint8), np.empty(nbytes, np.uint8)
            times = []
            for _ in range(reps + 1):
                time.sleep(REST_S)
                exchange(*wake)
                t0 = time.perf_counter()
                ping(out, inc)
                times.append(time.perf_counter() - t0)
            medians.append(statistics.median(times[1:]))
        return medians

    link = rested(exchange, PING_SIZES)
    # the bucket: the median of 3 series (2 emulated nodes: one read 29 KB of 125 in 2 jobs of 8)
    bursts = sorted(fit_link(PING_SIZES, link, BURST_SIZES, rested(one_way, BURST_SIZES))[2]
                    for _ in range(3))
    return (*fit_link(PING_SIZES, link)[:2], bursts[1])


def local_terms(reps: int = 20) -> tuple[float, float, float]:
    """``call`` (seconds of one collective outside its messages), ``gamma`` (seconds per byte
    folded) and the copy bandwidth (bytes/s), measured in this process."""
    solo = SimulatedBackend.create_group(1)[0]
    x = np.ones(1, np.float64)
    allreduce(x, solo, algorithm="star")
    call = _median_time(lambda: allreduce(x, solo, algorithm="star"), reps)
    a, c = np.ones(1 << 20, np.float32), np.ones(1 << 20, np.float32)
    gamma = _median_time(lambda: accumulate(a, c, ReduceOp.SUM), reps)
    copy = _median_time(lambda: np.copyto(a, c), reps)
    return call, gamma / a.nbytes, a.nbytes / copy


def cache_bytes(ranks: int = 1) -> float:
    """The largest array each of ``ranks`` ranks working at once keeps in this host's caches:
    their share of its largest cache, halved (a copy or a fold streams two arrays through it),
    from sysfs; a 32 MiB cache where the host does not say."""
    largest = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            largest = max(largest, int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(
                text[-1:], 0))
        except (OSError, ValueError):
            continue
    return float((largest or 32 << 20) // (2 * max(1, ranks)))


def memory_rates(ranks: int = 1, reps: int = 5) -> tuple[float, float]:
    """``gamma_mem`` (seconds per byte folded) and the copy bandwidth (bytes/s) on arrays four
    times :func:`cache_bytes` of ``ranks`` (4-256 MiB; ``ranks`` of a node measuring at once
    stream some 128 MiB through a 32 MiB cache, whatever their number), measured in this
    process."""
    size = int(min(max(4 * cache_bytes(ranks), 4 << 20), 256 << 20)) // 4
    a, c = np.ones(size, np.float32), np.ones(size, np.float32)
    accumulate(a, c, ReduceOp.SUM)  # every page touched before timing
    gamma = _median_time(lambda: accumulate(a, c, ReduceOp.SUM), reps)
    copy = _median_time(lambda: np.copyto(a, c), reps)
    return gamma / a.nbytes, a.nbytes / copy


def crowding(host_ranks: int, cores: int, timed_by: int) -> float:
    """How many times slower a local rate runs with the ``host_ranks`` ranks of this host all at
    work on its ``cores`` than with the ``timed_by`` that timed it (ranks per core, at least 1)."""
    cores = max(1, cores)
    return max(1.0, host_ranks / cores) / max(1.0, timed_by / cores)


def _route_beta(backend, peer: int, reps: int, timeout: float) -> float:
    """Bytes/s of messages between two ranks of one node (their route: the engine's rings on a
    multi-node job), both ways at once, from 1 and 16 MiB exchanges (both ranks call this)."""
    medians = []
    for nbytes in (1 << 20, 16 << 20):
        out, inc = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        exchange = functools.partial(_exchange, backend, peer, out, inc, timeout)
        exchange()  # untimed first
        medians.append(_median_time(exchange, reps))
    return (15 << 20) / max(medians[1] - medians[0], 1e-9)


def _node_of(h, n: int) -> tuple[int, ...] | None:
    """Each rank's node, where the nodes do not hold consecutive ranks (None where they do,
    or there is no hierarchy)."""
    if h is None:
        return None
    node_of = [0] * n
    for k, members in enumerate(h.members):
        for rank in members:
            node_of[rank] = k
    return costparams.placement(tuple(node_of), h.local_world)


def learn_network(backend, *, reps: int = 7, timeout: float | None = None) -> costmodel.Params:
    """Measure this job (see the module docstring) and make "auto" plan with the result on
    ``backend`` and its hierarchy's groups; returns the learned parameters (the same on every
    rank). A collective: every rank of ``backend`` must call it. Takes about a second (0.85-1.75 s
    on 2-8 ranks of 2-4 emulated nodes on 2 cores).

    Parameters
    ----------
    backend : ferro_backend.Backend
        The group to measure (and its hierarchy's node and cross groups, if it has one).
    reps : int, default 7
        Timed repetitions per figure (their median is used).
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: ``backend.timeout``).

    Returns
    -------
    ferro_collective.costmodel.Params
        The latency, bandwidth and per-call figures "auto" now plans with.

    Raises
    ------
    CollectiveMismatchError, CollectiveTimeoutError, PeerClosedError
        As for every collective (it runs barriers, allreduces and a broadcast).

    Examples
    --------
    >>> params = learn_network(backend)  # once, after the backend is up, on every rank
    """
    n, rank = backend.world_size, backend.rank
    wait = backend.resolve_timeout(timeout, "learn_network: timeout")
    h = getattr(backend, "hierarchy", None)
    local = h.local_world if h is not None else 1
    barrier(backend)
    fig = np.zeros(13)
    node0 = h.members[0] if h is not None else (0,)  # rank 0's node, whatever the layout
    peer = h.members[1][0] if h is not None and n > local else 1
    if n > 1 and rank in (0, peer):
        fig[0], fig[1], fig[7] = _ping(backend, peer if rank == 0 else 0, reps, wait)
    if rank == 0:
        fig[2], fig[3], fig[4] = local_terms()
        fig[10] = cache_bytes(local)
        fig[11], fig[12] = binding.host_ranks(local), usable_cores()  # rank 0's, for all
    mem = np.zeros(2)  # node 0's ranks at once, as a call's ranks fold at once: the slowest
    if rank in node0:
        if len(node0) > 1:
            barrier(h.node)
            if rank in node0[:2]:
                fig[9] = _route_beta(backend, node0[1] if rank == 0 else 0, reps, wait)
            barrier(h.node)
        mem[0], copy_mem = memory_rates(len(node0))
        mem[1] = 1.0 / copy_mem
    mem = allreduce(mem, backend, ReduceOp.MAX)
    if h is not None and h.node.engine is not None:
        barrier(h.node)
        fig[5] = _median_time(lambda: barrier(h.node), reps)
    if h is not None and h.node.engine is not None and n > local:
        # an engine step as the stages meet it: a staged allreduce of an element per local
        # rank, less its cross stage, is two node steps. After the cross stage the node's
        # ranks come back apart, and an oversubscribed host must schedule them again (2
        # emulated nodes x 2 ranks on 2 cores: a barrier alone 1 us, a step in the call ~0.2 ms)
        costmodel.forget(backend)  # "auto" runs the stages
        y = np.zeros(local)
        staged = _settled(lambda: allreduce(y, backend), reps)
        cross = _settled(lambda: allreduce(y[:1], h.cross, algorithm="recursive_doubling"),
                         reps)
        fig[8] = max(fig[5], (staged - cross) / 2)
    if n > 1:
        x = np.zeros(1)

        def one_round_trip():
            allreduce(x, backend, algorithm="recursive_doubling")

        for _ in range(3):  # warm-up calls
            one_round_trip()
        took = np.array([_after_barrier(backend, one_round_trip) for _ in range(3 * reps)])
        rounds = (n - 1).bit_length() + len(message_schedule.header_rounds(n)) + (n & (n - 1) != 0)
        # each call's slowest rank, as a call's time is taken (the last rank out of the barrier
        # waits least, its peers wait for it), then the median: 4 emulated nodes x 2 ranks read
        # 2.2 ms from the slowest rank's median where the calls took 2.8-3.2
        fig[6] = float(np.median(allreduce(took, backend, ReduceOp.MAX))) / rounds
    broadcast(fig, backend, root=0, out=fig)
    (alpha, beta, call, gamma, copy_bw, barrier_s, round_cost, burst, engine_step, route_bw,
     cache, host, cores) = fig.tolist()
    alone, node, pair = (crowding(int(host), int(cores), k) for k in (1, len(node0), 2))
    gamma, copy_bw, route_bw = gamma * alone, copy_bw / alone, route_bw / pair
    mem *= node  # seconds per byte folded, and per byte copied
    rates = dict(copy_beta=copy_bw, gamma_mem=float(mem[0]), copy_beta_mem=1.0 / mem[1],
                 cache_bytes=cache)
    intra = local > 1 and barrier_s > 0
    p = costmodel.Params(
        round_cost or alpha, beta if beta > 0 else costmodel.DEFAULT.beta,
        # a message between a node's ranks waits for its peer like any other: the round; it
        # moves at its route's rate (the engine's rings: copied in, then out)
        max(barrier_s, round_cost) if intra else None,
        (route_bw if route_bw > 0 else copy_bw) if intra else None,
        local, gamma=gamma, call=call, **rates,
        engine_step=engine_step if intra and engine_step > 0 else None,
        # a real node's link carries its messages in and out one after another, one rank per
        # node or several (a star's root takes its peers' messages in turn: 4 emulated nodes,
        # 16 MiB, 564 ms modelled against 853 ms measured before); a modelled network gives
        # each rank an interface of its own (netsim's rules)
        shared_link=local > 1 or getattr(backend, "network", None) is None, burst=burst,
        node_of=_node_of(h, n))
    costmodel.remember(backend, p)
    if h is not None:
        costmodel.remember(h.cross, costmodel.Params(p.alpha, p.beta, gamma=gamma, call=call,
                                                     **rates))
        if intra:
            costmodel.remember(h.node, costmodel.Params(p.engine_step, copy_bw, gamma=gamma,
                                                        call=call, **rates))
    return p


__all__ = ["BURST_SIZES", "PING_SIZES", "cache_bytes", "crowding", "fit_link", "learn_network",
           "local_terms", "memory_rates"]
