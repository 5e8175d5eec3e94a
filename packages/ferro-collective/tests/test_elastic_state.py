"""ElasticState: the state of the most advanced member reaches every member of a new
generation (survivors after a failure, a newcomer taken in at a step boundary), nested states
of several dtypes travel whole, and the agreement on a newcomer is the same on every rank."""

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferro_backend.elastic import ElasticError, ElasticJob
from ferro_backend.launch.coordinator import Coordinator
from ferro_backend.testing import outcomes
from ferro_collective import allreduce
from ferro_collective.elastic import RECOVERABLE, ElasticState

TOKEN = "state-test"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _tcp(monkeypatch):
    monkeypatch.setenv("FERRO_TRANSPORT", "tcp")


class Holder:
    """One member's model-like state: arrays of two dtypes, nested, plus plain values."""

    def __init__(self, seed: int, shapes=((3, 4), (5,))):
        rng = np.random.default_rng(seed)
        self.state = {"params": [rng.standard_normal(s).astype(np.float32) for s in shapes],
                      "optim": {"count": np.array([seed], np.int64), "lr": 0.1 * (seed + 1),
                                "pair": (np.full(2, seed, np.float64), "tag")}}

    def capture(self):
        return self.state

    def restore(self, state):
        self.state = state


def assert_same(a, b):
    for x, y in zip(a["params"], b["params"], strict=True):
        np.testing.assert_array_equal(x, y)
        assert x.dtype == y.dtype
    np.testing.assert_array_equal(a["optim"]["count"], b["optim"]["count"])
    np.testing.assert_array_equal(a["optim"]["pair"][0], b["optim"]["pair"][0])
    assert a["optim"]["lr"] == b["optim"]["lr"] and a["optim"]["pair"][1] == "tag"


def start(n, min_members=1, max_members=None, settle=5.0, before_join=None):
    c = Coordinator(TOKEN, min_members, max_members or n + 1, n, settle=settle)
    jobs = outcomes(lambda: ElasticJob(c.address, TOKEN, join_timeout=20), [()] * n)
    jobs.sort(key=lambda j: j.member_id)
    holders = [Holder(seed=j.rank + 10) for j in jobs]
    states = [ElasticState(j, h.capture, h.restore, before_join=before_join)
              for j, h in zip(jobs, holders)]
    return c, jobs, holders, states


def test_sync_at_start_gives_everyone_rank_zeros_state():
    c, jobs, holders, states = start(3)
    try:
        assert outcomes(lambda s: s.sync(), [(s,) for s in states]) == [None] * 3
        for h in holders[1:]:
            assert_same(h.state, holders[0].state)
        assert all(s.step == 0 for s in states)
    finally:
        for j in jobs:
            j.close()
        c.close()


def test_recover_after_a_member_dies_continues_from_the_most_advanced_survivor():
    c, jobs, holders, states = start(3)
    try:
        outcomes(lambda s: s.sync(), [(s,) for s in states])
        jobs[0]._sock.close()            # member 0 dies (its connection closes)
        jobs[0].backend.abort("killed")
        states[1].step, states[2].step = 4, 5   # member 2 completed one more step
        holders[2].state["optim"]["count"][0] = 99
        err = RECOVERABLE[0]("rank 0 closed")
        assert outcomes(lambda s: s.recover(err), [(s,) for s in states[1:]]) == [None, None]
        assert [s.step for s in states[1:]] == [5, 5]
        assert_same(holders[1].state, holders[2].state)
        assert holders[1].state["optim"]["count"][0] == 99
        assert [j.world_size for j in jobs[1:]] == [2, 2]
        assert states[1].changes[-1]["reason"] == "a member failed"
        assert states[1].changes[-1]["seconds"] < 30
    finally:
        for j in jobs[1:]:
            j.close()
        c.close()


def test_a_newcomer_is_taken_in_at_the_same_step_on_every_member():
    saves = []   # before_join: on every member, over the old generation, before it is left
    c, jobs, holders, states = start(2, before_join=lambda b: saves.append(
        (b.rank, b.world_size, allreduce(np.ones(1), b)[0])))
    try:
        outcomes(lambda s: s.sync(), [(s,) for s in states])
        made = []

        def newcomer():
            job = ElasticJob(c.address, TOKEN, join_timeout=20)
            h = Holder(seed=77)
            s = ElasticState(job, h.capture, h.restore)
            assert s.step == -1          # holds nothing until it syncs
            s.sync()
            made.append((job, h, s))

        t = threading.Thread(target=newcomer)
        t.start()

        def train(s, steps):
            changed_at = []
            for k in range(1, steps + 1):
                if s.commit(k):
                    changed_at.append(k)
                if changed_at:
                    return changed_at
            return changed_at

        # the members commit steps until they agree on the newcomer (same step on both)
        out = outcomes(train, [(s, 100000) for s in states])
        t.join(30)
        assert out[0] == out[1] and len(out[0]) == 1, out
        (job, h, s) = made[0]
        assert s.step == states[0].step == out[0][0]
        assert_same(h.state, holders[0].state)
        assert [j.world_size for j in (*jobs, job)] == [3, 3, 3]
        assert sorted(saves) == [(0, 2, 2.0), (1, 2, 2.0)]   # a collective of the old two
    finally:
        for j in jobs:
            j.close()
        if made:
            made[0][0].close()
        c.close()


def test_below_the_minimum_recover_raises():
    c, jobs, holders, states = start(2, min_members=2, max_members=2, settle=0.5)
    try:
        outcomes(lambda s: s.sync(), [(s,) for s in states])
        jobs[0]._sock.close()
        jobs[0].backend.abort("killed")
        (out,) = outcomes(lambda s: s.recover(RECOVERABLE[0]("gone")), [(states[1],)])
        assert isinstance(out, ElasticError) and "minimum 2" in str(out)
    finally:
        c.close()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4)), min_size=0,
                       max_size=4))
def test_sync_carries_any_shapes(shapes):
    c, jobs, holders, states = start(2)
    try:
        holders[0].state["params"] = [np.arange(a * b, dtype=np.float32).reshape(a, b)
                                      for a, b in shapes]
        holders[1].state["params"] = []
        assert outcomes(lambda s: s.sync(), [(s,) for s in states]) == [None, None]
        assert_same(holders[1].state, holders[0].state)
    finally:
        for j in jobs:
            j.close()
        c.close()


def test_sync_carries_extension_dtypes_as_themselves():
    """bfloat16, float8 and int4 state arrives in its own dtype (their .str, '<V2' and '<V1',
    was sent: the newcomer got void arrays, and float8 and int4 shared one flat buffer)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    c, jobs, holders, states = start(2)
    try:
        dtypes = [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.int4, np.float32]
        holders[0].state["params"] = [np.arange(6).astype(d).reshape(2, 3) for d in dtypes]
        holders[1].state["params"] = []
        assert outcomes(lambda s: s.sync(), [(s,) for s in states]) == [None, None]
        assert [p.dtype for p in holders[1].state["params"]] == [np.dtype(d) for d in dtypes]
        assert_same(holders[1].state, holders[0].state)
    finally:
        for j in jobs:
            j.close()
        c.close()
