"""The benchmark regression gate: same-run ratios against a committed baseline.

    python tools/bench_check.py RESULTS.json [MORE.json ...] [--baseline benchmarks/baseline.json]
        [--margin 0.35] [--rerun "python -m pytest benchmarks ..."] [--update]

``RESULTS.json`` is a pytest-benchmark ``--benchmark-json`` file whose ferro entries carry
``extra_info.ratio_vs_baseline`` (baseline median time / ferro median time, measured in the same
run: see benchmarks/conftest.py), so the gate is robust to how fast the machine is. A benchmark
fails when its ratio falls more than ``margin`` (a fraction) below the committed one. A suspect
benchmark is measured again (``--rerun``, up to two more times, best ratio kept) before it fails,
since these machines are noisy; several result files count each benchmark's best ratio.
``--update`` writes the new baseline (do it on purpose, after an improvement or a deliberate
trade-off, and commit the file): from one file, its ratios; from several runs, each ratio's
median over the runs and the committed baseline, so a change must show in most runs to move
the gate, and one slow or lucky run does not.
Exit status 1 names each regression with both figures.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def ratios(path: Path) -> dict[str, float]:
    data = json.loads(path.read_text())
    out = {}
    for bench in data.get("benchmarks", []):
        ratio = (bench.get("extra_info") or {}).get("ratio_vs_baseline")
        if ratio is not None:
            out[bench["fullname"]] = float(ratio)
    return out


def rerun(command: str, names: list[str]) -> dict[str, float]:
    """Measure ``names`` again (their whole groups, so the baselines run beside them)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rerun.json"
        ids = [n.split("::", 1)[1].split("[")[0] for n in names]
        cmd = shlex.split(command) + ["-k", " or ".join(sorted(set(ids))),
                                      f"--benchmark-json={out}"]
        subprocess.run(cmd, check=False)
        return ratios(out) if out.exists() else {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, nargs="+")
    p.add_argument("--baseline", type=Path, default=Path("benchmarks/baseline.json"))
    p.add_argument("--margin", type=float, default=0.35)
    p.add_argument("--rerun", default=None, help="command that re-runs benchmarks (pytest)")
    p.add_argument("--update", action="store_true")
    args = p.parse_args(argv)
    runs = [ratios(path) for path in args.results]
    current = {name: max(run[name] for run in runs if name in run)
               for name in set().union(*runs)}
    if args.update:
        if len(runs) > 1:
            old = json.loads(args.baseline.read_text())["ratios"] \
                if args.baseline.exists() else {}
            current = {name: statistics.median([run[name] for run in runs if name in run]
                                               + ([old[name]] if name in old else []))
                       for name in current}
        args.baseline.write_text(json.dumps({"margin": args.margin, "ratios": current},
                                            indent=1, sort_keys=True) + "\n")
        print(f"bench_check: wrote {len(current)} ratios to {args.baseline}")
        return 0
    base = json.loads(args.baseline.read_text())
    margin = args.margin if args.margin is not None else base.get("margin", 0.35)
    suspects = {n: r for n, r in current.items()
                if n in base["ratios"] and r < base["ratios"][n] * (1 - margin)}
    for _ in range(2):
        if not suspects or not args.rerun:
            break
        again = rerun(args.rerun, list(suspects))
        for name, ratio in again.items():
            if name in suspects:
                suspects[name] = max(suspects[name], ratio)
        suspects = {n: r for n, r in suspects.items()
                    if r < base["ratios"][n] * (1 - margin)}
    missing = sorted(set(base["ratios"]) - set(current))
    print(f"bench_check: {len(current)} ratios, {len(base['ratios'])} in the baseline, margin "
          f"{margin:.0%}; {len(missing)} baseline entries not measured this run")
    for name, ratio in sorted(suspects.items()):
        print(f"REGRESSION {name}: ratio {ratio:.3f}x vs baseline {base['ratios'][name]:.3f}x "
              f"(more than {margin:.0%} below)")
    return 1 if suspects else 0


if __name__ == "__main__":
    sys.exit(main())
