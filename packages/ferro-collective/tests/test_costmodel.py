"""The cost model against the simulated network (virtual time), and "auto" against the model."""

import dataclasses
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ferro_collective as fc
from ferro_backend import SimulatedBackend
from ferro_backend.hierarchy import Hierarchy
from ferro_backend.netsim import Link, Network
from ferro_backend.testing import run_threads
from ferro_collective import costmodel as cm
from ferro_collective.executors import prefer_hierarchical
from ferro_collective.executors import usable_hierarchy as hierarchy_of
from ferro_collective.plan import choose
from ferro_collective.records import BY_NAME

NETWORKS = {
    "flat 25 Gb/s": Network.cluster(gbit=25, latency_us=5),
    "16 ranks/node": Network.cluster(gbit=25, latency_us=5, ranks_per_node=16),
    "4 ranks/node, 10 Gb/s": Network.cluster(gbit=10, latency_us=20, ranks_per_node=4),
}


def _simulate(net, n, name, algorithm, nbytes, staged=None):
    """Virtual seconds of one call on a simulated group (the slowest rank's clock).
    ``staged``: on a group with a simulated hierarchy, True runs the hierarchical stages, False
    the flat "auto" algorithm (whatever the model would pick), None leaves the choice to auto."""
    hierarchical = algorithm == "hierarchical"
    if hierarchical:
        algorithm = None
    group = SimulatedBackend.create_group(n, network=net, timeout=120, hierarchical=hierarchical)
    if name == "reduce_scatter":
        x = np.ones(max(n, nbytes // 4 // n * n), np.float32)
    else:
        x = np.ones(max(1, nbytes // 4), np.float32)

    def run(b):
        if name == "allreduce":
            fc.allreduce(x, b, algorithm=algorithm)
        elif name == "broadcast":
            fc.broadcast(x, b, 0, algorithm=algorithm)
        elif name == "all_gather":
            fc.all_gather(x, b, algorithm=algorithm)
        elif name == "barrier":
            fc.barrier(b)
        else:
            fc.reduce_scatter(x, b, algorithm=algorithm)
        return b.clock

    if staged is None:
        return max(run_threads(run, group, timeout=120)), x.nbytes
    with mock.patch.object(cm, "choose_hierarchical", lambda *a, **k: staged):
        return max(run_threads(run, group, timeout=120)), x.nbytes


# 64 ranks: latency-bound (4 KiB) where the nodes matter most, bandwidth-bound on every network
CASES = [(label, n, nbytes) for label in NETWORKS for n in (8, 12, 64)
         for nbytes in (4096, 1 << 18 if n == 64 else 1 << 20)
         if not (n == 64 and nbytes == 4096 and label != "16 ranks/node")]
CASES += [("16 ranks/node", 256, 4096)]


@pytest.mark.parametrize("label,n,nbytes", CASES)
def test_model_agrees_with_the_simulated_network(label, n, nbytes):
    net = NETWORKS[label]
    p = cm.Params.of(net)
    for name, algorithms in cm.ALGORITHMS_MODELLED.items():
        for algorithm in algorithms:
            if n == 256 and (name, algorithm) not in {("allreduce", "recursive_doubling"),
                                                      ("broadcast", "tree")}:
                continue  # the slow ones to simulate at 256 threads (a ring's 255 rounds):
                # 8-64 ranks cover them
            sim, sent = _simulate(net, n, name, algorithm, nbytes)
            model = cm.predict(name, algorithm, sent, n, p)
            assert model == pytest.approx(sim, rel=0.10), (name, algorithm, sim, model)


def test_virtual_time_repeats_exactly():
    net = NETWORKS["16 ranks/node"]
    first = _simulate(net, 32, "allreduce", "ring", 1 << 16)
    assert all(_simulate(net, 32, "allreduce", "ring", 1 << 16) == first for _ in range(3))


@pytest.mark.parametrize("label", list(NETWORKS))
def test_auto_is_never_more_than_1_2x_the_models_best(label):
    """On the backend's own network (what a SimulatedBackend made with it reports)."""
    net = NETWORKS[label]
    p = cm.Params.of(net)
    backend = SimpleNamespace(network=net)
    for n in (5, 8, 16, 64, 256):
        for nbytes in (4096, 65536, 1 << 20, 16 << 20, 64 << 20):
            for name in cm.ALGORITHMS_MODELLED:
                picked = choose(BY_NAME[name], None, nbytes, n, backend)
                _, fastest = cm.best(name, nbytes, n, p)
                assert cm.predict(name, picked, nbytes, n, p) <= 1.2 * fastest, \
                    (label, name, n, nbytes, picked)


def test_auto_is_a_function_of_size_and_world():
    picks = {choose(BY_NAME["allreduce"], None, s, n) for n in (64,) for s in [1 << 20] * 5}
    assert len(picks) == 1
    assert choose(BY_NAME["allreduce"], None, 3000, 64) == choose(BY_NAME["allreduce"], None, 4096, 64)


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "star", "auto"])
def test_every_algorithm_gives_every_rank_the_same_bits(algorithm):
    net = Network(Link(1e-6, 1e9))
    def run(b):
        x = np.random.default_rng(b.rank).standard_normal(1001).astype(np.float32)
        return fc.allreduce(x, b, algorithm=algorithm).tobytes()

    out = run_threads(run, SimulatedBackend.create_group(12, network=net))
    assert len(set(out)) == 1


def test_params_follow_the_backends_layout():
    net = NETWORKS["4 ranks/node, 10 Gb/s"]
    (sim,) = SimulatedBackend.create_group(1, network=net)
    assert cm.params_for(sim) == cm.Params.of(net)
    assert cm.params_for(SimpleNamespace(nodes=("a", "a", "b", "b"))).ranks_per_node == 2
    dealt = cm.params_for(SimpleNamespace(nodes=("a", "b", "a", "b")))  # srun's cyclic
    assert (dealt.ranks_per_node, dealt.node_of) == (2, (0, 1, 0, 1))
    assert dealt.intra_alpha == cm.DEFAULT.intra_alpha
    uneven = cm.params_for(SimpleNamespace(nodes=("a", "a", "a", "b")))
    assert uneven.intra_alpha is None  # every link counted as between nodes


def test_a_dealt_out_layout_is_planned_as_its_nodes_hold_it():
    """Without learning, ``auto`` plans a cyclic layout (ranks 0, 2, ... on one node) with
    those nodes: the same predictions as the consecutive layout with the ranks renamed, not
    those of a job whose every link crosses nodes."""
    n = 8
    dealt = cm.params_for(SimpleNamespace(nodes=tuple("abcd"[r % 4] for r in range(n))))
    consecutive = dataclasses.replace(dealt, node_of=None)
    assert dealt.members(n) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    for size in (4096, 1 << 20, 64 << 20):
        staged = cm.predict("allreduce", "hierarchical", size, n, dealt)
        assert staged == pytest.approx(
            cm.predict("allreduce", "hierarchical", size, n, consecutive), rel=1e-9)
        assert cm.choose_hierarchical("allreduce", size, n, dealt) == \
            cm.choose_hierarchical("allreduce", size, n, consecutive)
        # the flat ring's every hop crosses nodes here, not one in two
        assert cm.predict("allreduce", "ring", size, n, dealt) > \
            cm.predict("allreduce", "ring", size, n, consecutive)


def test_model_errors():
    with pytest.raises(ValueError, match="no model"):
        cm.predict("allreduce", "bogus", 10, 4)
    assert cm.predict("allreduce", "ring", 10, 1) == 0.0


# ----------------------------------------------------------------------------- hierarchical
HIER_CASES = [("16 ranks/node", 32, 4096), ("16 ranks/node", 64, 1 << 18),
              ("4 ranks/node, 10 Gb/s", 8, 1 << 20), ("4 ranks/node, 10 Gb/s", 12, 4096),
              ("4 ranks/node, 10 Gb/s", 64, 4096), ("16 ranks/node", 256, 4096)]


@pytest.mark.parametrize("label,n,nbytes", HIER_CASES)
def test_hierarchical_model_agrees_with_the_simulated_stages(label, n, nbytes):
    """The hierarchical collectives' stages on a simulated hierarchy (node stages over the
    intra-node links, cross stages over the network) against predict(..., "hierarchical")."""
    net = NETWORKS[label]
    p = cm.Params.of(net)
    for name in cm.HIERARCHICAL:
        if n == 256 and name not in ("allreduce", "barrier"):
            continue  # 8-64 ranks cover the others
        size = nbytes // 16 if name == "all_gather" and nbytes > 4096 else nbytes
        sim, sent = _simulate(net, n, name, "hierarchical", size, staged=True)
        model = cm.predict(name, "hierarchical", sent, n, p)
        assert model == pytest.approx(sim, rel=0.10), (name, sim, model)


def test_a_simulated_hierarchy_runs_on_the_global_links():
    net = NETWORKS["4 ranks/node, 10 Gb/s"]
    group = SimulatedBackend.create_group(8, network=net, hierarchical=True)
    h = group[5].hierarchy
    assert h.simulated and h.members == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert h.node.members == (4, 5, 6, 7) and h.cross.members == (1, 5)
    assert h.local_rank == 1 and h.num_nodes == 2 and hierarchy_of(group[5]) is h
    assert cm.params_for(h.node) == cm.Params(net.intra.latency, net.intra.bandwidth)
    assert cm.params_for(h.cross) == cm.Params(net.inter.latency, net.inter.bandwidth)

    def run(b):
        h = b.hierarchy
        if b.rank == 4:
            h.node.send(np.zeros(1000, np.uint8), 1)  # to rank 5, on node 1
        elif b.rank == 5:
            h.node.recv(np.zeros(1000, np.uint8), 0)
            h.cross.recv(np.zeros(1000, np.uint8), 0)  # from rank 1, on node 0
        elif b.rank == 1:
            h.cross.send(np.zeros(1000, np.uint8), 1)
        return b.clock

    clocks = run_threads(run, group)
    intra, inter = net.intra.time(1000), net.inter.time(1000)
    assert clocks[5] == pytest.approx(max(intra, inter))
    assert clocks[5] == pytest.approx(inter) and inter > intra
    # a real backend's hierarchy without an engine is still not used
    plain = SimpleNamespace(hierarchy=Hierarchy(h.node, h.cross, h.members))
    assert hierarchy_of(plain) is None
    for bad in (dict(network=None), dict(network=Network.cluster(ranks_per_node=8)),
                dict(network=Network.cluster(ranks_per_node=1)),
                dict(network=Network.cluster(ranks_per_node=3))):
        with pytest.raises(ValueError):
            SimulatedBackend.create_group(8, hierarchical=True, **bad)


LAYOUTS = [(label, L) for label in ("16 ranks/node", "4 ranks/node, 10 Gb/s")
           for L in (None, 2)]


@pytest.mark.parametrize("label,L", LAYOUTS)
def test_auto_with_a_layout_is_never_more_than_1_2x_the_models_best(label, L):
    """Flat or hierarchical, auto's pick against the best the model knows among the flat
    algorithms and the hierarchical stages; the same answer for the same size class."""
    p = cm.Params.of(NETWORKS[label])
    if L is not None:
        p = dataclasses.replace(p, ranks_per_node=L)
    L = p.ranks_per_node
    backend = SimpleNamespace(params=p)
    for n in sorted({2 * L, 4 * L, 8 * L, 16 * L, 256}):
        for nbytes in (8, 4096, 65536, 1 << 20, 16 << 20, 64 << 20):
            for name in cm.HIERARCHICAL:
                hier = cm.predict(name, "hierarchical", nbytes, n, p)
                if name == "barrier":
                    flat = cm.predict("barrier", "flat", 0, n, p)
                    picked = flat
                else:
                    flat = cm.best(name, nbytes, n, p)[1]
                    picked = cm.predict(name, choose(BY_NAME[name], None, nbytes, n, backend), nbytes,
                                        n, p)
                    if cm.gathers(name, nbytes, n, p):  # (a small call in the header's rounds)
                        flat = min(flat, cm.gathered_time(name, nbytes, n, p))
                        picked = cm.gathered_time(name, nbytes, n, p)
                staged = cm.choose_hierarchical(name, nbytes, n, p)
                assert staged == cm.choose_hierarchical(name, nbytes * 3 // 4 + 1, n, p)
                if staged:
                    picked = hier
                assert picked <= 1.2 * min(flat, hier), (label, name, n, nbytes, staged)


@pytest.mark.parametrize("nbytes", [4096, 1 << 20])
def test_auto_on_a_simulated_hierarchy_follows_the_model(nbytes):
    """auto on a simulated hierarchy takes the faster of flat and staged, as the model rates
    them (the virtual time shows it), and every rank gets the same bits."""
    net = NETWORKS["4 ranks/node, 10 Gb/s"]
    p = cm.Params.of(net)
    for name in ("allreduce", "reduce_scatter", "all_gather"):
        size = nbytes // 8 if name == "all_gather" else nbytes
        staged = cm.choose_hierarchical(name, size, 16, p)
        model = cm.predict(name, "hierarchical", size, 16, p) if staged \
            else cm.flat_time(name, size, 16, p)
        sim, _ = _simulate(net, 16, name, "hierarchical", size)
        assert sim == pytest.approx(model, rel=0.10), (name, staged)
        other, _ = _simulate(net, 16, name, "hierarchical", size, staged=not staged)
        assert sim <= other * 1.02, (name, staged, sim, other)

    group = SimulatedBackend.create_group(16, network=net, hierarchical=True)

    def run(b):
        x = np.random.default_rng(b.rank).standard_normal(nbytes // 4).astype(np.float32)
        return fc.allreduce(x, b).tobytes(), fc.reduce_scatter(x, b).tobytes()

    out = run_threads(run, group)
    assert len({a for a, _ in out}) == 1
    whole = np.frombuffer(out[0][0], np.float32)
    ref = np.sum([np.random.default_rng(r).standard_normal(nbytes // 4).astype(np.float32)
                  for r in range(16)], axis=0)
    np.testing.assert_allclose(whole, ref, rtol=1e-4, atol=1e-4)
    rows = nbytes // 4 // 16
    for r, (_, mine) in enumerate(out):
        np.testing.assert_allclose(np.frombuffer(mine, np.float32), ref[r * rows:(r + 1) * rows],
                                   rtol=1e-4, atol=1e-4)


def test_real_multi_node_jobs_always_run_the_stages():
    """A real job (an engine in each node) runs every collective staged whatever its size or
    layout (a mismatched call must fail as a mismatch on every rank, which needs every rank on
    one path); the model's engine estimate still rates the stages ahead for allreduce,
    broadcast and barrier on every layout it describes."""
    for L in (2, 4, 16):
        p = dataclasses.replace(cm.DEFAULT, ranks_per_node=L)
        for n in (2 * L, 8 * L, 256):
            for nbytes in (8, 4096, 1 << 20, 64 << 20):
                for name in ("allreduce", "broadcast", "barrier"):
                    assert cm.choose_hierarchical(name, nbytes, n, p, engine=True), \
                        (name, n, L, nbytes)
                real = SimpleNamespace(nodes=tuple(r // L for r in range(n)), world_size=n)
                h = SimpleNamespace(local_world=L, members=tuple(
                    tuple(range(k * L, (k + 1) * L)) for k in range(n // L)),
                    node=SimpleNamespace(engine=1))
                for name in ("allreduce", "broadcast", "all_gather", "reduce_scatter"):
                    assert prefer_hierarchical(
                        name, (np.dtype(np.float32), (nbytes // 4,)), real, h)
    # without an engine the model decides, for nodes that hold ranks far apart as for the same
    # layout with the ranks renamed (consecutive)
    for nbytes in (4096, 1 << 20, 64 << 20):
        header = (np.dtype(np.float32), (nbytes // 4,))
        for name in ("allreduce", "reduce_scatter", "all_gather"):
            answers = {prefer_hierarchical(name, header, SimpleNamespace(
                nodes=nodes, world_size=8), SimpleNamespace(
                local_world=2, members=members, node=SimpleNamespace(engine=None)))
                for nodes, members in ((tuple("aabbccdd"), ((0, 1), (2, 3), (4, 5), (6, 7))),
                                       (tuple("abcdabcd"), ((0, 4), (1, 5), (2, 6), (3, 7))))}
            assert len(answers) == 1, (name, nbytes)
    assert not cm.choose_hierarchical("allreduce", 1 << 20, 16, cm.DEFAULT)  # one node


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "star"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_flat_times_are_linear_in_the_fitted_terms(algorithm, n):
    """What scale_validate.py fits: on one kind of link a flat allreduce costs call +
    messages * alpha + bytes / beta + folded * gamma along its critical path."""
    p = cm.Params(37e-6, 0.9e9, gamma=0.3e-9, call=55e-6)
    for nbytes in (4096, 1 << 20):
        msgs, sent, folded = cm.terms("allreduce", algorithm, nbytes, n)
        assert msgs >= 1 and sent >= nbytes / n and folded >= 0
        want = p.call + msgs * p.alpha + sent / p.beta + folded * p.gamma
        assert cm.predict("allreduce", algorithm, nbytes, n, p) == pytest.approx(want, rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(2, 1), (2, 2), (4, 1), (4, 2), (3, 4)]),
       st.sampled_from([1 << 20, 16 << 20, 64 << 20]),
       st.sampled_from(["ring", "recursive_doubling", "star", "hierarchical_engine",
                        "hierarchical"]))
def test_a_shared_node_link_never_beats_the_link_bound(layout, nbytes, algorithm):
    """With each node's ranks sharing its link (a real NIC), no allreduce is predicted faster
    than the bound the link sets: every node must send out, and take in, 2 (N - 1) / N of the
    data. (Per-rank interfaces, as on the simulated network, predicted the hierarchy below it.)"""
    nodes, per_node = layout
    if algorithm.startswith("hierarchical") and per_node < 2:
        return
    beta = 125e6
    p = cm.Params(50e-6, beta, 0.5e-6, 10e9, per_node, shared_link=True)
    bound = 2 * (nodes - 1) / nodes * nbytes / beta
    assert cm.predict("allreduce", algorithm, nbytes, nodes * per_node, p) \
        >= bound * 0.999


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(2, 2), (4, 2), (2, 4), (3, 2)]),
       st.sampled_from([4 << 10, 1 << 20, 64 << 20]),
       st.sampled_from(["ring", "recursive_doubling", "star", "hierarchical_engine",
                        "hierarchical"]), st.booleans())
def test_a_layout_whose_nodes_hold_ranks_far_apart(layout, nbytes, algorithm, shared):
    """``node_of`` places the ranks: naming the consecutive layout changes nothing; dealing the
    ranks out node by node (rank r on node r % N) leaves the stages' time as it was (the same
    groups under other names) and makes every hop of the ring cross nodes."""
    nodes, per_node = layout
    n = nodes * per_node
    p = cm.Params(50e-6, 125e6, 0.5e-6, 10e9, per_node, shared_link=shared, gamma=1e-10)
    named = dataclasses.replace(p, node_of=tuple(r // per_node for r in range(n)))
    dealt = dataclasses.replace(p, node_of=tuple(r % nodes for r in range(n)))
    assert dealt.members(n) == [tuple(range(k, n, nodes)) for k in range(nodes)]
    t = cm.predict("allreduce", algorithm, nbytes, n, p)
    assert cm.predict("allreduce", algorithm, nbytes, n, named) == t
    if algorithm.startswith("hierarchical"):
        assert cm.predict("allreduce", algorithm, nbytes, n, dealt) == pytest.approx(t)
    elif algorithm == "ring" and shared and nbytes >= 1 << 20:
        # each node's link now carries every one of its ranks' hops, not one of them
        assert cm.predict("allreduce", "ring", nbytes, n, dealt) > 1.5 * t


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(2, 1), (2, 2), (4, 1), (4, 2)]),
       st.sampled_from([4 << 10, 64 << 10, 1 << 20, 16 << 20]),
       st.sampled_from(["ring", "recursive_doubling", "star", "hierarchical_engine"]),
       st.sampled_from([16e3, 125e3, 1e6]))
def test_a_token_bucket_saves_at_most_its_bursts(layout, nbytes, algorithm, burst):
    """A shaped link's burst (a token bucket, full when the call starts) makes no call slower
    and none faster than links that carry bytes in no time; a burst that holds every byte a
    link carries in the call makes it exactly that fast, where the call runs the same form on
    both (a cross stage decides whether to gather its small pieces in the header exchange's
    rounds, :mod:`ferro_collective.gathered`, on its link's rate, knowing no bucket, as the
    stage does when it runs: free bytes favour it)."""
    nodes, per_node = layout
    if algorithm.startswith("hierarchical") and per_node < 2:
        return
    beta = 125e6
    plain = cm.Params(50e-6, beta, 0.5e-6, 10e9, per_node, shared_link=True)
    shaped = dataclasses.replace(plain, burst=burst)
    n = nodes * per_node
    t_plain = cm.predict("allreduce", algorithm, nbytes, n, plain)
    t_shaped = cm.predict("allreduce", algorithm, nbytes, n, shaped)
    instant = dataclasses.replace(plain, beta=1e30)
    t_instant = cm.predict("allreduce", algorithm, nbytes, n, instant)
    assert t_instant * (1 - 1e-12) <= t_shaped <= t_plain * (1 + 1e-12)
    every_byte = dataclasses.replace(plain, burst=4.0 * nbytes * n)
    piece = -(-nbytes // per_node)  # (a cross stage's part of the call)
    if algorithm.startswith("hierarchical") and cm.gathers(
            "allreduce", piece, nodes, cm.Params(plain.alpha, plain.beta)) != cm.gathers(
            "allreduce", piece, nodes, cm.Params(instant.alpha, instant.beta)):
        return
    assert cm.predict("allreduce", algorithm, nbytes, n, every_byte) == \
        pytest.approx(t_instant, rel=1e-9)


def test_a_message_the_bucket_holds_costs_only_its_latency():
    """2 nodes, one exchange (recursive doubling, no header): after rest, a message within the
    burst pays the latency alone; a larger one pays its bytes beyond the burst at the rate."""
    alpha, beta = 1e-4, 125e6
    for burst, nbytes, want in ((128e3, 64 << 10, alpha),
                                (32e3, 64 << 10, alpha + ((64 << 10) - 32e3) / beta),
                                (0.0, 64 << 10, alpha + (64 << 10) / beta)):
        p = cm.Params(alpha, beta, shared_link=True, burst=burst)
        got = cm.predict("allreduce", "recursive_doubling", nbytes, 2, p, header=False)
        assert got == pytest.approx(want, rel=1e-9), burst


def test_the_engine_step_prices_each_node_stage():
    """A staged allreduce on nodes with engines has two node steps (the whole-call check
    rides in the first): pricing the engine step apart from the intra-node messages' latency
    moves the call by twice the difference; a broadcast, which checks its node on its own
    first, has two as well (the check and its node stage)."""
    p = cm.Params(2e-4, 125e6, 1e-6, 5e9, 2, shared_link=True)
    slow = dataclasses.replace(p, engine_step=3e-4)
    same = dataclasses.replace(p, engine_step=1e-6)
    base = cm.predict("allreduce", "hierarchical_engine", 4096, 8, p)
    assert cm.predict("allreduce", "hierarchical_engine", 4096, 8, same) == base
    assert cm.predict("allreduce", "hierarchical_engine", 4096, 8, slow) == \
        pytest.approx(base + 2 * (3e-4 - 1e-6), rel=1e-9)
    base = cm.predict("broadcast", "hierarchical_engine", 4096, 8, p)
    assert cm.predict("broadcast", "hierarchical_engine", 4096, 8, slow) == \
        pytest.approx(base + 2 * (3e-4 - 1e-6), rel=1e-9)


def test_shared_link_serializes_a_roots_incoming_messages():
    """A star's root takes in its n - 1 messages one after another through its own link."""
    n, nbytes, beta = 5, 1 << 20, 1e9
    shared = cm.Params(0.0, beta, shared_link=True)
    private = cm.Params(0.0, beta)
    t_shared = cm.predict("allreduce", "star", nbytes, n, shared, header=False)
    t_private = cm.predict("allreduce", "star", nbytes, n, private, header=False)
    # gather: n - 1 messages into the root, then n - 1 out of it, each nbytes / beta
    assert t_shared == pytest.approx(2 * (n - 1) * nbytes / beta, rel=1e-9)
    assert t_private == pytest.approx(n * nbytes / beta, rel=1e-9)  # gathers in parallel


@settings(max_examples=25, deadline=None)
@given(n=st.integers(16, 80), nbytes=st.integers(1, 1 << 26), net=st.sampled_from(list(NETWORKS)),
       L=st.sampled_from([None, 2, 4]), seed=st.integers(0, 1000),
       case=st.sampled_from([("allreduce", "ring"), ("all_gather", "ring"),
                             ("reduce_scatter", "ring")]))
def test_ring_as_arrays_times_every_rank_as_the_rounds_do(n, nbytes, net, L, seed, case):
    """The array form of a ring's rounds (from RING_ARRAYS_FROM ranks) gives every rank's
    clock and interface time equal, to the bit, to playing the rounds message by message."""
    from ferro_collective import message_schedule as sch

    p = cm.Params.of(NETWORKS[net])
    if L is not None:
        p = dataclasses.replace(p, ranks_per_node=L)
    start = list(np.random.default_rng(seed).random(n) * 1e-6)
    fast = sch.Schedule(p, start)
    sch.run(fast, *case, nbytes)
    slow = sch.Schedule(p, start)
    old = sch.RING_ARRAYS_FROM
    sch.RING_ARRAYS_FROM = 1 << 30
    try:
        sch.run(slow, *case, nbytes)
    finally:
        sch.RING_ARRAYS_FROM = old
    assert fast.clock == slow.clock and fast.nic == slow.nic
