"""ferrorun's elastic watch (``ElasticRun``) and its coordinator, racing each other: the
coordinator's thread against ferrorun's main thread, which polls its processes every 50 ms
(the end to end tests: examples/tests/test_train_elastic.py)."""

import subprocess
import sys
import threading
import time

import pytest

from ferro_backend.elastic import ElasticError, ElasticJob
from ferro_backend.launch import elastic_run
from ferro_backend.launch.coordinator import Coordinator
from ferro_backend.testing import outcomes

TOKEN = "elastic-watch-test-token"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _tcp(monkeypatch):
    monkeypatch.setenv("FERRO_TRANSPORT", "tcp")


class _Looked:
    """An agent's ``unseen_deaths``: True until the test says the agent looked; counts the
    coordinator's questions."""

    def __init__(self) -> None:
        self.looked, self.asked = threading.Event(), threading.Event()

    def __call__(self) -> bool:
        self.asked.set()
        return not self.looked.is_set()


def _lose_one_of_three(looked: _Looked):
    c = Coordinator(TOKEN, 3, 3, 3, settle=0.3, join_deadline=20, unseen_deaths=looked)
    jobs = outcomes(lambda: ElasticJob(c.address, TOKEN, join_timeout=20), [()] * 3)
    jobs = sorted(jobs, key=lambda j: j.member_id)
    jobs[0]._sock.close()   # what a SIGKILL does to its connection
    jobs[0].backend.abort("killed")
    out = []
    survivors = threading.Thread(target=lambda: out.extend(
        outcomes(lambda j: j.rebuild(4, "peer died"), [(j,) for j in jobs[1:]])))
    survivors.start()
    # the coordinator asks only once the survivors are ready and --settle has passed: the job
    # would end here without the question
    assert looked.asked.wait(30), "the coordinator never asked about unseen deaths"
    assert c.snapshot()["failed"] is None
    return c, jobs, survivors, out


def test_below_the_minimum_the_coordinator_waits_for_the_agent_to_see_the_death():
    # past --settle, the agent (ferrorun's main thread, starved) has not looked at its dead
    # process yet: the job waits; the agent then announces a replacement, which is taken in
    looked = _Looked()
    c, jobs, survivors, out = _lose_one_of_three(looked)
    try:
        c.expect()   # what ferrorun does once it sees the death (then marks it handled)
        looked.looked.set()
        new = ElasticJob(c.address, TOKEN, join_timeout=20)
        survivors.join(30)
        assert out == [None, None], out
        assert [j.world_size for j in (*jobs[1:], new)] == [3, 3, 3]
        for j in (*jobs[1:], new):
            j.close()
    finally:
        c.close()


def test_below_the_minimum_the_job_ends_once_the_agent_saw_the_death_and_starts_nobody():
    looked = _Looked()
    c, jobs, survivors, out = _lose_one_of_three(looked)
    try:
        looked.looked.set()   # ferrorun saw it: no replacement left (no expect())
        survivors.join(30)
        assert len(out) == 2 and all(isinstance(e, ElasticError)
                                     and "fewer than the minimum 3" in str(e) for e in out), out
    finally:
        c.close()


def test_an_ended_process_is_unseen_until_the_watch_handled_it():
    # (from the coordinator's thread: without reaping it, which would take _watch's exit code)
    procs = [subprocess.Popen([sys.executable, "-c", "pass"]),
             subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]
    try:
        run = object.__new__(elastic_run.ElasticRun)
        run.jobs = [_FakeJob(p) for p in procs]
        run.handled = set()
        deadline = time.monotonic() + 30
        while not elastic_run._has_ended(procs[0]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert elastic_run._has_ended(procs[0]) and procs[0].returncode is None
        assert not elastic_run._has_ended(procs[1])
        assert run._unseen_death()
        run.handled.add(0)
        assert not run._unseen_death()
        assert procs[0].poll() == 0   # still the watch's to reap
    finally:
        procs[1].kill()
        for p in procs:
            p.wait(30)


class _FakeProc:
    def __init__(self, code: int) -> None:
        self.returncode, self.pid = code, 0

    def poll(self) -> int:
        return self.returncode


class _FakeJob:
    def __init__(self, proc, rank: int = 0) -> None:
        self.procs, self.ranks = [proc], [rank]

    def kill_overdue(self) -> None:
        pass

    def finish_output(self) -> None:
        pass


class _FailsAfterTheFirstLook:
    """A coordinator whose first snapshot (the top of _watch's turn) shows the job going on,
    and every later one the job failed: it failed the job and the survivors then exited, all
    between that snapshot and the turn's look at the processes."""

    def __init__(self) -> None:
        self.looks = 0

    def snapshot(self) -> dict:
        self.looks += 1
        failed = None if self.looks == 1 else "2 members left, fewer than the minimum 3"
        return {"generation": 0, "failed": failed, "finished": False, "history": [],
                "members": {}}


def test_a_job_failed_after_the_turns_snapshot_is_named_when_every_process_has_ended(capsys):
    run = object.__new__(elastic_run.ElasticRun)
    run.coordinator = _FailsAfterTheFirstLook()
    run.jobs = [_FakeJob(_FakeProc(-9), 1000), _FakeJob(_FakeProc(1), 1001),
                _FakeJob(_FakeProc(1), 1002)]
    run.handled, run.ended, run.stopped_since = set(), set(), {}
    run.local_of, run.replacements_left, run.settle = [0, 1, 2], 0, 1.0
    assert run._watch([]) == 1
    err = capsys.readouterr().err
    assert ("ferrorun: the elastic job cannot go on: 2 members left, fewer than the minimum 3"
            in err), err
    assert "no member said the elastic job was done" not in err, err
