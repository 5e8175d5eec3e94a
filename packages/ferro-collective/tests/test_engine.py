"""The same-host engine (ShmBackend's shared segment) under every collective.

Ranks are real processes on this host. Results must be the same bits as the star algorithm
(the engine folds in rank order too), on every transport path: small messages through the slots,
large ones by cross-memory reads, and large ones through the slots in pieces where cross-memory
reads are off. Small slots (``FERRO_SHM_SLOT_BYTES``) make the large paths cheap to test.
"""

import json
import os
import re
import signal
import time
from unittest import mock

import engine_fns
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferro_backend.testing import Job, run_processes

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("world,slot,cma", [(2, None, "1"), (3, "4096", "1"), (4, "4096", "0"),
                                            (2, "65536", "0"), (8, None, "1")])
def test_engine_equals_star_bit_for_bit(monkeypatch, world, slot, cma):
    # 8 ranks on this 2-core machine: the oversubscribed engine (yield, then sleep) too
    if slot:
        monkeypatch.setenv("FERRO_SHM_SLOT_BYTES", slot)
    monkeypatch.setenv("FERRO_SHM_CMA", cma)
    results = run_processes(engine_fns.equals_star, world, world * 7, 14, transport="shm",
                            timeout=150)
    assert results == [[]] * world


_DTYPE_NAMES = ["float32", "float64", "float16", "int32", "int8", "uint16", "uint64", "bool"]
_OP_NAMES = ["SUM", "MEAN", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR"]


@st.composite
def _engine_cases(draw):
    """(dtype, shape, op, root) lists whose ops suit their dtypes (the general path's errors
    for the others are tested elsewhere); dim 0 of 60 or 120 where it is not 0 or 1, which
    every world size 2-5 divides, so that reduce_scatter runs too."""
    cases = []
    for _ in range(draw(st.integers(1, 5))):
        dtype = draw(st.sampled_from(_DTYPE_NAMES))
        kind = np.dtype(dtype).kind
        ops = (["MAX", "MIN", "BAND", "BOR", "BXOR"] if kind == "b" else
               ["SUM", "MEAN", "MAX", "MIN", "PRODUCT"] if kind == "f" else
               ["SUM", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR"])
        shape = draw(st.sampled_from([(), (0,), (1,), (60,), (60, 5), (60 * 700,),
                                      (120, 2, 3)]))
        cases.append((dtype, shape, draw(st.sampled_from(ops)), draw(st.integers(0, 7))))
    return cases


@settings(max_examples=5, deadline=None, derandomize=True)
@given(world=st.integers(2, 5), cases=_engine_cases())
def test_engine_equals_star_for_drawn_worlds_dtypes_ops_and_shapes(world, cases):
    """Hypothesis over real processes: the one-call and staged engine paths give the star
    algorithm's bits for drawn world sizes, dtypes (bool and float16 included), ops, shapes
    (0-d and empty included) and roots."""
    results = run_processes(engine_fns.equals_star, world, 0, 0, cases, transport="shm",
                            timeout=150)
    assert results == [[]] * world


def test_mismatch_is_reported_on_every_rank_and_the_group_stays_usable():
    for msg in run_processes(engine_fns.mismatch, 3, transport="shm"):
        assert "ranks disagree" in msg and "[3]" in msg and "[4]" in msg, msg
        assert msg.endswith("usable=True")


@pytest.mark.parametrize("world", [2, 3])  # 3 ranks on 2 cores: the yield phase, then sleep
def test_silent_peer_times_out_at_the_deadline_without_burning_cpu(world, tmp_path):
    # rank 1 calls only once rank 0 is done (a flag file), ranks beyond 1 wait with a long
    # deadline: rank 0's own 0.5 s deadline is the one that ends its call
    results = run_processes(engine_fns.late_peer, world, str(tmp_path), transport="shm",
                            timeout=60)
    assert all(r["waited"] for r in results), results
    res = results[0]
    assert "timed out after 0.5s waiting for ranks [1]" in res["error"], res
    # not before the deadline; the upper bound only shows it did not wait on (it has room
    # for the scheduling stalls of a loaded 2-core host)
    assert 0.45 < res["seconds"] < 3.0, res
    assert res["cpu"] < 0.05 * res["seconds"] + 0.01  # no busy wait after the short spin
    assert "timed out" in res["after"]  # a group whose steps disagree refuses further calls


KILLED = """
import ferro_collective as fc
if b.rank == 1:
    print("READY", flush=True)
    time.sleep(60)
try:
    fc.allreduce(np.ones(1000), b, timeout=30)
    result = "no error"
except PeerClosedError as exc:
    result = [type(exc).__name__, str(exc), time.time()]
"""


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _engine_sockets() -> list[str]:
    with open("/proc/net/unix") as f:
        return [line for line in f if "ferro-engine" in line]


def _lasting_engine_sockets(within: float = 10.0) -> list[str]:
    """The engine sockets still open ``within`` seconds from now. A job's rank 0 listens on one
    only while its ranks fetch the segment, and the tests of other packages, running beside
    these (CI's lanes), set up jobs of their own: theirs come and go, a leaked one stays."""
    seen = set(_engine_sockets())
    end = time.monotonic() + within
    while seen and time.monotonic() < end:
        time.sleep(0.1)
        seen &= set(_engine_sockets())
    return sorted(seen)


def test_killed_peer_fails_the_others_promptly_and_leaves_nothing_behind():
    before = _shm_names()
    with Job(KILLED, 3, backend="ShmBackend", timeout=30) as job:
        job.wait_for_line(1, "READY")
        # the segment is an anonymous memfd: mapped, but no /dev/shm file
        with open(f"/proc/{job.procs[1].pid}/maps") as f:
            maps = f.read()
        assert "memfd:ferro-engine" in maps and "/dev/shm/" not in maps
        time.sleep(0.3)  # ranks 0 and 2 are (most likely) waiting in the allreduce
        t_kill = time.time()
        os.kill(job.procs[1].pid, signal.SIGKILL)
        results = job.finish(30)
    for r in (0, 2):
        name, msg, t_err = results[r].result
        # the error names the dead rank ("peer rank 1 is gone"), not just any "1"
        assert name in ("PeerClosedError", "PeerAbortedError"), msg
        assert re.search(r"\branks? \[?1\b", msg), msg
        assert t_err - t_kill < 2.5  # from the kill, not from the rank's start
    # nothing ferro made has a name in /dev/shm (other programs may add theirs meanwhile)
    assert [n for n in _shm_names() - before if "ferro" in n] == []
    assert _lasting_engine_sockets() == []


def test_stopped_peer_makes_the_others_time_out_at_their_deadline():
    body = """
import ferro_collective as fc
if b.rank == 1:
    print("READY", flush=True)
    time.sleep(30)
else:
    t0 = time.monotonic()
    try:
        fc.allreduce(np.ones(10), b, timeout=1.0)
        result = "no error"
    except CollectiveTimeoutError as exc:
        result = [str(exc), time.monotonic() - t0]
"""
    with Job(body, 2, backend="ShmBackend", timeout=30) as job:
        job.wait_for_line(1, "READY")
        os.kill(job.procs[1].pid, signal.SIGSTOP)
        try:
            out, _ = job.procs[0].communicate(timeout=20)
        finally:
            os.kill(job.procs[1].pid, signal.SIGKILL)
    result = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert result, out
    msg, seconds = json.loads(result[0][7:])
    assert "timed out after 1s" in msg and 0.9 < seconds < 3.0


# ----------------------------------------------------------------------------- scatter, all-to-all
@pytest.mark.parametrize("world,slot,cma", [(2, None, "1"), (3, None, "1"), (3, "4096", "1"),
                                            (3, "4096", "0"), (2, "65536", "0")])
def test_scatter_and_all_to_all_on_the_engine_equal_point_to_point(monkeypatch, world, slot,
                                                                    cma):
    if slot:
        monkeypatch.setenv("FERRO_SHM_SLOT_BYTES", slot)
    monkeypatch.setenv("FERRO_SHM_CMA", cma)
    results = run_processes(engine_fns.exchange_equals_p2p, world, world + 3, transport="shm",
                            timeout=150)
    if cma == "1":  # one engine call each: no point-to-point message
        assert results == [[]] * world
    else:  # large data goes over messages without cross-memory reads; the rest on the engine
        for res in results:
            assert res[:-1] == [] and res[-1].startswith("fell back to messages"), res


@pytest.mark.parametrize("case", ["scatter/allreduce", "all_to_all_single/all_gather",
                                  "all_to_all/scatter", "all_to_all_single/gather"])
def test_fast_path_exchange_against_another_collective_is_a_mismatch_on_every_rank(case):
    first, other = case.split("/")
    for msg in run_processes(engine_fns.exchange_mismatch, 3, case, transport="shm"):
        assert "ranks disagree" in msg and f"ranks [0] called {first}(" in msg and \
            f"ranks [1, 2] called {other}(" in msg, msg
        assert msg.endswith("usable=True"), msg


def test_a_one_step_call_against_a_general_one_is_a_mismatch():
    for msg in run_processes(engine_fns.lean_mismatch, 3, transport="shm"):
        assert "broadcast" in msg and msg.endswith("usable=True"), msg


def test_scatter_root_times_out_while_its_readers_stall(tmp_path):
    res = run_processes(engine_fns.exchange_stalled_reader, 3, str(tmp_path), transport="shm",
                        timeout=60)
    # the root called once both readers were about to, and stayed open until both had a result
    assert res[0]["waited"] and res[0]["held"], res[0]
    assert res[0]["error"].startswith("CollectiveTimeoutError"), res[0]
    assert "timed out after 0.5s waiting for ranks [1, 2]" in res[0]["error"], res[0]
    assert 0.45 < res[0]["seconds"] < 1.4
    for r in (1, 2):  # past their own deadline after the slow read: the root withdrew its
        # last step when it gave up, so they never return what they copied from its buffer
        err = res[r]["error"]
        assert err is not None and ("timed out after 1s" in err or
                                    "cannot read rank 0's memory" in err), res[r]
        assert res[r]["seconds"] < 3.5


KILLED_EXCHANGE = """
import ferro_collective as fc
x = np.ones(3 * 100_000, np.float32)
print("LOOPING", flush=True)
try:
    while True:
        fc.all_to_all_single(x, b, timeout=30)
        fc.scatter(x if b.rank == 0 else None, b, timeout=30)
        fc.all_to_all([x[:10]] * 3, b, timeout=30)
except PeerClosedError as exc:
    result = [type(exc).__name__, time.time()]
"""


def test_killed_peer_fails_scatter_and_all_to_all_promptly():
    latencies = []
    for victim, delay in ((1, 0.1), (0, 0.25), (2, 0.35)):
        with Job(KILLED_EXCHANGE, 3, backend="ShmBackend", timeout=30) as job:
            for r in range(3):
                job.wait_for_line(r, "LOOPING")
            time.sleep(delay)
            t_kill = time.time()
            os.kill(job.procs[victim].pid, signal.SIGKILL)
            results = job.finish(30)
        for r in results:
            if r.rank != victim:
                assert r.returncode == 0, r.stderr[-2000:]
                name, t_err = r.result
                assert name in ("PeerClosedError", "PeerAbortedError")
                latencies.append(t_err - t_kill)
    assert max(latencies) < 2.5, latencies


def test_one_call_collectives_wait_past_the_stall_report_for_a_late_peer(tmp_path):
    # rank 1 arrives after rank 0's soft deadline (stall report: rank 1 waits for a file
    # rank 0's log handler writes on it), before its hard one
    flags = run_processes(engine_fns.late_but_in_time, 2, str(tmp_path), transport="shm",
                          timeout=90)
    assert flags == [[True] * 5, [True] * 10]  # rank 1 also saw each of the 5 reports


def test_the_doors_headers_are_the_ones_the_python_steps_pack():
    # every call of the door publishes the header header.encode packs for it (collective,
    # dtype, shape, op, root, sequence number): a mismatch is found whichever path a rank took
    assert run_processes(engine_fns.door_headers, 2, transport="shm", timeout=60) == [[]] * 2


@pytest.mark.parametrize("world", [2, 3])
def test_one_call_collectives_run_compiled_and_leave_other_calls_to_the_general_path(world):
    assert run_processes(engine_fns.compiled_path, world, transport="shm", timeout=60) == \
        [[]] * world


@pytest.mark.parametrize("world", [2, 3])
def test_a_small_gather_runs_compiled_and_meets_the_general_path(world):
    assert run_processes(engine_fns.compiled_gather, world, transport="shm", timeout=60) == \
        [[]] * world


def test_one_step_data_moving_through_the_slot_is_found_by_both_paths():
    # 64 KiB slots: 8 KiB per rank moves through 8 places, 16 KiB through 4, 32 KiB through
    # 2 (each many times in 20 calls); 4 KiB stays at the start. The allreduce folds in one
    # step below 32 KiB and splits from there (its rings move on likewise)
    env = {"FERRO_SHM_SLOT_BYTES": "65536"}
    with mock.patch.dict(os.environ, env):  # the ranks take the caller's environment
        res = run_processes(engine_fns.moving_slot_data, 2, [1024, 2048, 4096, 8192], 20,
                            transport="shm", timeout=120)
    assert res == [[], []]


def test_a_one_call_step_waiting_for_a_late_peer_lets_other_threads_run():
    res = run_processes(engine_fns.other_threads_run_while_waiting, 2, transport="shm",
                        timeout=60)
    assert res[0] == [True, True, True] and res[1] == []


def test_the_collectives_run_on_the_engines_door():
    from ferro_collective import _onecall
    from ferro_collective.engine_group import EngineGroup

    assert issubclass(EngineGroup, _onecall.Core)
    assert run_processes(engine_fns.through_the_door, 2, transport="shm", timeout=60) == \
        [[]] * 2


def test_a_bad_timeout_on_the_engine_raises_and_takes_no_sequence_number():
    assert run_processes(engine_fns.bad_timeouts, 2, transport="shm", timeout=60) == \
        [[True, True, True]] * 2


def test_a_subgroup_engine_attached_late_runs_and_its_view_closed_refuses():
    """attach_engine(sub) after a collective on sub: every later one timed out (its numbers
    were still the view's own count, the door's tickets began at 0); a closed view with an
    engine still ran collectives (only its point-to-point calls refused)."""
    got = run_processes(engine_fns.subgroup_engine_late_and_closed, 2, transport="shm",
                        timeout=120, backend_timeout=20)
    for out in got:
        assert out[:3] == [[2.0] * 3, [3.0] * 3, [0, 1]], out
    assert got[0][3] == ("closed", True), got[0]


def test_calls_after_the_group_broke_name_themselves(tmp_path):
    """A peer closes while six async calls are pending on the engine: each Work, and a later
    blocking call, raises an error of the failure's type naming its own call (every call after
    the first failure raised the one stored error object, which named that first call)."""
    got = run_processes(engine_fns.pending_works_after_a_peer_closes, 3, str(tmp_path),
                        transport="shm", timeout=90)
    for rank in (0, 2):
        for line in got[rank]:
            name, _, error = line.partition(" -> ")
            assert error.startswith(f"PeerClosedError: {name}"), line
            assert "peer rank 1 is gone" in error and "(raised before)" not in error, line
            assert error.count("an earlier call") <= 1, line  # (the first failure, once)
