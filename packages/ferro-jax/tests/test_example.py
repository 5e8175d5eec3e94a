"""examples/jax_data_parallel.py on 2 ranks under ferrorun: it trains, the replicas stay
identical, the loss curve is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "jax_data_parallel.py"

pytestmark = [pytest.mark.skipif(not EXAMPLE.exists(), reason="run from the repository"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux engine")]


def test_data_parallel_example_on_two_ranks(tmp_path):
    pytest.importorskip("optax")
    out = tmp_path / "curve.csv"
    r = subprocess.run([sys.executable, "-m", "ferro_backend.launch", "--nproc", "2",
                        str(EXAMPLE), "--steps", "40", "--out", str(out)],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if "replicas identical: True" in line]
    assert len(lines) == 2, r.stdout
    rows = out.read_text().splitlines()
    assert rows[0] == "step,loss" and len(rows) == 41
    assert float(rows[-1].split(",")[1]) < float(rows[1].split(",")[1])
    if len(os.sched_getaffinity(0)) >= 2:  # the engine probes the ranks' cores (not when
        # they outnumber the cores): the link as the job formed and at its end, once
        (said,) = [line for line in r.stdout.splitlines() if "link: as the job formed" in line]
        assert said.count("the ranks' cores share") == 2 and "GB/s" in said, said
