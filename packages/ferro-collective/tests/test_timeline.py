"""Collectives on the timeline: every call while tracing (the compiled entry and *_async), with
bytes, dtype, algorithm and transport; the compiled entry's tracer cleared after; ferrorun
--trace on the engine."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ferro_backend import SimulatedBackend, trace
from ferro_backend.testing import run_threads
from ferro_collective import allreduce, allreduce_async, barrier, broadcast
from ferro_collective import tracing as ctl

pytestmark = pytest.mark.timeout(120)


def test_collectives_are_recorded_while_tracing(tmp_path):
    group = SimulatedBackend.create_group(2)
    path = tmp_path / "t.json"

    def body(b):
        x = np.arange(10.0)
        if b.rank == 0:
            with trace(path, backend=b):
                allreduce(x, b)
                broadcast(x.astype(np.float32), b, root=1, algorithm="star")
                allreduce_async(x, b).wait(10)
                barrier(b)
        else:
            allreduce(x, b)
            broadcast(x.astype(np.float32), b, root=1, algorithm="star")
            allreduce_async(x, b).wait(10)
            barrier(b)

    run_threads(body, group, timeout=60)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    colls = [(e["name"], e["cat"]) for e in events
             if e["cat"].startswith("collective") and e["args"]["rank"] == 0]
    assert colls == [("allreduce", "collective"), ("broadcast", "collective"),
                     ("allreduce", "collective.async"), ("barrier", "collective")]
    first = next(e for e in events if e["name"] == "allreduce")
    assert first["args"] == {"bytes": 80, "dtype": "float64", "algorithm": "auto",
                             "transport": "SimulatedBackend", "rank": first["args"]["rank"],
                             "world": 2}
    assert {e["args"]["rank"] for e in events if e["cat"] == "collective"} == {0, 1}
    bcast = next(e for e in events if e["name"] == "broadcast")
    assert bcast["args"]["algorithm"] == "star" and bcast["args"]["dtype"] == "float32"
    assert any(e["cat"] == "p2p" for e in events)  # the backend's messages under them


def test_the_compiled_entry_is_untraced_outside_a_trace(tmp_path):
    b = SimulatedBackend.create_group(1)[0]
    with trace(tmp_path / "t.json", backend=b):
        allreduce(np.ones(3), b)
    # tracing is off: a call records nothing and costs one flag check
    assert ctl.traced_job("x", len, None, b, None) is len
    allreduce(np.ones(3), b)
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sum(e["name"] == "allreduce" for e in events) == 1


JOB = """
    import numpy as np
    import ferro_backend as fb
    import ferro_collective as fc
    b = fb.init_from_env()
    for _ in range(5):
        fc.allreduce(np.ones(1024, np.float32), b)
    fc.allreduce(np.ones(1 << 20, np.float32), b)
    if b.rank == 1:
        import time
        time.sleep(2.0)  # rank 0's barrier waits for it (far longer than a load's stall)
    fc.barrier(b)
    b.close()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the engine needs Linux")
def test_ferrorun_trace_shows_the_engine_calls_of_every_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    out = tmp_path / "tl"
    r = subprocess.run([sys.executable, "-m", "ferro_backend.launch", "--nproc", "2",
                        "--transport", "shm", "--trace", str(out), str(script)],
                       capture_output=True, text=True, timeout=100, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank and e.get("cat") == "collective"]
        assert [e["name"] for e in mine] == ["allreduce"] * 6 + ["barrier"]
        assert all(e["args"]["transport"] == "engine" for e in mine)
        assert [e["args"]["bytes"] for e in mine[:6]] == [4096] * 5 + [4 << 20]
        # how long each call's engine steps waited for the peer
        assert all(0 <= e["args"]["wait_us"] <= e["dur"] + 1 for e in mine)
    barrier_wait = {e["pid"]: e["args"]["wait_us"] for e in events
                    if e.get("cat") == "collective" and e["name"] == "barrier"}
    # rank 0 waited most of rank 1's 2 s sleep, rank 1 (the last to come) far less; the
    # 1 s line leaves room on both sides for a loaded host's scheduling stalls
    assert barrier_wait[0] > 1_000_000 and barrier_wait[1] < 1_000_000, barrier_wait


def test_a_call_refused_for_an_argument_json_has_no_type_for_keeps_the_trace(tmp_path):
    # a numpy-integer peer or an algorithm given as bytes was recorded as it was: leaving the
    # block raised TypeError (not JSON serializable) and no trace was written
    group = SimulatedBackend.create_group(2)
    path = tmp_path / "trace.json"
    with trace(path, backend=group[0]):
        with pytest.raises(ValueError):
            allreduce(np.ones(2), group[0], algorithm=b"ring")
        with pytest.raises(Exception, match="int"):
            group[0].recv(np.empty(3), np.int64(1), timeout=1)
    events = json.loads(path.read_text())["traceEvents"]
    said = json.dumps(events)
    assert "b'ring'" in said and "allreduce" in said


def test_a_call_that_raised_is_recorded_with_its_error(tmp_path):
    # a failed call was recorded like a success
    (b,) = SimulatedBackend.create_group(1)
    path = tmp_path / "trace.json"

    def fails():
        raise ZeroDivisionError

    with trace(path, backend=b):
        allreduce(np.ones(2), b)
        with pytest.raises(ValueError):
            allreduce(np.ones(2), b, algorithm="no such algorithm")
        job = ctl.traced_job("allreduce", fails, np.ones(2), b, None)
        with pytest.raises(ZeroDivisionError):
            job()
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["cat"], e["args"].get("error")) for e in events] == [
        ("allreduce", "collective", None), ("allreduce", "collective", "ValueError"),
        ("allreduce", "collective.async", "ZeroDivisionError")]
