"""The benchmark regression gate (tools/bench_check.py) fails on a regression, names it, and
passes within the margin."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GATE = [sys.executable, str(ROOT / "tools" / "bench_check.py")]


def _results(path: Path, ratios: dict[str, float]) -> Path:
    path.write_text(json.dumps({"benchmarks": [
        {"fullname": name, "extra_info": {"ratio_vs_baseline": r}} for name, r in ratios.items()
    ] + [{"fullname": "bench_x.py::numpy_side", "extra_info": {"role": "baseline"}}]}))
    return path


def test_gate_fails_naming_the_regression_and_passes_within_the_margin(tmp_path):
    base = tmp_path / "baseline.json"
    good = {"bench_a.py::fast[1]": 2.0, "bench_a.py::fast[2]": 1.0}
    r = subprocess.run([*GATE, str(_results(tmp_path / "r0.json", good)), "--baseline", str(base),
                        "--update"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(base.read_text())["ratios"] == good
    within = {"bench_a.py::fast[1]": 1.4, "bench_a.py::fast[2]": 0.7}  # -30%: inside 35%
    r = subprocess.run([*GATE, str(_results(tmp_path / "r1.json", within)), "--baseline",
                        str(base)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout
    worse = {"bench_a.py::fast[1]": 1.2, "bench_a.py::fast[2]": 0.9}  # -40% on the first
    r = subprocess.run([*GATE, str(_results(tmp_path / "r2.json", worse)), "--baseline",
                        str(base)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "REGRESSION bench_a.py::fast[1]: ratio 1.200x vs baseline 2.000x" in r.stdout
    assert "fast[2]" not in r.stdout.split("REGRESSION", 1)[1]


def test_committed_baseline_covers_the_engine_and_the_kernels():
    ratios = json.loads((ROOT / "benchmarks" / "baseline.json").read_text())["ratios"]
    assert any(name.startswith("bench_engine.py::bench_engine_2_ranks") for name in ratios)
    assert any("fold" in name for name in ratios)


def test_an_update_from_several_runs_takes_each_ratios_median_with_the_baseline(tmp_path):
    base = tmp_path / "baseline.json"
    base.write_text(json.dumps({"margin": 0.35, "ratios": {"b.py::x": 1.0, "b.py::y": 2.0}}))
    runs = [_results(tmp_path / f"r{i}.json", r) for i, r in enumerate((
        {"b.py::x": 3.0, "b.py::y": 0.5, "b.py::new": 4.0},  # x better in both runs
        {"b.py::x": 2.5, "b.py::y": 2.2, "b.py::new": 5.0}))]  # y slow in one run only
    r = subprocess.run([*GATE, *map(str, runs), "--baseline", str(base), "--update"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(base.read_text())["ratios"] == {"b.py::x": 2.5, "b.py::y": 2.0,
                                                      "b.py::new": 4.5}
    # checking several runs counts each benchmark's best: y's slow run is no regression
    r = subprocess.run([*GATE, *map(str, runs), "--baseline", str(base)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout
