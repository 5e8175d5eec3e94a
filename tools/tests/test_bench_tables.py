"""benchmarks/tables.py: the results layout's generated files (each peers run's results.md, the
README's marked tables, results/README.md) match the runs' JSON, and a stale one is named."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_tables():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_tables_are_what_the_results_give():
    assert load_tables().main(["--check"]) == 0


def test_a_changed_result_makes_its_tables_stale_and_a_rerun_mends_them(tmp_path, capsys):
    tables = load_tables()
    run = "results/0.3/2core/peers-2026-11-26-2/plain"
    bench = tmp_path / "benchmarks"
    (bench / run).mkdir(parents=True)
    for name in ("results.json", "results.md"):
        shutil.copy(ROOT / "benchmarks" / run / name, bench / run / name)
    (bench / "README.md").write_text(f"# t\n\n<!-- table: {run}/results.json world=2 -->\n"
                                     "| stale |\n<!-- /table -->\n")
    tables.HERE, tables.RESULTS, tables.README = bench, bench / "results", bench / "README.md"
    assert tables.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "stale: README.md" in out and "stale: results/README.md" in out
    assert tables.main([]) == 0 and tables.main(["--check"]) == 0
    data = json.loads((bench / run / "results.json").read_text())
    key = next(k for k in data if k.startswith("ferro-shm/"))
    data[key][0]["busbw_GBps"] = 99.0
    (bench / run / "results.json").write_text(json.dumps(data))
    assert tables.main(["--check"]) == 1
    assert f"stale: {run}/results.md" in capsys.readouterr().out
    assert "| stale |" not in (bench / "README.md").read_text()
