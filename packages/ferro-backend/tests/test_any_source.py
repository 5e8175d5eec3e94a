"""Receives from any rank (Backend.irecv_any / recv_any): the conformance kit on every ferro
transport, subgroups, posting order under hypothesis, and a clear error where unsupported."""

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_conformance import _socket_group

from ferro_backend import Backend, ShmBackend, SimulatedBackend, SubBackend, TcpBackend
from ferro_backend.netsim import Link, Network
from ferro_backend.testing import check_any_source, run_threads

pytestmark = pytest.mark.timeout(180)


def test_simulated_passes_the_kit():
    check_any_source(SimulatedBackend.create_group, world_sizes=(2, 3, 4))


@pytest.mark.parametrize("cls", [TcpBackend, ShmBackend])
def test_socket_backends_pass_the_kit(cls):
    check_any_source(_socket_group(cls), world_sizes=(3,))


def test_lazy_tcp_mesh_passes_the_kit(monkeypatch):
    """Connections made on first use: a receive from any rank opens none, the senders do."""
    monkeypatch.setenv("FERRO_TCP_CONNECT", "lazy")
    check_any_source(_socket_group(TcpBackend), world_sizes=(3,))


def test_a_subgroup_names_its_own_ranks_and_never_takes_the_parents_messages():
    def body(b):
        if b.rank == 0:
            b.send(b"parent", 1, tag=4)  # same tag, the parent's stream: not the subgroup's
            return None
        sub = SubBackend(b, [1, 2, 3])
        if sub.rank == 0:
            got = []
            for _ in range(2):
                out = bytearray(3)
                req = sub.irecv_any(out, tag=4)
                req.wait(20)
                got.append((req.source, bytes(out)))
            parent = bytearray(6)
            b.recv(parent, 0, tag=4, timeout=20)
            named = sub.irecv(bytearray(3), 1, tag=5)
            named.wait(20)
            return sorted(got), bytes(parent), named.source
        if sub.rank == 1:
            sub.send(b"abc", 0, tag=5)
        sub.send(bytes([sub.rank]) * 3, 0, tag=4)
        return None

    res = run_threads(body, SimulatedBackend.create_group(4), timeout=60)
    assert res[1] == ([(1, b"\x01" * 3), (2, b"\x02" * 3)], b"parent", 1)


def test_transports_without_it_say_so():
    class Minimal(Backend):
        rank, world_size = 0, 2

        def send(self, data, dst, *, tag=0):
            pass

        def recv(self, out, src, *, tag=0, timeout=None):
            pass

        def close(self):
            pass

    with pytest.raises(NotImplementedError, match="Minimal does not receive from any source"):
        Minimal().recv_any(bytearray(1))
    group = SimulatedBackend.create_group(2, network=Network(Link(10e-6, 1e9)))
    with pytest.raises(NotImplementedError, match="network model"):
        group[0].irecv_any(bytearray(1))


def test_bad_tags_are_refused():
    b0, b1 = SimulatedBackend.create_group(2)
    for tag in (-1, 2**64):
        with pytest.raises(ValueError, match="tag"):
            b0.irecv_any(bytearray(1), tag=tag)


@settings(max_examples=25, deadline=None)
@given(world=st.integers(2, 4), data=st.data())
def test_posted_first_matches_first_and_every_sender_stays_in_order(world, data):
    """Rank 0 posts, before anything is sent, receives from named ranks and from any rank in
    a drawn order; then the senders send. A message goes to the first receive posted for its
    sender or for any rank: every receive completes, each sender's messages are taken in its
    order, and the receives named for a rank posted before any "any" get its first ones."""
    counts = data.draw(st.lists(st.integers(0, 4), min_size=world - 1, max_size=world - 1))
    plan = [("from", r + 1) for r, c in enumerate(counts) for _ in range(c)]
    plan += [("any", None)] * data.draw(st.integers(0, 3))
    plan = data.draw(st.permutations(plan))
    # each sender sends a message per receive named for it plus one per "any" (any of them may
    # take any sender's: the named receives behind it must still find theirs); the rest stay
    # queued
    anys = sum(1 for kind, _ in plan if kind == "any")
    sends = {r: counts[r - 1] + anys for r in range(1, world)}
    go = threading.Barrier(world)

    def body(b):
        if b.rank == 0:
            posted = []
            for kind, src in plan:
                out = np.empty(1, np.int64)
                req = b.irecv_any(out, tag=1) if kind == "any" else b.irecv(out, src, tag=1)
                posted.append((kind, src, req, out))
            go.wait(20)
            got = []
            for kind, src, req, out in posted:
                req.wait(20)
                source = req.source if kind == "any" else src
                got.append((kind, source, int(out[0])))
            return got
        go.wait(20)
        for i in range(sends[b.rank]):
            b.send(np.array([b.rank * 1000 + i], np.int64), 0, tag=1)
        return None

    got = run_threads(body, SimulatedBackend.create_group(world), timeout=60)[0]
    per_sender: dict[int, list[int]] = {}
    for _kind, source, value in got:
        assert value // 1000 == source, (source, value)
        per_sender.setdefault(source, []).append(value % 1000)
    # every message at most once, each sender's taken in order across both kinds of receive
    # (what was taken from a sender is its first messages) ...
    for s, values in per_sender.items():
        assert values == list(range(len(values))), (s, values)
    assert sum(map(len, per_sender.values())) == len(plan)
    # ... and the named receives posted before any "any" for that sender took the first ones
    for s in range(1, world):
        named_first = []
        for kind, src in plan:
            if kind == "any":
                break
            if src == s:
                named_first.append(len(named_first))
        mine = [v % 1000 for kind, source, v in got if kind == "from" and source == s]
        assert mine[:len(named_first)] == named_first


@pytest.mark.parametrize("cls", [SimulatedBackend, TcpBackend, ShmBackend])
def test_a_receive_from_a_named_rank_names_it_too(cls):
    make = SimulatedBackend.create_group if cls is SimulatedBackend else _socket_group(cls)

    def body(b):
        if b.rank == 1:
            b.send(b"x", 0, tag=2)
            return None
        req = b.irecv(bytearray(1), 1, tag=2)
        req.wait(20)
        return req.source

    group = make(2)
    try:
        assert run_threads(body, group, timeout=60)[0] == 1
    finally:
        for b in group:
            b.close()
