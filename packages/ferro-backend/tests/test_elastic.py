"""Elastic membership: the coordinator's quorum, fencing, newcomers and refusals, with members
as threads over TCP (the ferrorun end to end test is examples/tests/test_train_elastic.py)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from ferro_backend.elastic import ElasticError, ElasticJob, JobFinishedError, join
from ferro_backend.launch.coordinator import MAX_LINE, Coordinator, announce_replacement
from ferro_backend.launch.elastic_run import parse_range
from ferro_backend.testing import outcomes

TOKEN = "elastic-test-token"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _tcp(monkeypatch):
    monkeypatch.setenv("FERRO_TRANSPORT", "tcp")


@pytest.fixture
def coordinator():
    made = []

    def make(min_members, max_members, expected, **kw):
        c = Coordinator(TOKEN, min_members, max_members, expected, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def members(c, n):
    jobs = outcomes(lambda: ElasticJob(c.address, TOKEN, join_timeout=20), [()] * n)
    for j in jobs:
        assert isinstance(j, ElasticJob), j
    return sorted(jobs, key=lambda j: j.member_id)


def close_all(jobs):
    for j in jobs:
        j.close()


def test_the_first_generation_forms_when_everyone_expected_is_here(coordinator):
    c = coordinator(2, 3, 3)
    jobs = members(c, 3)
    assert [(j.rank, j.world_size, j.generation) for j in jobs] == [(0, 3, 0), (1, 3, 0),
                                                                    (2, 3, 0)]
    assert all(j.step == -1 and j.source is None for j in jobs)
    assert c.snapshot()["history"][0]["reason"] == "start"
    close_all(jobs)


def test_last_call_forms_with_the_minimum_when_the_rest_never_come(coordinator):
    c = coordinator(2, 4, 4, last_call=0.5)
    t0 = time.monotonic()
    jobs = members(c, 2)
    assert 0.4 < time.monotonic() - t0 < 10
    assert [j.world_size for j in jobs] == [2, 2]
    close_all(jobs)


def test_survivors_form_the_next_generation_from_the_most_advanced_step(coordinator):
    c = coordinator(2, 3, 3)
    jobs = members(c, 3)
    victim = jobs[1]
    victim._sock.close()   # what a SIGKILL does to its connection
    victim.backend.abort("killed by the test")
    survivors = [jobs[0], jobs[2]]
    steps = {jobs[0].member_id: 6, jobs[2].member_id: 7}
    out = outcomes(lambda j: j.rebuild(steps[j.member_id], "a peer died"),
                     [(j,) for j in survivors])
    assert out == [None, None], out
    assert [(j.rank, j.world_size, j.generation) for j in survivors] == [(0, 2, 1), (1, 2, 1)]
    assert all(j.step == 7 and j.source == 1 for j in survivors)
    # the new backend works
    survivors[0].backend.send(b"hi", 1)
    buf = bytearray(2)
    survivors[1].backend.recv(buf, 0, timeout=10)
    assert bytes(buf) == b"hi"
    assert c.snapshot()["history"][-1]["reason"] == "a member failed"
    close_all(survivors)


def test_a_member_lost_while_the_next_generation_forms_is_left_behind(coordinator, monkeypatch):
    """A member dies inside the next generation's rendezvous: the others' rendezvous fails,
    they tell the coordinator they are ready again and the generation after forms without it
    (0.3: their rendezvous error ended their processes, and the job with them)."""
    from ferro_backend import elastic

    c = coordinator(2, 3, 3)
    jobs = sorted(outcomes(lambda: ElasticJob(c.address, TOKEN, join_timeout=30, timeout=3),
                           [()] * 3), key=lambda j: j.member_id)
    victim, real_build, local = jobs[2], elastic.build, threading.local()

    class Died(BaseException):
        pass

    def build(*args, **kwargs):
        if getattr(local, "victim", False):  # dies with the generation's message in hand
            victim._sock.close()
            raise Died
        return real_build(*args, **kwargs)

    def rebuild(job):
        local.victim = job is victim
        try:
            job.rebuild(5, "a peer died")
        except Died:
            return "died"
        return (job.world_size, job.generation)

    monkeypatch.setattr(elastic, "build", build)
    assert outcomes(rebuild, [(j,) for j in jobs]) == [(2, 2), (2, 2), "died"]
    survivors = jobs[:2]
    survivors[0].backend.send(b"ok", 1)
    buf = bytearray(2)
    survivors[1].backend.recv(buf, 0, timeout=10)
    assert bytes(buf) == b"ok"
    close_all(survivors)


def test_a_newcomer_is_announced_then_taken_in_with_the_state_source(coordinator):
    c = coordinator(1, 3, 2)
    jobs = members(c, 2)
    joined = []
    t = threading.Thread(target=lambda: joined.append(ElasticJob(c.address, TOKEN, join_timeout=20)))
    t.start()
    deadline = time.monotonic() + 20
    while not all(j.pending() for j in jobs):
        assert time.monotonic() < deadline, "the members never heard of the newcomer"
        time.sleep(0.01)
    assert outcomes(lambda j: j.rebuild(42), [(j,) for j in jobs]) == [None, None]
    t.join(20)
    (new,) = joined
    assert [j.world_size for j in (*jobs, new)] == [3, 3, 3]
    assert new.rank == 2 and new.step == 42 and new.source == 0
    assert not any(j.pending() for j in jobs)   # the announcement is consumed
    close_all([*jobs, new])


def test_a_silent_member_is_fenced_after_the_settle_time(coordinator):
    c = coordinator(1, 3, 3, settle=0.5)
    jobs = members(c, 3)
    silent = jobs[2]   # stopped: its connection stays open, it never reports
    t0 = time.monotonic()
    assert outcomes(lambda j: j.rebuild(3, "timed out"), [(j,) for j in jobs[:2]]) == [None,
                                                                                        None]
    assert 0.4 < time.monotonic() - t0 < 15
    assert [j.world_size for j in jobs[:2]] == [2, 2]
    with pytest.raises(ElasticError, match="fenced"):
        silent.rebuild(3)
    close_all(jobs)


def test_fewer_than_the_minimum_fails_every_survivor(coordinator):
    c = coordinator(3, 3, 3, settle=0.5)
    jobs = members(c, 3)
    jobs[0]._sock.close()
    jobs[0].backend.abort("killed")
    out = outcomes(lambda j: j.rebuild(1, "peer died"), [(j,) for j in jobs[1:]])
    assert all(isinstance(e, ElasticError) and "fewer than the minimum 3" in str(e)
               for e in out), out
    assert "fewer than the minimum" in c.snapshot()["failed"]


def test_below_the_minimum_a_replacement_within_the_settle_time_saves_the_job(coordinator):
    c = coordinator(3, 3, 3, settle=10)
    jobs = members(c, 3)
    jobs[0]._sock.close()
    jobs[0].backend.abort("killed")
    out = []
    survivors = threading.Thread(target=lambda: out.extend(
        outcomes(lambda j: j.rebuild(4, "peer died"), [(j,) for j in jobs[1:]])))
    survivors.start()
    time.sleep(0.5)   # the survivors wait: 2 < 3, but a replacement comes
    new = ElasticJob(c.address, TOKEN, join_timeout=20)
    survivors.join(30)
    assert out == [None, None], out
    assert [j.world_size for j in (*jobs[1:], new)] == [3, 3, 3]
    assert new.rank == 2 and new.step == 4 and new.source == 0
    close_all([*jobs[1:], new])


def test_below_the_minimum_an_announced_replacement_is_waited_for_past_the_settle_time(
        coordinator):
    # settle 0.3 s: alone it would end the job; the agent said a replacement is coming (from
    # another node, over the protocol), so the survivors wait for it up to the join deadline
    c = coordinator(3, 3, 3, settle=0.3, join_deadline=20)
    jobs = members(c, 3)
    jobs[0]._sock.close()
    jobs[0].backend.abort("killed")
    announce_replacement(c.address, TOKEN)
    out = []
    survivors = threading.Thread(target=lambda: out.extend(
        outcomes(lambda j: j.rebuild(4, "peer died"), [(j,) for j in jobs[1:]])))
    survivors.start()
    time.sleep(1.5)  # five settle times: the replacement is still importing
    assert c.snapshot()["failed"] is None
    new = ElasticJob(c.address, TOKEN, join_timeout=20)
    survivors.join(30)
    assert out == [None, None], out
    assert [j.world_size for j in (*jobs[1:], new)] == [3, 3, 3]
    close_all([*jobs[1:], new])


def test_an_announced_replacement_that_never_comes_ends_the_job_at_the_join_deadline(
        coordinator):
    c = coordinator(3, 3, 3, settle=0.3, join_deadline=2.0)
    jobs = members(c, 3)
    # the join deadline runs from expect(): timed from there (a start taken after the close
    # and abort below, which a loaded host may stall, leaves less than the deadline to see)
    start = time.monotonic()
    c.expect()  # (node 0's agent: in process)
    jobs[0]._sock.close()
    jobs[0].backend.abort("killed")
    out = outcomes(lambda j: j.rebuild(1, "peer died"), [(j,) for j in jobs[1:]])
    assert all(isinstance(e, ElasticError) and "fewer than the minimum 3" in str(e)
               for e in out), out
    assert 1.5 < time.monotonic() - start < 10  # the join deadline, not the settle time


def test_an_announcement_with_a_wrong_token_is_refused(coordinator):
    c = coordinator(1, 1, 1)
    with pytest.raises(OSError, match="authentication failed"):
        announce_replacement(c.address, "not the token")
    assert c._coming == []


def test_a_wrong_token_is_refused(coordinator):
    c = coordinator(1, 1, 1)
    with pytest.raises(ElasticError, match="authentication failed"):
        ElasticJob(c.address, "not the token", join_timeout=10)


def test_a_newcomer_after_the_job_finished_has_nothing_to_do(coordinator):
    c = coordinator(1, 2, 1)
    (job,) = members(c, 1)
    job.close()
    with pytest.raises(JobFinishedError, match="finished"):
        ElasticJob(c.address, TOKEN, join_timeout=10)


def test_an_over_long_line_costs_the_sender_its_connection(coordinator):
    c = coordinator(1, 1, 1)
    with socket.create_connection(c.address.rsplit(":", 1)) as s:  # type: ignore[arg-type]
        s.settimeout(10)
        s.recv(1024)   # the challenge
        try:
            s.sendall(b"x" * (MAX_LINE + 10))
        except OSError:
            pass
        assert s.recv(1024) == b""   # closed by the coordinator
    (job,) = members(c, 1)   # and the coordinator still serves
    job.close()


def test_join_outside_an_elastic_job_says_how_to_start_one(monkeypatch):
    monkeypatch.delenv("FERRO_ELASTIC", raising=False)
    with pytest.raises(ElasticError, match="ferrorun --nproc MIN:MAX"):
        join()


def test_unreachable_coordinator_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ElasticError, match="cannot reach"):
        ElasticJob(f"127.0.0.1:{port}", TOKEN, join_timeout=2)


@pytest.mark.parametrize("raw, expected", [("4", (4, 4)), ("2:4", (2, 4)), ("3:3", (3, 3))])
def test_parse_range(raw, expected):
    assert parse_range(raw, "--nproc") == expected


@pytest.mark.parametrize("raw", ["0", "4:2", "a:b", "1:", ""])
def test_parse_range_rejects(raw):
    with pytest.raises(ValueError, match="--nproc"):
        parse_range(raw, "--nproc")


def test_join_from_the_environment_with_a_backend_timeout(coordinator, monkeypatch):
    c = coordinator(1, 1, 1)
    monkeypatch.setenv("FERRO_ELASTIC", c.address)
    monkeypatch.setenv("FERRO_TOKEN", TOKEN)
    monkeypatch.setenv("FERRO_TIMEOUT", "5")   # the backends' deadline, not the join's
    monkeypatch.setenv("FERRO_ELASTIC_TIMEOUT", "20")
    job = join()
    try:
        assert job.world_size == 1 and job.backend.timeout == 5.0
    finally:
        job.close()


def test_a_silent_coordinator_is_named_at_the_members_deadline():
    """A coordinator whose host is stopped accepts connections (the kernel does) and says
    nothing: the member ends at its deadline with the error that names it."""
    from ferro_backend.launch.elastic_run import elastic_timeout

    lsock = socket.create_server(("127.0.0.1", 0))
    try:
        port = lsock.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ElasticError, match=r"no 'challenge' from the coordinator at "
                                               r"127\.0\.0\.1 in 0\.5 s .*stopped or unreachable"):
            ElasticJob(f"127.0.0.1:{port}", TOKEN, join_timeout=0.5)
        assert time.monotonic() - t0 < 5
    finally:
        lsock.close()
    # ferrorun gives its ranks a deadline that covers the coordinator's own waits
    assert elastic_timeout(3.0, 60.0, 2.0) == 75.0 and elastic_timeout(3.0, 60.0, None) == 73.0


# ---- ferrorun --nproc MIN:MAX, end to end ----

FERRORUN = [sys.executable, "-m", "ferro_backend.launch"]

JOINS = """
import os, sys
from ferro_backend import elastic
job = elastic.join()
job.backend.barrier()
print("member", job.member_id, "rank", job.rank, "of", job.world_size, flush=True)
# no job.close(): the README's outline of the loop never calls it
"""


def _ferrorun(tmp_path, body, *args):
    script = tmp_path / "job.py"
    script.write_text(body)
    return subprocess.run([*FERRORUN, "--nproc", "2:2", "--settle", "2", *args, str(script)],
                          capture_output=True, text=True, timeout=90)


@pytest.mark.parametrize("body", [JOINS, "print('never joins', flush=True)\n"],
                         ids=["joins", "never-joins"])
def test_an_elastic_job_whose_processes_all_exit_0_exits_0(tmp_path, body):
    """Every process exited 0, without ElasticJob.close(): the job succeeded (as torchrun
    says), not "cannot go on: every member of generation 0 is gone" and exit code 1."""
    r = _ferrorun(tmp_path, body)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cannot go on" not in r.stderr and "no member said" not in r.stderr, r.stderr
    assert r.stdout.count("member ") == 2 or r.stdout.count("never joins") == 2, r.stdout


def test_an_elastic_job_with_a_failed_process_and_no_done_says_why_it_fails(tmp_path):
    r = _ferrorun(tmp_path, "import os, sys\nsys.exit(3 if os.environ['LOCAL_RANK'] == '1' "
                  "else 0)\n")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "no member said the elastic job was done (ElasticJob.close())" in r.stderr, r.stderr


def test_elastic_output_is_prefixed_with_the_process_not_a_rank(tmp_path):
    """The prefix numbers the processes ferrorun started (a rank changes with each generation):
    it says ``proc``, not ``rank``, and each line's number is its process's own."""
    r = _ferrorun(tmp_path, "import os\nprint('local', os.environ['LOCAL_RANK'], flush=True)\n")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(r.stdout.splitlines()) == ["[proc 0] local 0", "[proc 1] local 1"]
    assert "[rank" not in r.stdout + r.stderr


# A member that stops itself (SIGSTOP: hung, not dead) once the job has formed; the others go
# on, and say the job is done or not (SAY_DONE). Every process writes its pid, for the clean-up.
STOPS = """
import os, signal, sys, time
from ferro_backend import elastic
with open(os.path.join(os.environ["PIDS"], str(os.getpid())), "w"):
    pass
job = elastic.join()
job.backend.barrier()
if os.environ["LOCAL_RANK"] == "2":
    os.kill(os.getpid(), signal.SIGSTOP)
    print("continued", flush=True)
    sys.exit(0)
time.sleep(0.5)
if os.environ["SAY_DONE"] == "1":
    job.close()
print("survivor done", flush=True)
"""


@pytest.mark.parametrize("say_done, code", [("1", 0), ("0", 128 + signal.SIGTERM)],
                         ids=["done", "not-done"])
def test_a_stopped_member_is_ended_once_the_others_are_done(tmp_path, say_done, code):
    """One member SIGSTOPs itself; the others finish. ferrorun ends the stopped one (SIGTERM
    and SIGCONT) --settle seconds on, naming it, and exits: 0 when a member said the job was
    done, else the stopped one's code, as a failed one's (before, it waited for ever)."""
    script, pids = tmp_path / "job.py", tmp_path / "pids"
    script.write_text(STOPS)
    pids.mkdir()
    env = dict(os.environ, PIDS=str(pids), SAY_DONE=say_done)
    proc = subprocess.Popen([*FERRORUN, "--nproc", "2:3", "--settle", "2", "--grace", "2",
                             str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in map(int, os.listdir(pids)):   # a rank left behind (it dies with ferrorun)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    mine = str(script).encode() in f.read()
                if mine:
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert out.count("survivor done") == 2, out + err
    assert "continued" not in out, out + err
    assert "has been stopped (SIGSTOP)" in err and "sending SIGTERM" in err, err
    assert "was killed by SIGTERM (stopped; ferrorun ended it)" in err, err
    assert "starts a replacement" not in err, err
    assert proc.returncode == code, out + err


FAILS_AFTER_DONE = """
import sys, time
from ferro_backend import elastic
job = elastic.join()
job.backend.barrier()
if job.backend.rank == 1:
    job.close()
    sys.exit(0)
time.sleep(1.0)
sys.exit(7)
"""


def test_a_member_failing_after_the_job_was_done_is_the_exit_code(tmp_path):
    """One member says the job is done and exits 0; the other fails a second later: ferrorun
    exits 7 and says so (it printed "the elastic job goes on without it" and exited 0: a
    crash writing results after the training looked like success)."""
    script = tmp_path / "job.py"
    script.write_text(FAILS_AFTER_DONE)
    proc = subprocess.run([*FERRORUN, "--nproc", "2:2", str(script)], capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert "exited with code 7 after a member said the elastic job was done" in proc.stderr
    assert "failed (exit code 7) after the elastic job was done" in proc.stderr


STOPPED_THEN_FAILED = """
import os, signal, sys, time
from ferro_backend import init_from_env
b = init_from_env()
if b.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(0.5)
sys.exit(3)
"""


def test_a_stopped_rank_is_continued_so_it_ends_when_a_peer_fails(tmp_path):
    """A plain job: rank 0 fails while rank 1 is stopped. ferrorun's SIGTERM to the rest is
    followed by SIGCONT (a stopped process acts on SIGTERM only once continued): it ends at
    once, not after the whole --grace and SIGKILL."""
    script = tmp_path / "job.py"
    script.write_text(STOPPED_THEN_FAILED)
    t0 = time.monotonic()
    proc = subprocess.run([*FERRORUN, "--nproc", "2", "--grace", "40", str(script)],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 30, proc.stderr
    assert "SIGKILL" not in proc.stderr, proc.stderr


# Two generations (every member rebuilds once), a ring of sends in each, then the job is done.
TRACED = """
import numpy as np
from ferro_backend import elastic
job = elastic.join()
for gen in range(2):
    b = job.backend
    got = np.empty(8)
    req = b.irecv(got, (b.rank - 1) % b.world_size, tag=gen)
    b.send(np.full(8, float(job.member_id)), (b.rank + 1) % b.world_size, tag=gen)
    req.wait(30)
    if gen == 0:
        job.rebuild(0)
job.close()
"""


def test_an_elastic_job_under_trace_writes_one_timeline_per_member_and_merges_them(tmp_path):
    """ferrorun --trace of an elastic job: every member's file (named after its member id: its
    rank changes with the generation) holds both generations' calls; ferrorun merges them
    (before, elastic.join traced nothing: the directory stayed empty)."""
    out = tmp_path / "tl"
    r = _ferrorun(tmp_path, TRACED, "--trace", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "timeline of 2 ranks" in r.stderr, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["rank_0.json", "rank_1.json", "trace.json"]
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"member 0", "member 1"}
    for member in (0, 1):
        mine = [e for e in events if e["pid"] == member and e["ph"] == "X"]
        sends = [e for e in mine if e["name"] == "send"]
        waits = [e for e in mine if e["name"] == "recv.wait"]
        assert [e["args"]["tag"] for e in sends] == [0, 1], mine
        assert sorted(e["args"]["tag"] for e in waits) == [0, 1], mine
        assert all(e["args"]["bytes"] == 64 for e in sends + waits)
