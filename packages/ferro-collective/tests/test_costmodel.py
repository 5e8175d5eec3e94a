"""The cost model against the simulated network (virtual time), and "auto" against the model."""

from types import SimpleNamespace

import numpy as np
import pytest

import ferro_collective as fc
from ferro_backend import SimulatedBackend
from ferro_backend.netsim import Link, Network
from ferro_backend.testing import run_threads
from ferro_collective import costmodel as cm
from ferro_collective.call import choose

NETWORKS = {
    "flat 25 Gb/s": Network.cluster(gbit=25, latency_us=5),
    "16 ranks/node": Network.cluster(gbit=25, latency_us=5, ranks_per_node=16),
    "4 ranks/node, 10 Gb/s": Network.cluster(gbit=10, latency_us=20, ranks_per_node=4),
}


def _simulate(net, n, name, algorithm, nbytes):
    """Virtual seconds of one call on a simulated group (the slowest rank's clock)."""
    group = SimulatedBackend.create_group(n, network=net, timeout=120)
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
        else:
            fc.reduce_scatter(x, b, algorithm=algorithm)
        return b.clock

    return max(run_threads(run, group, timeout=120)), x.nbytes


CASES = [(label, n, nbytes) for label in NETWORKS for n in (8, 12, 64)
         for nbytes in (4096, 1 << 18 if n == 64 else 1 << 20)] + [("16 ranks/node", 256, 4096)]


@pytest.mark.parametrize("label,n,nbytes", CASES)
def test_model_agrees_with_the_simulated_network(label, n, nbytes):
    net = NETWORKS[label]
    p = cm.Params.of(net)
    for name, algorithms in cm.ALGORITHMS_MODELLED.items():
        for algorithm in algorithms:
            if n == 256 and (name, algorithm) not in {("allreduce", "recursive_doubling"),
                                                      ("broadcast", "tree"),
                                                      ("reduce_scatter", "ring")}:
                continue  # the slow ones to simulate at 256 threads: 8-64 ranks cover them
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
                picked = choose(name, None, nbytes, n, backend)
                _, fastest = cm.best(name, nbytes, n, p)
                assert cm.predict(name, picked, nbytes, n, p) <= 1.2 * fastest, \
                    (label, name, n, nbytes, picked)


def test_auto_is_a_function_of_size_and_world():
    picks = {choose("allreduce", None, s, n) for n in (64,) for s in [1 << 20] * 5}
    assert len(picks) == 1
    assert choose("allreduce", None, 3000, 64) == choose("allreduce", None, 4096, 64)


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
    irregular = cm.params_for(SimpleNamespace(nodes=("a", "b", "a", "b")))
    assert irregular.intra_alpha is None  # every link counted as between nodes


def test_model_errors():
    with pytest.raises(ValueError, match="no model"):
        cm.predict("allreduce", "bogus", 10, 4)
    assert cm.predict("allreduce", "ring", 10, 1) == 0.0
