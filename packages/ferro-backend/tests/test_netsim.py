"""SimulatedBackend with a modelled network: virtual time per message (alpha-beta, the
sender's interface one message at a time), node layouts, deterministic whatever the threads do."""

import numpy as np
import pytest

from ferro_backend import SimulatedBackend
from ferro_backend.netsim import Link, Network
from ferro_backend.testing import run_threads

NET = Network(Link(10e-6, 1e9))  # 10 us, 1 GB/s


def test_one_message_costs_latency_plus_bytes_over_bandwidth():
    a, b = SimulatedBackend.create_group(2, network=NET)
    a.send(np.zeros(1000, np.uint8), 1)
    buf = np.empty(1000, np.uint8)
    b.recv(buf, 0)
    assert a.clock == 0.0  # sends do not wait
    assert b.clock == pytest.approx(10e-6 + 1000 / 1e9)


def test_the_senders_interface_sends_one_message_at_a_time():
    a, b, c = SimulatedBackend.create_group(3, network=NET)
    a.send(np.zeros(10_000, np.uint8), 1)
    a.send(np.zeros(10_000, np.uint8), 2)   # leaves after the first: 10 us later
    buf = np.empty(10_000, np.uint8)
    b.recv(buf, 0)
    c.irecv(buf, 0).wait(5)
    assert b.clock == pytest.approx(10e-6 + 10e-6)
    assert c.clock == pytest.approx(10e-6 + 20e-6)


def test_a_reply_departs_at_the_receivers_clock():
    a, b = SimulatedBackend.create_group(2, network=NET)
    buf = np.empty(8, np.uint8)
    for _ in range(3):  # ping-pong: each leg costs 10 us + 8 ns
        a.send(buf, 1)
        b.recv(buf, 0)
        b.send(buf, 0)
        a.recv(buf, 1)
    assert a.clock == pytest.approx(6 * (10e-6 + 8e-9))


def test_intra_node_links():
    net = Network(Link(10e-6, 1e9), Link(1e-6, 10e9), ranks_per_node=2)
    g = SimulatedBackend.create_group(4, network=net)
    assert g[0].nodes == ("node 0", "node 0", "node 1", "node 1")
    g[0].send(np.zeros(1000, np.uint8), 1)
    g[0].send(np.zeros(1000, np.uint8), 2)
    buf = np.empty(1000, np.uint8)
    g[1].recv(buf, 0)
    g[2].recv(buf, 0)
    assert g[1].clock == pytest.approx(1e-6 + 100e-9)
    assert g[2].clock == pytest.approx(100e-9 + 1e-6 + 10e-6)  # after the first left


def test_virtual_time_does_not_depend_on_thread_scheduling():
    """A ring of messages with random real delays: the same virtual clocks every run."""
    import random
    import time

    def ring(b, jitter):
        n, r = b.world_size, b.rank
        buf = np.zeros(4096 * (r + 1), np.uint8)
        for step in range(5):
            if jitter:
                time.sleep(random.random() * 0.002)
            req = b.irecv(np.empty(4096 * ((r - 1) % n + 1), np.uint8), (r - 1) % n, tag=step)
            b.send(buf, (r + 1) % n, tag=step)
            req.wait(10)
        return b.clock

    first = run_threads(lambda b: ring(b, False), SimulatedBackend.create_group(5, network=NET))
    for _ in range(3):
        again = run_threads(lambda b: ring(b, True),
                            SimulatedBackend.create_group(5, network=NET))
        assert again == first
    assert all(c > 0 for c in first)


def test_cluster_model_and_errors():
    net = Network.cluster(gbit=25, latency_us=5, ranks_per_node=16)
    assert net.link(0, 15) is net.intra and net.link(0, 16) is net.inter
    assert net.inter.bandwidth == pytest.approx(25e9 / 8)
    with pytest.raises(ValueError, match="latency"):
        Link(-1.0, 1e9)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        Link(1e-6, 0)
    with pytest.raises(ValueError, match="ranks_per_node"):
        Network(Link(1e-6, 1e9), ranks_per_node=0)
    (b,) = SimulatedBackend.create_group(1)
    assert b.clock == 0.0  # no network: no virtual time
