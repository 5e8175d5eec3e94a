"""The timeline (ferro_backend.trace, FERRO_TRACE, ferrorun --trace): trace-event JSON per rank
with every point-to-point call of the traced backend, spans, nothing recorded when off, and
ferrorun merging the ranks into one file."""

import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from ferro_backend import SimulatedBackend, timeline, trace

pytestmark = pytest.mark.timeout(120)


def test_trace_records_the_traced_backends_point_to_point_calls(tmp_path):
    b0, b1 = SimulatedBackend.create_group(2)
    path = tmp_path / "r0.json"

    def peer():
        buf = np.empty(1000)
        b1.recv(buf, 0, tag=3)
        b1.send(buf * 2, 0, tag=4)

    t = threading.Thread(target=peer)
    t.start()
    with trace(path, backend=b0):
        assert timeline.active()
        b0.send(np.ones(1000), 1, tag=3)
        req = b0.irecv(np.empty(1000), 1, tag=4)
        req.wait(10)
        with timeline.span("user work", step=1):
            pass
    t.join(10)
    assert not timeline.active() and "send" not in b0.__dict__  # unwrapped
    events = json.loads(path.read_text())["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    assert meta == [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}}]
    by_name = {e["name"]: e for e in events if e["ph"] == "X"}
    assert by_name["send"]["args"]["bytes"] == 8000 and by_name["send"]["args"]["peer"] == 1
    assert by_name["recv.wait"]["args"]["tag"] == 4 and by_name["recv.wait"]["dur"] >= 0
    assert by_name["user work"]["args"] == {"step": 1}
    assert all(e["pid"] == 0 and e["ts"] > 0 for e in events if e["ph"] == "X")


def test_nothing_is_recorded_when_off_and_tracing_does_not_nest(tmp_path):
    timeline.record("x", "y", 0.0, 1.0)  # off: ignored
    with timeline.span("nothing"):
        pass
    seen = []
    timeline.add_hook(seen.append)
    try:
        with trace(tmp_path / "a.json", rank=3):
            with pytest.raises(RuntimeError, match="already tracing"):
                with trace(tmp_path / "b.json"):
                    pass
    finally:
        timeline._hooks.remove(seen.append)
    assert seen == [True, False]
    events = json.loads((tmp_path / "a.json").read_text())["traceEvents"]
    assert [e["ph"] for e in events] == ["M"] and events[0]["pid"] == 3


JOB = """
    import numpy as np
    import ferro_backend as fb
    b = fb.init_from_env()
    n = b.world_size
    x = np.full(4096, float(b.rank))
    got = np.empty_like(x)
    for _ in range(3):
        req = b.irecv(got, (b.rank - 1) % n, tag=1)
        b.send(x, (b.rank + 1) % n, tag=1)
        req.wait(30)
    b.close()
"""


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_ferrorun_trace_merges_the_ranks(tmp_path, transport):
    if transport == "shm" and not sys.platform.startswith("linux"):
        pytest.skip("the engine needs Linux")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    out = tmp_path / "tl"
    r = subprocess.run([sys.executable, "-m", "ferro_backend.launch", "--nproc", "3",
                        "--transport", transport, "--trace", str(out), str(script)],
                       capture_output=True, text=True, timeout=100, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert "timeline of 3 ranks" in r.stderr
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2}
    sends = [e for e in events if e["name"] == "send"]
    assert len(sends) == 9 and all(e["args"]["bytes"] == 32768 for e in sends)
    assert len([e for e in events if e["name"] == "recv.wait"]) == 9
    assert sorted(p.name for p in out.iterdir()) == ["rank_0.json", "rank_1.json",
                                                     "rank_2.json", "trace.json"]


def test_span_takes_any_keyword_and_non_finite_floats_are_valid_json(tmp_path):
    # span("step", start_us=5) worked untraced but raised TypeError traced (record's own
    # parameter names); a NaN argument was written as bare NaN, which chrome://tracing refuses
    with timeline.span("step", start_us=5, dur_us=3):
        pass
    path = tmp_path / "t.json"
    with trace(path):
        with timeline.span("step", start_us=5, cat="mine", name="x"):
            pass
        with timeline.span("loss", value=float("nan"), lr=float("inf"), low=np.float32("-inf")):
            pass
        timeline.record("r", "c", 1.0, 2.0, start_us=7, dur_us=8)

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    events = json.loads(path.read_text(), parse_constant=refuse)["traceEvents"]
    args = {e["name"]: e["args"] for e in events if e["ph"] == "X"}
    assert args["step"] == {"start_us": 5, "cat": "mine", "name": "x"}
    assert args["loss"] == {"value": "nan", "lr": "inf", "low": "-inf"}
    assert args["r"] == {"start_us": 7, "dur_us": 8}


def test_a_span_that_raised_says_so(tmp_path):
    path = tmp_path / "t.json"
    with trace(path):
        with pytest.raises(KeyError), timeline.span("step"):
            raise KeyError("x")
    (event,) = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert event["args"] == {"error": "KeyError"}


def _tcp_pair():
    from ferro_backend import TcpBackend
    from ferro_backend.testing import free_port

    addr, out = f"127.0.0.1:{free_port()}", [None, None]

    def build(r):
        out[r] = TcpBackend(r, 2, addr, timeout=20, connect="eager")

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(b is not None for b in out)
    return out


def test_recv_any_is_recorded_and_a_tcp_recv_counts_its_wait_once(tmp_path):
    # recv_any/irecv_any were never recorded; a TCP recv recorded itself and its inner
    # irecv's wait ("recv" and a nested "recv.wait": the wait counted twice)
    b0, b1 = _tcp_pair()
    try:
        def peer():
            b1.send(np.ones(10), 0, tag=1)
            b1.send(np.ones(20), 0, tag=2)
            b1.send(np.ones(30), 0, tag=3)
            b1.send(np.ones(40), 0, tag=4)

        t = threading.Thread(target=peer)
        path = tmp_path / "t.json"
        with trace(path, backend=b0):
            t.start()
            b0.recv(np.empty(10), 1, tag=1)
            b0.irecv(np.empty(20), 1, tag=2).wait(10)
            assert b0.recv_any(np.empty(30), tag=3) == 1
            req = b0.irecv_any(np.empty(40), tag=4)
            req.wait(10)
        t.join(10)
        assert "recv_any" not in b0.__dict__ and "irecv_any" not in b0.__dict__  # unwrapped
    finally:
        b1.close()
        b0.close()
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    got = [(e["name"], e["args"]["tag"], e["args"]["peer"], e["args"]["bytes"]) for e in events]
    assert got == [("recv", 1, 1, 80), ("recv.wait", 2, 1, 160), ("recv_any", 3, 1, 240),
                   ("recv_any.wait", 4, 1, 320)]
    assert all(0 <= e["args"]["wait_us"] <= e["dur"] + 1 for e in events)


def test_tcp_close_runs_every_step_when_one_fails():
    # a closer that raised (a trace that could not be written) skipped the rest of the
    # teardown: the receive loop's thread, its epoll fd and the sockets leaked
    b0, b1 = _tcp_pair()

    def boom():
        raise RuntimeError("boom")

    ran = []
    b0.on_close(boom)
    b0.on_close(lambda: ran.append(1))
    reactor = b0._reactor
    with pytest.raises(RuntimeError, match="boom"):
        b0.close()
    b1.close()
    assert ran == [1]
    if reactor is not None:
        reactor._thread.join(10)  # (close joins it 1 s at most: on a loaded host it may lag)
        assert not reactor._thread.is_alive()
    assert all(link.sock.fileno() == -1 for link in b0._links.values())


def test_a_trace_that_cannot_be_written_is_a_warning_not_an_error_of_close(tmp_path, caplog):
    # close() raised (FileExistsError, IsADirectoryError...) out of the backend's teardown
    b0, b1 = _tcp_pair()
    timeline.start_from_env(b0, str(tmp_path))
    (tmp_path / "rank_0.json").mkdir()  # the file cannot replace it
    with caplog.at_level("WARNING", logger="ferro_backend.timeline"):
        b1.close()
        b0.close()
    assert not timeline.active()
    assert "could not write" in caplog.text and "rank_0.json" in caplog.text


@pytest.mark.parametrize("bad", ["afile", "afile/sub"])
def test_init_from_env_refuses_a_ferro_trace_it_cannot_write_before_joining(tmp_path,
                                                                          monkeypatch, bad):
    # a FERRO_TRACE that is a file was found at exit (a traceback from atexit, exit 0, no
    # trace); now a SettingError naming it, before any connection
    from ferro_backend import init_from_env
    from ferro_backend.errors import SettingError
    from ferro_backend.joining import env

    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("FERRO_TRACE", str(tmp_path / bad))
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, {"RANK": "0", "WORLD_SIZE": "2"}.get(k, "127.0.0.1"))
    monkeypatch.setenv("MASTER_PORT", "1")

    def no_connection(*a, **k):
        raise AssertionError("connected before checking FERRO_TRACE")

    monkeypatch.setattr(env, "connect", no_connection)
    with pytest.raises(SettingError, match=f"FERRO_TRACE '{tmp_path / bad}'"):
        init_from_env()
    assert not timeline.active()


SIGTERMED = """
    import os, sys, time
    import numpy as np
    import ferro_backend as fb
    from ferro_backend import timeline
    b = fb.init_from_env()
    with timeline.span("done"):
        pass
    with timeline.span("stalled", step=3):
        os.write(1, b"ready\\n")
        time.sleep(60)
"""


def test_a_rank_ended_by_sigterm_writes_its_timeline_and_still_dies_of_sigterm(tmp_path):
    # events were written by atexit/close only: a SIGTERM (ferrorun stopping the ranks after
    # one failed, scancel) left no file
    import signal

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SIGTERMED))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["FERRO_TRACE"] = str(tmp_path / "tl")
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout.readline() == b"ready\n"
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == -signal.SIGTERM
    finally:
        p.kill()
        p.wait()
    events = json.loads((tmp_path / "tl" / "rank_0.json").read_text())["traceEvents"]
    spans = {e["name"]: e["args"] for e in events if e["ph"] == "X"}
    assert spans == {"done": {}, "stalled": {"step": 3, "unfinished": True}}


USERS_FILES = """
    import json, os, sys
    import ferro_backend as fb
    from ferro_backend import timeline
    b = fb.init_from_env()
    with timeline.span("phase 1"):
        b.barrier()
    b.close()
    b = fb.init_from_env()   # a second backend of the process: its events join the first's
    with timeline.span("phase 2"):
        b.barrier()
    d = os.environ["FERRO_TRACE"]
    json.dump({"loss": 0.5}, open(f"{d}/rank_{b.rank}_metrics.json", "w"))
    b.close()
    sys.exit(3)
"""


def test_ferrorun_trace_keeps_the_users_files_the_exit_code_and_a_reinits_events(tmp_path):
    # rank_*.json matched the user's rank_0_metrics.json: deleted before the run, or (written
    # during it) merged: KeyError 'traceEvents', ferrorun exited 1 and wrote no trace.json;
    # a second init_from_env overwrote the first backend's file
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(USERS_FILES))
    out = tmp_path / "tl"
    out.mkdir()
    (out / "rank_summary.json").write_text("{}")
    (out / "rank_7.json").write_text("{}")  # an earlier run's: removed
    r = subprocess.run([sys.executable, "-m", "ferro_backend.launch", "--nproc", "2",
                        "--transport", "tcp", "--trace", str(out), str(script)],
                       capture_output=True, text=True, timeout=100, env=dict(os.environ))
    assert r.returncode == 3, r.stderr
    assert "timeline of 2 ranks" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "rank_0.json", "rank_0_metrics.json", "rank_1.json", "rank_1_metrics.json",
        "rank_summary.json", "trace.json"]
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    for rank in (0, 1):
        spans = [e["name"] for e in events if e["pid"] == rank and e.get("cat") == "span"]
        assert spans == ["phase 1", "phase 2"]
        assert len([e for e in events if e["pid"] == rank and e["ph"] == "M"]) == 1


def test_ferrorun_says_which_entry_of_the_trace_dir_it_cannot_remove(tmp_path):
    (tmp_path / "tl" / "rank_9.json").mkdir(parents=True)
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    r = subprocess.run([sys.executable, "-m", "ferro_backend.launch", "--nproc", "1",
                        "--trace", str(tmp_path / "tl"), str(script)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "ran" not in r.stdout
    assert r.stderr == (f"ferrorun: --trace: cannot remove '{tmp_path / 'tl' / 'rank_9.json'}'"
                        ": Is a directory\n")


def test_ferrorun_merge_failure_is_one_line_and_keeps_the_exit_code(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        open(os.path.join(os.environ["FERRO_TRACE"], "rank_0.json"), "w").write("not json")
        sys.exit(4)
    """))
    out = tmp_path / "tl"
    r = subprocess.run([sys.executable, "-m", "ferro_backend.launch", "--nproc", "1",
                        "--trace", str(out), str(script)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 4, r.stderr
    assert "ferrorun: --trace: could not merge the ranks' timelines: " in r.stderr
    assert "Traceback" not in r.stderr


RESTARTED = """
    import os, time
    import ferro_backend as fb
    from ferro_backend import timeline
    b = fb.init_from_env()
    attempt = int(os.environ["FERRO_RESTART_COUNT"])
    with timeline.span(f"attempt {attempt}"):
        b.barrier()
    if attempt == 0 and b.rank == 1:
        raise SystemExit(1)
    mark = os.environ["RESTARTED_MARK"]   # outside the trace folder
    if attempt == 1 and b.rank == 0:
        # fail once rank 1 is inside "compute" (right after the barrier, on a loaded host,
        # ferrorun's SIGTERM reached rank 1 before it entered the span)
        end = time.monotonic() + 30
        while not os.path.exists(mark) and time.monotonic() < end:
            time.sleep(0.02)
        raise SystemExit(5)
    with timeline.span("compute"):
        if attempt == 1:
            open(mark, "w").close()
        time.sleep(60)   # attempt 0: rank 0, attempt 1: rank 1, stopped by ferrorun (SIGTERM)
"""


def test_ferrorun_restarts_merge_the_last_attempt_only_and_name_it(tmp_path):
    # the first attempt's files survived and were merged with the second's
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(RESTARTED))
    out = tmp_path / "tl"
    r = subprocess.run([sys.executable, "-m", "ferro_backend.launch", "--nproc", "2",
                        "--transport", "tcp", "--max-restarts", "1", "--grace", "20",
                        "--trace", str(out), str(script)],
                       capture_output=True, text=True, timeout=100,
                       env=dict(os.environ, RESTARTED_MARK=str(tmp_path / "in_compute")))
    assert r.returncode == 5, r.stderr
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    names = {(e["pid"], e["name"]) for e in events if e.get("cat") == "span"}
    assert names == {(0, "attempt 1"), (1, "attempt 1"), (1, "compute")}
    assert [e["args"] for e in events if e["name"] == "compute"] == [{"unfinished": True}]
    assert sorted(e["args"]["name"] for e in events if e["name"] == "process_name") == [
        "rank 0 (restart 1)", "rank 1 (restart 1)"]
