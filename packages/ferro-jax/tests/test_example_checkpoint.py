"""examples/jax_data_parallel.py and examples/jax_zero.py with checkpoints (ferro-checkpoint):
saved on 2 ranks, resumed on 1 with the parameters bit-identical to the saved ones, the loss
curve continued; the ZeRO variant's parameters against the data-parallel ones.

Small sizes (a 16-32-32-1 MLP, 8 + 4 steps): both examples on 2 ranks one after the other,
then both resumed at once (each alone, one rank): about 25 s on 2 idle cores."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
DP, ZERO = "jax_data_parallel.py", "jax_zero.py"
SMALL = ["--features", "16", "--hidden", "32", "--batch", "32"]
SAVED, RESUMED = 8, 12  # steps of the first run (checkpoints at 4 and 8), of the resumed one
# ZeRO's Adam runs on a flat vector, data parallel's on the parameter tree: XLA compiles its
# bias correction differently for the two (a division by the scalar, or a multiplication by
# its reciprocal), which moves some updates by an ulp. Measured after 8 steps: at most 6e-8
# apart (0 with data parallel's Adam on the flat vector too); held to 1e-6.
ZERO_ATOL = 1e-6

pytestmark = [pytest.mark.skipif(not EXAMPLES.exists(), reason="run from the repository"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux engine"),
              pytest.mark.timeout(420)]  # the module's runs: 3 x 120 s at most


def command(nproc: int, example: str, *args: str) -> list[str]:
    launcher = ["-m", "ferro_backend.launch", "--nproc", str(nproc)] if nproc > 1 else []
    return [sys.executable, *launcher, str(EXAMPLES / example), *SMALL, *args]


def check(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def curve(path: Path) -> list[float]:
    rows = path.read_text().splitlines()
    assert rows[0] == "step,loss"
    assert [int(r.split(",")[0]) for r in rows[1:]] == list(range(1, len(rows)))
    return [float(r.split(",")[1]) for r in rows[1:]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Each example for ``SAVED`` steps on 2 ranks saving every 4 (one after the other), then
    both resumed at once on 1 rank (each alone: no launcher) up to ``RESUMED``; the examples'
    working directories by name."""
    pytest.importorskip("optax")
    pytest.importorskip("ferro_checkpoint")
    dirs = {name: tmp_path_factory.mktemp(name.split(".")[0]) for name in (DP, ZERO)}
    for name, d in dirs.items():
        out = check(subprocess.run(
            command(2, name, "--steps", str(SAVED), "--checkpoint", "ckpt", "--save-every", "4",
                    "--params-out", "saved.npy", "--out", "saved.csv"),
            capture_output=True, text=True, timeout=120, cwd=d))
        assert out.count("replicas identical: True") == 2, out
    resumes = {name: subprocess.Popen(
        command(1, name, "--steps", str(RESUMED), "--checkpoint", "ckpt", "--resume",
                "--params-out", "resumed.npy", "--out", "resumed.csv"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=d)
        for name, d in dirs.items()}
    deadline = time.monotonic() + 120
    try:
        for name, p in resumes.items():
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            (dirs[name] / "resume.log").write_text(
                check(subprocess.CompletedProcess(p.args, p.returncode, out, err)))
    finally:
        for p in resumes.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return dirs


@pytest.mark.parametrize("example", [DP, ZERO])
def test_checkpoint_resumes_on_another_world_size(runs, example):
    """Saved on 2 ranks, resumed on 1: the parameters bit-identical to the saved ones (the
    example checks them against the SHA-256 saved with the step; here against the saving run's
    own output), the loss history back and training going on."""
    from ferro_checkpoint import load_distributed

    d = runs[example]
    saved = np.load(d / "saved.npy")
    # the checkpoint holds the final parameters, whole once the 2 ranks' slices are joined
    step = load_distributed(d / "ckpt" / f"step_{SAVED}", 0, 1)
    assert step["params"].dtype == saved.dtype and np.array_equal(step["params"], saved)
    assert step["adam_mu"].shape == step["adam_nu"].shape == saved.shape
    assert sorted(p.name for p in (d / "ckpt").iterdir()) == ["step_12", "step_4", "step_8"]
    log = (d / "resume.log").read_text()
    assert (f"resumed step {SAVED} (saved on 2 ranks) on 1 ranks; parameters bit-identical "
            "to the saved ones: True") in log, log
    assert f"({RESUMED - SAVED} steps from step {SAVED})" in log, log
    before, after = curve(d / "saved.csv"), curve(d / "resumed.csv")
    assert len(before) == SAVED and len(after) == RESUMED
    assert after[:SAVED] == before  # the history comes back with the checkpoint
    assert all(np.isfinite(after)) and max(after[SAVED:]) < after[0]  # and training goes on
    assert not np.array_equal(np.load(d / "resumed.npy"), saved)


def test_zero_matches_data_parallel(runs):
    """The same math: ZeRO's parameters and losses against data parallel's after 8 steps."""
    zero, dp = (np.load(runs[name] / "saved.npy") for name in (ZERO, DP))
    diff = float(np.abs(zero - dp).max())
    assert diff <= ZERO_ATOL, f"ZeRO's parameters {diff:.3g} from data parallel's"
    np.testing.assert_allclose(curve(runs[ZERO] / "saved.csv"), curve(runs[DP] / "saved.csv"),
                               rtol=1e-5)


@pytest.mark.parametrize("example", [DP, ZERO])
def test_a_resume_of_another_model_says_so(runs, example):
    r = subprocess.run(command(1, example, "--hidden", "16", "--steps", str(RESUMED + 2),
                               "--checkpoint", "ckpt", "--resume", "--out", "other.csv"),
                       capture_output=True, text=True, timeout=120, cwd=runs[example])
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "--resume: the checkpoint in ckpt is of another model {'features': 16, 'hidden': 32}; "
        "this run asks for {'features': 16, 'hidden': 16}")
    assert not (runs[example] / "other.csv").exists()


@pytest.mark.parametrize("example, args, message", [
    (ZERO, ["--save-every", "0"], "--save-every must be >= 1"),
    (DP, ["--save-every", "0"], "--save-every must be >= 1"),
    (DP, ["--batch", "0"], "--batch must be >= 1")])
def test_a_bad_flag_is_one_line_naming_it(example, args, message):
    """Refused at once, exit 2, naming the flag (a ZeroDivisionError at the first checkpoint,
    or a loss of nan, before)."""
    r = subprocess.run([sys.executable, str(EXAMPLES / example), *args], capture_output=True,
                       text=True, timeout=90)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert message in r.stderr.strip().splitlines()[-1], r.stderr
