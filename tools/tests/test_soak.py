"""tools/soak.py's fault plan and injector: faults fire at the job's steps, and one the job
ended before is counted as not injected (a fake job: a parent whose child writes its steps)."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import soak

# a stand-in for ferrorun: a child that counts steps into DIR/<pid>, one every 10 ms, to LAST;
# with HOLD, it then ends only once HOLD exists (at most 30 s on)
JOB = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
fd = os.open(os.path.join(sys.argv[1], str(os.getpid())), os.O_WRONLY | os.O_CREAT, 0o644)
for step in range(1, int(sys.argv[2]) + 1):
    os.pwrite(fd, b"%012d" % step, 0)
    time.sleep(0.01)
end = time.monotonic() + 30
while len(sys.argv) > 3 and not os.path.exists(sys.argv[3]) and time.monotonic() < end:
    time.sleep(0.01)
''', *sys.argv[1:]])
sys.exit(child.wait() and 3)
"""


def fake_job(tmp: Path, last: int, hold: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", JOB, str(tmp), str(last),
                             *([str(hold)] if hold else [])])


def test_a_planned_kill_fires_when_the_job_reaches_its_step(tmp_path: Path) -> None:
    proc = fake_job(tmp_path, 500)
    inj = soak.Injector(proc, [(20, "kill")], tmp_path, 0.0, random.Random(0))
    inj.start()
    assert proc.wait(timeout=30) == 3  # its child was killed
    inj.join(10)
    assert (inj.done, inj.missed) == (["kill"], [])
    (f,) = tmp_path.iterdir()
    assert 20 <= int(f.read_bytes()) < 60  # killed at its step, not at a moment of the clock


def test_a_fault_the_job_ends_before_is_not_injected(tmp_path: Path) -> None:
    release = tmp_path / "release"  # (not a step file: its name is not a pid)
    proc = fake_job(tmp_path, 10, hold=release)
    inj = soak.Injector(proc, [(5, "stop-short"), (50, "kill")], tmp_path, 0.05,
                        random.Random(0))
    inj.start()
    # the job stays at its last step until the stop-short is in (a loaded host's stall of
    # the injector outlasted the job's 10 steps), then ends before step 50
    end = time.monotonic() + 30
    while not inj.done and inj.is_alive() and time.monotonic() < end:
        time.sleep(0.01)
    release.touch()
    assert proc.wait(timeout=30) == 0
    inj.join(10)
    assert (inj.done, inj.missed) == (["stop-short"], ["kill"])
    result = soak.outcome("restart", inj)
    assert "planned faults not injected" in result["why"] and result["planned"] == [
        "stop-short", "kill"]


def test_plan_is_in_step_order_inside_its_window() -> None:
    p = soak.plan(random.Random(1), 1000, 5, ["kill", "stop-short"], (0.1, 0.5))
    steps = [s for s, _ in p]
    assert steps == sorted(steps) and all(100 <= s <= 500 for s in steps), p
    assert {k for _, k in p} <= {"kill", "stop-short"}


def test_the_table_counts_planned_and_injected_and_the_share_fired() -> None:
    results = [{"mode": "restart", "planned": ["kill", "kill"], "faults": ["kill"], "ok": False,
                "lost": [1.0]},
               {"mode": "restart", "planned": ["kill"], "faults": ["kill"], "ok": True,
                "lost": [2.0]}]
    table = soak.table(results)
    assert "| restart | kill | 3 | 2 | 2 | 1 | 1.50 s (1.00-2.00) |" in table, table
    assert soak.fired(results) == 2 / 3 < soak.MIN_FIRED


def test_a_kill_in_save_waits_for_a_new_shard_being_written(tmp_path: Path) -> None:
    """Armed at its step, it leaves alone a shard a killed save left behind and fires the
    moment a new one appears."""
    steps, ckpt = tmp_path / "steps", tmp_path / "ckpt"
    steps.mkdir()
    (ckpt / "step_5").mkdir(parents=True)
    (ckpt / "step_5" / ".rank_0.old.safetensors.part").write_bytes(b"")  # a crash's leftover
    proc = fake_job(steps, 500)
    inj = soak.Injector(proc, [(10, "kill-in-save")], steps, 0.0, random.Random(0), ckpt)
    inj.start()
    import time

    deadline = time.monotonic() + 20
    while max([int(f.read_bytes() or b"0") for f in steps.iterdir()] or [0]) < 30:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    time.sleep(0.1)  # well past step 10: the injector waits for a save
    assert proc.poll() is None and inj.done == []
    (ckpt / "step_10").mkdir()
    (ckpt / "step_10" / ".rank_1.new.safetensors.part").write_bytes(b"")
    assert proc.wait(timeout=30) == 3
    inj.join(10)
    assert (inj.done, inj.missed) == (["kill-in-save"], [])


def test_a_full_disk_fills_the_checkpoints_file_system(tmp_path: Path, monkeypatch) -> None:
    written = []
    monkeypatch.setattr(soak, "fill", lambda path, done=None: (written.append(path),
                                                               done is None or done()))
    proc = fake_job(tmp_path, 40)
    inj = soak.Injector(proc, [(5, "full disk")], tmp_path, 0.0, random.Random(0),
                        tmp_path / "disk" / "ckpt")
    inj.start()
    proc.wait(timeout=30)
    inj.join(10)
    assert inj.done == ["full disk"] and written[0] == tmp_path / "disk" / "filler"


def test_fill_keeps_a_file_system_full_until_told(tmp_path: Path) -> None:
    """Space freed after the first ENOSPC is taken back (a checkpoint rotation must not give a
    later save room). Here: a fake file whose writes fail twice, then succeed, then fail."""
    outcomes = iter([OSError(28, "full"), OSError(28, "full"), None, OSError(28, "full")])
    calls = {"done": 0}

    class Fake:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def write(self, data):
            exc = next(outcomes)
            if exc is not None:
                raise exc

    def done():
        calls["done"] += 1
        return calls["done"] >= 3

    import builtins

    real = builtins.open
    builtins.open = Fake
    try:
        soak.fill(tmp_path / "f", done)
    finally:
        builtins.open = real
    assert calls["done"] == 3  # full, full, (room taken back), full: then done
