"""train_mlp.py without its optional packages, its --min-accuracy verdict, and its loss plot."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_mlp.py"
OPTIONAL = ("sklearn", "tqdm", "matplotlib")
pytestmark = pytest.mark.timeout(300)

# Runs train_mlp.py as `python train_mlp.py ARGS` (one rank) with OPTIONAL unimportable, as on a
# machine where only the ferro packages are installed.
BLOCKER = f"""
import os, runpy, sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {OPTIONAL!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
sys.meta_path.insert(0, Blocker())
sys.path.insert(0, os.path.dirname(sys.argv[1]))  # as `python SCRIPT` would
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_without_optional(*args, cwd, script=SCRIPT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER, str(script), *map(str, args)],
                          capture_output=True, text=True, timeout=240, cwd=cwd)


def run_one_rank(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=240, cwd=cwd)


def test_requirements_txt_lists_the_optional_packages():
    lines = (ROOT / "examples" / "requirements.txt").read_text().splitlines()
    names = {re.split(r"[\s#<>=~!;\[]", ln.strip())[0] for ln in lines if ln.strip()} - {""}
    assert names == {"scikit-learn", "tqdm", "matplotlib"}
    assert "examples/requirements.txt" in (ROOT / "README.md").read_text()


def test_help_works_without_the_optional_packages(tmp_path):
    r = run_without_optional("--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--min-accuracy" in r.stdout and "--dataset" in r.stdout


def test_digits_without_scikit_learn_names_the_pip_package(tmp_path):
    r = run_without_optional("--steps", 1, "--no-progress", cwd=tmp_path)
    assert r.returncode != 0
    assert "pip install scikit-learn" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_train_elastic_without_scikit_learn_offers_no_flag_it_lacks(tmp_path):
    """train_elastic trains on train_mlp's digits: its message recommended train_mlp's
    --dataset synthetic, which train_elastic does not have."""
    r = run_without_optional("--steps", 1, cwd=tmp_path, script=SCRIPT.with_name("train_elastic.py"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("train_elastic: ") and "pip install scikit-learn" in r.stderr
    assert "--dataset" not in r.stderr, r.stderr


def test_synthetic_run_without_any_optional_package(tmp_path):
    r = run_without_optional("--dataset", "synthetic", "--params", 5000, "--samples", 512,
                             "--steps", 3, "--checkpoint-dir", tmp_path / "ckpt", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tqdm not installed (pip install tqdm): no progress bar" in r.stdout
    assert "matplotlib not installed (pip install matplotlib)" in r.stdout
    assert "summary: " in r.stdout


def test_min_accuracy_met_and_not_met_are_said(tmp_path):
    r = run_one_rank("--steps", 30, "--no-progress", "--min-accuracy", 0.5, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.endswith(": met")]
    m = re.fullmatch(r"held-out accuracy (\d\.\d+) >= --min-accuracy 0\.5: met", line)
    assert m and float(m.group(1)) >= 0.5, line
    r = run_one_rank("--steps", 2, "--no-progress", "--min-accuracy", 1.01, cwd=tmp_path)
    assert r.returncode == 3 and "is below --min-accuracy 1.01" in r.stdout
    assert ": met" not in r.stdout


def load_train_mlp():
    spec = importlib.util.spec_from_file_location("train_mlp_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loss_plot_has_a_title_and_a_line_where_each_resume_starts(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    train_mlp = load_train_mlp()
    history = [
        {"run": 1, "world_size": 4, "strategy": "full_shard", "start_step": 0,
         "losses": [[s, 2.0 / s] for s in range(1, 11)]},
        {"run": 2, "world_size": 2, "strategy": "full_shard", "start_step": 10,
         "losses": [[s, 2.0 / s] for s in range(11, 21)]},
        # a history written before start_step was recorded: the start comes from the losses
        {"run": 3, "world_size": 1, "strategy": "ddp", "losses": [[s, 2.0 / s] for s in (21, 22)]},
    ]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    train_mlp.plot_losses(json.loads(json.dumps(history)), tmp_path / "curve.png")
    (fig,) = figures
    (ax,) = fig.axes
    assert ax.get_title() == "train_mlp: training loss of 3 runs (2 resumes, dashed)"
    vertical = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert sorted(ln.get_xdata()[0] for ln in vertical) == [10, 20]
    labels = ax.get_legend_handles_labels()[1]
    assert "run 2 resumes at step 10" in labels and "run 3 resumes at step 20" in labels
    assert (tmp_path / "curve.png").stat().st_size > 1000
    monkeypatch.undo()
    plt.close(fig)


def test_digits_read_from_scikit_learns_file_equal_load_digits():
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits

    x, y = load_train_mlp().load_digits()
    ref_x, ref_y = load_digits(return_X_y=True)
    assert x.dtype == ref_x.dtype and y.dtype == ref_y.dtype
    np.testing.assert_array_equal(x, ref_x)
    np.testing.assert_array_equal(y, ref_y)


def test_no_plot_writes_no_curve(tmp_path):
    r = run_one_rank("--steps", 2, "--no-progress", "--no-plot", "--checkpoint-dir",
                     tmp_path / "ckpt", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "ckpt" / "summary.json").exists()
    assert not (tmp_path / "ckpt" / "loss_curve.png").exists() and "loss curve" not in r.stdout
