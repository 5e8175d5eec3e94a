"""The benchmark gate's plumbing: benchmarks/conftest.py's same-run ratios (roles baseline,
ferro, context) and tools/bench_check.py's verdicts and baseline updates, on fake result files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import bench_check

ROOT = Path(__file__).resolve().parents[2]


def bench_conftest():
    spec = importlib.util.spec_from_file_location("bench_conftest", ROOT / "benchmarks" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def entry(name: str, median: float, role: str | None = None, group: str = "g") -> dict:
    extra = {"role": role} if role else {}
    return {"name": name, "fullname": f"b.py::{name}", "group": group,
            "stats": {"median": median}, "extra_info": extra}


def test_ratios_are_against_the_baseline_and_context_gets_none():
    out = {"benchmarks": [entry("x[np.copyto]", 1.0, "baseline"), entry("x[path]", 8.0, "context"),
                          entry("x[engine]", 4.0)], "machine_info": {}}
    bench_conftest().pytest_benchmark_update_json(None, None, out)
    by = {b["name"]: b["extra_info"] for b in out["benchmarks"]}
    assert by["x[engine]"]["ratio_vs_baseline"] == 0.25
    assert "ratio_vs_baseline" not in by["x[path]"]
    assert "ratio_vs_baseline" not in by["x[np.copyto]"]


def results(tmp_path: Path, name: str, ratios: dict[str, float]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"benchmarks": [
        {"fullname": n, "extra_info": {"ratio_vs_baseline": r}} for n, r in ratios.items()]}))
    return path


def test_a_ratio_more_than_the_margin_below_fails_naming_it(tmp_path, capsys):
    base = tmp_path / "baseline.json"
    base.write_text(json.dumps({"margin": 0.35, "ratios": {"a": 1.0, "b": 2.0}}))
    ok = results(tmp_path, "ok.json", {"a": 0.7, "b": 1.4})
    assert bench_check.main([str(ok), "--baseline", str(base)]) == 0
    bad = results(tmp_path, "bad.json", {"a": 0.7, "b": 1.2})
    assert bench_check.main([str(bad), "--baseline", str(base)]) == 1
    assert "REGRESSION b: ratio 1.200x vs baseline 2.000x" in capsys.readouterr().out


def test_update_from_several_runs_takes_the_median_with_the_committed_ratio(tmp_path):
    base = tmp_path / "baseline.json"
    base.write_text(json.dumps({"margin": 0.35, "ratios": {"a": 1.0}}))
    runs = [results(tmp_path, f"r{i}.json", {"a": r, "new": r}) for i, r in enumerate((3.0, 0.5))]
    assert bench_check.main([*map(str, runs), "--baseline", str(base), "--update"]) == 0
    assert json.loads(base.read_text())["ratios"] == {"a": 1.0, "new": 1.75}
