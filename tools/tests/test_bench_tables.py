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


def load_host_state():
    load_tables()  # (puts benchmarks/ on the path: host_state imports peers to render)
    import host_state

    return host_state


def test_a_launchs_state_is_what_the_probes_either_side_agree_on():
    hs = load_host_state()
    assert [hs.state_of(ns) for ns in (28, 74.9, 75, 133, 249, 250, 476)] == [
        "shared", "shared", "apart", "apart", "apart", "far", "far"]
    assert hs.launch_state([40, 25.0], [60, 24.0]) == "shared"
    assert hs.launch_state([110, 6.0], [450, 1.8]) == "moved"
    assert hs.launch_state(None, [450, 1.8]) is None and hs.launch_state([450, 1.8], None) is None


def test_the_states_table_compares_ferro_with_the_fastest_mpi_in_each_state():
    hs = load_host_state()

    def launch(impl, probes, us):
        return {"impl": impl, "world": 2, "probes": probes,
                "rows": [{"op": "allreduce", "bytes": 1 << 20, "seconds": us * 1e-6},
                         {"op": "barrier", "bytes": 0, "seconds": us * 1e-8}]}

    near, far = [40, 25.0], [450, 1.8]
    md = hs.states_markdown([launch("ferro-shm", [near, near], 40), launch("ferro-shm",
                                                                            [near, near], 44),
                             launch("ferro-shm", [far, far], 90), launch("impi", [near, near], 50),
                             launch("mpi-sm", [near, near], 48), launch("mpi-sm", [far, far], 60),
                             launch("mpi", [near, far], 10)], [2], ("mpi", "mpi-sm", "impi"))
    assert "- **shared** (the cores share a cache (round trip < 75 ns)): launches ferro-shm 2, " \
           "impi 1, mpi-sm 1" in md
    assert "- **moved** (the probes before and after the launch disagree): launches mpi 1" in md
    # ferro's median of 40 and 44 us (42) against mpi-sm's 48: 1.14x; far: 60 / 90
    assert "| allreduce | 1 MiB | 42.00 (2) | 48.00 (mpi-sm, 1) | 1.14x |" in md
    assert "| allreduce | 1 MiB | 90.00 (1) | 60.00 (mpi-sm, 1) | 0.67x |" in md
    assert "| barrier | - | 0.42 (2) | 0.48 (mpi-sm, 1) | 1.14x |" in md
    assert "10.00" not in md  # a launch whose state moved is in no state's table


def test_the_tables_threshold_is_the_engines():
    link = __import__("pytest").importorskip("ferro_backend.engine.link")
    assert load_host_state().SHARED_CACHE_NS == link.SHARED_CACHE_NS
