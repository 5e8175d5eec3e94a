"""A member lost before or during the first ElasticState.sync() does not end the job: the
sync moves the survivors to the next generation as recover() does, and copies the state there
(the documented loop calls the first sync outside its try)."""

import numpy as np
import pytest

from ferro_backend.elastic import ElasticJob
from ferro_backend.launch.coordinator import Coordinator
from ferro_backend.testing import outcomes
from ferro_collective.elastic import ElasticState

TOKEN = "first-sync-test"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _tcp(monkeypatch):
    monkeypatch.setenv("FERRO_TRANSPORT", "tcp")


def test_a_member_lost_before_the_first_sync_leaves_the_survivors_synced():
    c = Coordinator(TOKEN, 2, 3, 3, settle=5.0)
    jobs = outcomes(lambda: ElasticJob(c.address, TOKEN, join_timeout=20), [()] * 3)
    jobs.sort(key=lambda j: j.rank)
    held = [{"w": np.full(4, j.rank, np.float64), "count": np.array(j.rank)} for j in jobs]
    states = [ElasticState(j, (lambda k=k: held[k]), (lambda s, k=k: held.__setitem__(k, s)))
              for k, j in enumerate(jobs)]
    try:
        jobs[0]._sock.close()            # rank 0, the first sync's source, dies at once
        jobs[0].backend.abort("killed right after joining")
        out = outcomes(lambda s: s.sync(), [(s,) for s in states[1:]])
        assert out == [None, None], out
        assert [j.world_size for j in jobs[1:]] == [2, 2]
        assert [j.generation for j in jobs[1:]] == [1, 1]
        np.testing.assert_array_equal(held[1]["w"], held[2]["w"])
        assert int(held[1]["count"]) == int(held[2]["count"])
        assert [s.step for s in states[1:]] == [0, 0]
        assert [[ch["world_size"] for ch in s.changes] for s in states[1:]] == [[2], [2]]
    finally:
        for j in jobs[1:]:
            j.close()
        c.close()
