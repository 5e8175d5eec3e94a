"""Shared benchmark plumbing: every group pairs ferro with a baseline measured in the same run.

A benchmark marks its role with ``benchmark.extra_info["role"] = "baseline"`` (or "ferro", the
default; "context": timed and saved, but given no ratio, so the gate ignores it). After the
run, each group's ferro entries get ``ratio_vs_baseline`` in the saved JSON:
baseline median time / ferro median time, so 1.0 means as fast as the baseline and 2.0 twice as
fast. The terminal summary prints the same ratios, and ``--ratios-md FILE`` writes them as a
Markdown table (the figures in benchmarks/README.md come from there).
"""

from __future__ import annotations

import platform
from collections import defaultdict

import pytest

BASELINE_WORDS = ("baseline", "numpy", "memcpy", "copyto", "raw_socket", "safetensors",
                  "single_process", "plain_copy")

_ratios: list[tuple[str, str, str, float, float, float]] = []


def pytest_addoption(parser):
    parser.addoption("--ratios-md", default=None, help="write the ratio table to this file")


def _role(bench: dict) -> str:
    role = (bench.get("extra_info") or {}).get("role")
    if role:
        return role
    name = bench.get("param") or bench.get("name", "")
    return "baseline" if any(w in str(name) for w in BASELINE_WORDS) else "ferro"


def _median(bench: dict) -> float:
    return bench["stats"]["median"]


def pytest_benchmark_update_json(config, benchmarks, output_json):
    groups: dict[str, list[dict]] = defaultdict(list)
    for bench in output_json["benchmarks"]:
        groups[bench.get("group") or bench["name"]].append(bench)
    _ratios.clear()
    for group, benches in sorted(groups.items()):
        baselines = [b for b in benches if _role(b) == "baseline"]
        if not baselines:
            continue
        base = baselines[0]
        for bench in benches:
            if bench is base or _role(bench) == "context":
                continue
            ratio = _median(base) / _median(bench)
            bench.setdefault("extra_info", {})["ratio_vs_baseline"] = ratio
            bench["extra_info"]["baseline"] = base["name"]
            _ratios.append((group, bench["name"], base["name"], _median(bench), _median(base),
                            ratio))
    output_json["machine_info"]["ferro_note"] = (
        f"{platform.processor() or platform.machine()}, ratios = baseline time / ferro time")


def _table() -> str:
    lines = ["| group | ferro | baseline | ferro median | baseline median | ratio |",
             "|---|---|---|---|---|---|"]
    for group, name, base, t, tb, ratio in _ratios:
        lines.append(f"| {group} | {name} | {base} | {t * 1e3:.3f} ms | {tb * 1e3:.3f} ms "
                     f"| {ratio:.2f}x |")
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _ratios:
        return
    terminalreporter.section("ferro vs baseline (ratio = baseline time / ferro time)")
    terminalreporter.write_line(_table())
    path = config.getoption("--ratios-md")
    if path:
        with open(path, "w") as f:
            f.write(_table() + "\n")


@pytest.fixture
def role(benchmark):
    """``role("baseline")`` marks the current benchmark as the group's baseline."""

    def mark(value: str) -> None:
        benchmark.extra_info["role"] = value

    return mark
