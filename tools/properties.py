"""Every package's property tests (hypothesis) under several seeds (``nox -s properties``; not
part of the test line).

The test line draws the same examples every run (``noxfile.HYPOTHESIS``: a derandomized
profile), so a property whose premise fails only on a rare draw is found here, not by CI on an
unrelated change (0.4 found a gathered allreduce compared with the star's bits on a size the
cost model keeps header-first, when the line still drew afresh). This runs each package's
``-m hypothesis`` tests once per seed (``--hypothesis-seed``, seeds ``--first`` to ``--first +
--seeds - 1``), prints each run's outcome and duration, and the output of every run that
failed; exit code 1 if any did. A failing seed repeats with ``pytest -m hypothesis
--hypothesis-seed=S`` on that package.

``python tools/properties.py --seeds 5 [--first 1] [package folders ...]``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the packages whose tests hold properties (ferro-torch's and ferro-jax's hold one or none)
PACKAGES = ["ferro-backend", "ferro-collective", "ferro-fsdp", "ferro-checkpoint"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds a package (default 5)")
    ap.add_argument("--first", type=int, default=1, help="the first seed (default 1)")
    ap.add_argument("packages", nargs="*",
                    help="package folders holding tests/ (default: the packages above)")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds {args.seeds}: need >= 1")
    # (absolute: each run's working directory is its package's folder)
    folders = [Path(p).resolve() for p in args.packages] or [ROOT / "packages" / p for p in PACKAGES]
    failed = runs = 0
    for folder in folders:
        for seed in range(args.first, args.first + args.seeds):
            start = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                 "hypothesis", f"--hypothesis-seed={seed}", str(folder / "tests")],
                cwd=folder, capture_output=True, text=True)
            took = time.monotonic() - start
            tail = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
            print(f"{folder.name} seed {seed}: {tail} ({took:.0f} s)", flush=True)
            runs += 1
            if done.returncode != 0:
                failed += 1
                print(done.stdout[-6000:], done.stderr[-2000:], sep="\n", flush=True)
    print(f"{runs - failed} of {runs} runs passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
