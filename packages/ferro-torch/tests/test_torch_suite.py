"""A few of torch's own distributed tests (torch/testing/_internal/distributed/
distributed_test.py, the fastest covering each cause issue 33 found) on "ferro" through the
project's driver, tools/torch_suite/run_suite.py, configured as for gloo. The whole suite runs
in ``nox -s torch_suite`` (about 15 minutes here), not in the test line."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DRIVER = ROOT / "tools" / "torch_suite" / "run_suite.py"
# one, for the test line's time (37 s for two in CI, stop 37): coalescing, monitored_barrier,
# torch-worded timeouts and receives from any source, the other causes, are held by
# test_torch_api here and by test_all_gather_coalesced_simple,
# test_monitored_barrier_gloo_subgroup, test_barrier_timeout_full_group and
# test_send_recv_any_source in the whole suite (nox -s torch_suite)
TESTS = [
    "test_sparse_all_reduce_sum",  # sparse COO allreduce
]


@pytest.mark.timeout(400)
def test_torch_suite_sample_passes_on_ferro():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FERRO_TOKEN")}
    # torch's per-test limit: 120 s ran out on a clean-clone line loaded 9 processes per core
    # (the test takes 37 s in CI); 300 s stays inside this test's own 380 s
    env.update(FERRO_SUITE_BACKEND="ferro", WORLD_SIZE="2", OMP_NUM_THREADS="1",
               DISTRIBUTED_TESTS_DEFAULT_TIMEOUT="300")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "outcomes.json"
        r = subprocess.run([sys.executable, str(DRIVER), "-q", "--out", str(out), *TESTS],
                           capture_output=True, text=True, timeout=380, env=env, cwd=tmp)
        assert out.exists(), (r.stdout + r.stderr)[-6000:]
        tests = json.loads(out.read_text())["tests"]
    bad = {k: v["detail"][-800:] for k, v in tests.items() if v["outcome"] != "passed"}
    assert sorted(tests) == sorted(TESTS) and not bad, bad
