"""Two SubBackends of the same members (and name) made one after the other are two groups, as
torch's ``new_group`` twice is: their messages never pair up, and one made after an aborted
subgroup is a fresh group that works."""

import numpy as np
import pytest

from ferro_backend import PeerAbortedError, SimulatedBackend, SubBackend
from ferro_backend.testing import run_ranks


def test_two_views_of_the_same_members_are_two_groups():
    def fn(b):
        g1, g2 = SubBackend(b, [0, 1]), SubBackend(b, [0, 1])
        assert g1.group_id != g2.group_id
        if b.rank == 0:
            g1.send(np.array([1], np.int64), 1)
            g2.send(np.array([2], np.int64), 1)
            return g1.group_id, g2.group_id
        a, c = np.zeros(1, np.int64), np.zeros(1, np.int64)
        g2.recv(c, 0)  # the other group first: it must not take g1's message
        g1.recv(a, 0)
        return int(a[0]), int(c[0]), g1.group_id, g2.group_id

    r0, r1 = run_ranks(fn, 2, timeout=30, backend_timeout=5)
    assert r1[:2] == (1, 2)
    assert r0 == r1[2:]  # the same ids on every member


def test_views_are_counted_per_members_name_and_parent():
    g = SimulatedBackend.create_group(3)
    a, named, other = SubBackend(g[0], [0, 1]), SubBackend(g[0], [0, 1], name="x"), \
        SubBackend(g[0], [0, 2])
    b = SubBackend(g[0], [0, 1])
    assert len({a.group_id, named.group_id, other.group_id, b.group_id}) == 4
    # the first of each is what it always was; another parent counts apart
    assert SubBackend(g[1], [0, 1]).group_id == a.group_id
    assert SubBackend(g[1], [0, 1], name="x").group_id == named.group_id
    assert SubBackend(a, [0, 1]).group_id != SubBackend(b, [0, 1]).group_id


def test_non_members_count_for_nothing():
    g = SimulatedBackend.create_group(3)
    with pytest.raises(Exception, match="not among the members"):
        SubBackend(g[2], [0, 1])
    # rank 2's failed attempt took no number: a later group with it keeps in step
    assert SubBackend(g[2], [0, 2]).group_id == SubBackend(g[0], [0, 2]).group_id


def test_a_new_view_after_an_aborted_one_is_a_fresh_group():
    def fn(b):
        dead = SubBackend(b, [0, 1])
        if b.rank == 0:
            dead.abort_group("gave up")
        else:
            with pytest.raises(PeerAbortedError):
                dead.recv(np.zeros(1), 0, timeout=10)
        fresh = SubBackend(b, [0, 1])
        if b.rank == 0:
            fresh.send(np.array([7.0]), 1)
            return None
        x = np.zeros(1)
        fresh.recv(x, 0, timeout=10)
        return float(x[0])

    assert run_ranks(fn, 2, timeout=30, backend_timeout=10) == [None, 7.0]
