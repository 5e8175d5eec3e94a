"""The transports' and the point-to-point collectives' tests beside busy loops
(``nox -s loaded``; not part of the test line).

CI runs its 9 lanes on a 2-core machine, and the two races it found in 0.4 (an exchange of
streamed messages that waited for a watch thread; a link probe that timed out while an engine
set up) showed there and under busy loops, never on a quiet host. This runs the tests most
exposed to a descheduled thread (the TCP mesh, the engine's rings and door, the two-rank and
gathered message forms, the hierarchy) ``--repeat`` times with ``--loops`` processes spinning
beside them, and prints each run's outcome and duration; exit code 1 if any run failed.

``python tools/loaded.py --loops 2 --repeat 3 [pytest paths or -k expressions after --]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the tests a descheduled thread breaks first
TESTS = [
    "packages/ferro-backend/tests/test_tcp.py",
    "packages/ferro-backend/tests/test_lead.py",
    "packages/ferro-backend/tests/test_reactor.py",
    "packages/ferro-backend/tests/test_rings.py",
    "packages/ferro-backend/tests/test_door.py",
    "packages/ferro-backend/tests/test_fuzz_protocol.py",
    "packages/ferro-collective/tests/test_pair.py",
    "packages/ferro-collective/tests/test_gathered.py",
    "packages/ferro-collective/tests/test_hierarchical.py",
]
#: a busy loop: pure Python, no allocation, until killed
SPIN = "while True:\n    pass\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loops", type=int, default=os.cpu_count() or 2,
                    help="busy processes beside the tests (default: one per core)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of the tests")
    ap.add_argument("pytest_args", nargs="*",
                    help="test paths and pytest options (default: the exposed tests above)")
    args = ap.parse_args(argv)
    if args.loops < 0 or args.repeat < 1:
        ap.error(f"--loops {args.loops} and --repeat {args.repeat}: need >= 0 and >= 1")
    targets = args.pytest_args or [str(ROOT / t) for t in TESTS]
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.loops)]
    failed = 0
    try:
        for run in range(1, args.repeat + 1):
            start = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   *targets], cwd=ROOT, capture_output=True, text=True)
            took = time.monotonic() - start
            tail = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
            print(f"run {run}/{args.repeat} beside {args.loops} busy loops: {tail} "
                  f"({took:.0f} s)", flush=True)
            if done.returncode != 0:
                failed += 1
                print(done.stdout[-6000:], done.stderr[-2000:], sep="\n", flush=True)
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait(timeout=10)
    print(f"{args.repeat - failed} of {args.repeat} runs passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
