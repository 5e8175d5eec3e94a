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
