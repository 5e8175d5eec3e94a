"""Programs that complete at once on gloo complete at once on "ferro" (2 ranks under ferrorun,
both backend kinds): isends that fill the peer's ring before it posts its receives, and an
async collective followed by point-to-point messages where the ranks fill the cores (the
collective is deferred, not run in the issuing call)."""

from pathlib import Path

import pytest
from _launch import ferrorun
from ferro_torch._compiled import BACKEND

SCRIPT = str(Path(__file__).with_name("workers_gloo_programs.py"))


def _ranks(scenario: str, kind: str, **env) -> dict[int, dict]:
    run = ferrorun(scenario, 2, timeout=120, script=SCRIPT, args=("--transport", "shm"),
                   env={BACKEND.name: kind, **env})
    assert run.returncodes == [0], run.output[-4000:]
    ranks = run.by_rank()
    assert sorted(ranks) == [0, 1] and all(r["kind"] == kind for r in ranks.values()), ranks
    return ranks


@pytest.mark.parametrize("kind", ["compiled", "python"])
def test_isends_that_fill_the_peers_ring_never_block_the_caller(kind):
    # 8 x 60 KiB each way before the receives (4 fill a ring): the first 4 isends returned,
    # each later one waited in the caller for room until the 10 s deadline, then failed
    for r in _ranks("flood", kind).values():
        for part in ("isend", "batch", "small"):
            assert r[part]["got"] is True, (part, r)
            assert r[part]["seconds"] < 5, (part, r)


@pytest.mark.parametrize("kind", ["compiled", "python"])
def test_an_async_collective_then_point_to_point_messages_complete_as_on_gloo(kind):
    # FERRO_BACKGROUND=off: async collectives in the caller's threads (as auto does where the
    # ranks fill the cores); rank 0's async all_reduce ran in the issuing call and waited for
    # rank 1, which waited for rank 0's send: a deadlock until the deadline
    ranks = _ranks("async_p2p", kind, FERRO_BACKGROUND="off")
    assert ranks[0]["send"]["got"] == [3.0, 3.0], ranks
    assert ranks[1]["send"]["got"] == [3.0, 3.0, 0.0, 1.0, 2.0], ranks
    assert ranks[0]["batch"]["got"] == [3.0, 3.0], ranks
    assert ranks[1]["batch"]["got"] == [3.0, 3.0, 0.0, 1.0, 2.0], ranks
    for r in ranks.values():
        assert r["send"]["seconds"] < 5 and r["batch"]["seconds"] < 5, r
    # Work.wait(timeout) on a deferred call raises within its timeout; a later wait completes it
    got = ranks[0]["wait_timeout"]["got"]
    # (5 s: room for a loaded host's stalls, still half the group's 10 s deadline)
    assert "Timed out" in got["raised"] and got["waited"] < 5.0, got
    assert got["value"] == [3.0, 3.0] and ranks[1]["wait_timeout"]["got"] == [3.0, 3.0], ranks
