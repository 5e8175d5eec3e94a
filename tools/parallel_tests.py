"""``./dev tests``: every ``tests(...)`` nox session, in parallel lanes, on wheels built once
(while the lanes set up their venvs).

The sessions are independent (each installs its own wheels in its own venv) and spend much of
their time waiting on the processes their tests start (or on timeouts they provoke), so more lanes
than cores keep both cores of a 2-core machine busy: measured on the same day, 6 min 11 s with
three lanes against 6 min 40 s with two (stop 36); four lanes made every session slower here (stop
37: backend 315 -> 377 s, torch 251 -> 324 s). Lanes are balanced by measured session times (the
longest first); each lane runs its sessions one after the other. Every session's output goes to
``.nox/<session>.log`` and is printed, whole, when the session ends; the exit status is non-zero
if any session failed. The tests that make network namespaces (ferro-backend's test_emulate,
the examples' emulated cluster) count every namespace on the machine, so they take turns
across sessions (``ferro_backend.testing.exclusive``).

    python tools/parallel_tests.py NOX [--lanes 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: seconds each session took on a 2-core machine in three lanes (a clean clone, stop 63, after
#: the compiled torch backend became one translation unit and the torch and jax ranks began to
#: fork from servers with torch / jax imported: 426 s for the 9 sessions): only used to
#: balance them
COST = {"backend": 318, "collective": 233, "torch": 246, "examples": 142, "fsdp": 51,
        "checkpoint": 40, "docs": 91, "wheels": 8, "jax": 96}
#: sessions whose wheels are built first (the lowest layers: noxfile.BUILD_ORDER) start their
#: lane, so no lane waits for wheels another could have used
EARLY = {"backend": 0, "collective": 1, "torch": 2}


def lanes_for(sessions: list[str], n: int) -> list[list[str]]:
    """Longest session first into the lane that ends soonest; in each lane, the sessions
    whose wheels are ready first go first."""
    lanes: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for s in sorted(sessions, key=lambda s: -COST.get(s, 60)):
        k = load.index(min(load))
        lanes[k].append(s)
        load[k] += COST.get(s, 60)
    return [sorted(lane, key=lambda s: EARLY.get(s, len(EARLY))) for lane in lanes if lane]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("nox")
    ap.add_argument("--lanes", type=int, default=int(os.environ.get("FERRO_TEST_LANES", "3")))
    args = ap.parse_args()
    start = time.monotonic()
    listed = subprocess.run([args.nox, "-l", "-s", "tests"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    sessions = [line.split("tests(", 1)[1].split(")", 1)[0] for line in listed.splitlines()
                if line.startswith("* tests(")]
    if not sessions:
        print(listed, file=sys.stderr)
        raise SystemExit("parallel_tests: nox lists no tests(...) sessions")
    # every wheel once (the lanes reuse them), built while the lanes make their venvs and
    # install what they need from outside ferro; each session waits for the marker
    logs = ROOT / ".nox"
    logs.mkdir(exist_ok=True)
    # one marker per wheel as it is built (tools/build_wheels.py, lowest layers first, two at
    # a time), and ALL when the wheels session ends: a session waits only for its own layers
    markers = logs / "wheels-ready"
    shutil.rmtree(markers, ignore_errors=True)
    markers.mkdir()
    wheels_rc: list[int] = []

    def build_wheels() -> None:
        proc = subprocess.Popen([args.nox, "-s", "wheels"], cwd=ROOT,
                                env={**os.environ, "FERRO_WHEEL_MARKERS": str(markers)})
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
        print(f"==== wheels built in {usage.ru_utime + usage.ru_stime:.0f} s of CPU ====",
              flush=True)
        wheels_rc.append(rc)
        (markers / "ALL").write_text("ok" if rc == 0 else "failed")

    builder = threading.Thread(target=build_wheels)
    builder.start()
    env = {**os.environ, "FERRO_REUSE_WHEELHOUSE": "1", "FERRO_WHEELHOUSE_READY": str(markers)}
    failed: list[str] = []
    lock = threading.Lock()

    def run_lane(lane: list[str]) -> None:
        for name in lane:
            log = logs / f"tests-{name}.log"
            t0 = time.monotonic()
            with open(log, "w") as out:
                proc = subprocess.Popen([args.nox, "-s", f"tests({name})"], cwd=ROOT, env=env,
                                        stdout=out, stderr=subprocess.STDOUT)
                # the session's CPU time (every process it waited for): on a 2-core machine the
                # line is bound by the sum of these, not by the longest lane
                _, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = rc = os.waitstatus_to_exitcode(status)
            took, cpu = time.monotonic() - t0, usage.ru_utime + usage.ru_stime
            with lock:
                sys.stdout.write(log.read_text())
                verdict = "passed" if rc == 0 else f"FAILED (exit {rc})"
                print(f"==== tests({name}) {verdict} in {took:.0f} s ({cpu:.0f} s of CPU) ====",
                      flush=True)
                if rc:
                    failed.append(name)

    lanes = lanes_for(sessions, max(1, args.lanes))
    print(f"parallel_tests: {len(sessions)} sessions in {len(lanes)} lanes: {lanes}", flush=True)
    threads = [threading.Thread(target=run_lane, args=(lane,)) for lane in lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    builder.join()
    total = time.monotonic() - start
    if wheels_rc != [0]:
        print(f"parallel_tests: FAILED: the wheels did not build ({total:.0f} s)", flush=True)
        return 1
    if failed:
        print(f"parallel_tests: FAILED: {', '.join(f'tests({n})' for n in failed)} "
              f"({total:.0f} s)", flush=True)
        return 1
    print(f"parallel_tests: all {len(sessions)} sessions passed in {total:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
