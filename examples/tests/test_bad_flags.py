"""Bad numbers on an example's command line: one line naming the flag (or the variable) and
exit status 2, at once, before any backend, data or model is made. (The JAX examples' are in
ferro-jax's tests: this session installs no JAX.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
pytestmark = pytest.mark.timeout(120)

BAD = [
    ("train_lm", ["--batch-size", "0"], "--batch-size must be >= 1"),
    ("train_lm", ["--batch-size", "-2"], "--batch-size must be >= 1"),
    ("train_lm", ["--eval-batches", "-1"], "--eval-batches must be >= 1"),
    ("train_lm", ["--layers", "0"], "--layers must be >= 1"),
    ("train_lm", ["--heads", "0"], "--heads must be >= 1"),
    ("train_lm", ["--heads", "-2"], "--heads must be >= 1"),
    ("train_lm", ["--heads", "3"], "--heads 3 does not divide --dim 256"),
    ("train_lm", ["--dim", "0"], "--dim must be >= 1"),
    ("train_lm", ["--seq", "0"], "--seq must be >= 1"),
    ("train_lm", ["--corpus-chars", "-5"], "--corpus-chars must be >= 1"),
    ("train_lm", ["--val-fraction", "0"], "--val-fraction must be between 0 and 1"),
    ("train_lm", ["--val-fraction", "-0.5"], "--val-fraction must be between 0 and 1"),
    ("train_lm", ["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
    ("train_lm", ["--eval-every", "-1"], "--eval-every must be >= 0"),
    ("train_mlp", ["--batch-size", "0"], "--batch-size must be >= 1"),
    ("train_mlp", ["--batch-size", "-4"], "--batch-size must be >= 1"),
    ("train_mlp", ["--dataset", "synthetic", "--samples", "3"],
     "--samples 3 leaves 2 training samples, fewer than one --batch-size 96"),
    ("train_mlp", ["--params", "0"], "--params must be >= 1"),
    ("train_mlp", ["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
    ("train_mlp", ["--lr", "nan"], "--lr must be a finite number >= 0"),
    ("train_elastic", ["--batch-size", "0"], "--batch-size must be >= 1"),
    ("train_elastic", ["--kill", "x"], "argument --kill: 'x' is not MEMBER@STEP"),
    ("train_elastic", ["--kill", "1@x"], "argument --kill: '1@x' is not MEMBER@STEP"),
    ("train_elastic", ["--resume"], "--resume needs --checkpoint-dir"),
    ("train_elastic", ["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
    ("train_lm", ["--strategy", "no_shard", "--weights-wire", "int8"],
     "--weights-wire compresses FSDP's all-gather of the parameters and --strategy no_shard "
     "gathers none"),
    ("train_lm", ["--dump-params", "/nonexistent-dir/p.npz"],
     "--dump-params: no directory /nonexistent-dir"),
    ("train_mlp", ["--dump-params", "examples"], "--dump-params: examples is a directory"),
    ("train_elastic", ["--history", "README.md/h.json"], "--history: no directory README.md"),
    ("train_mlp", ["--intra-node-size", "-1"], "--intra-node-size must be >= 1 (got -1)"),
    ("train_mlp", ["--intra-node-size", "0"], "--intra-node-size must be >= 1 (got 0)"),
    ("train_mlp", ["--step-file", "/nonexistent-dir"], "--step-file: no directory /nonexistent-dir"),
    ("train_mlp", ["--step-file", "README.md"], "--step-file: README.md is not a directory"),
    ("train_mlp", ["--fail-at-step", "0"], "--fail-at-step must be >= 1 (got 0)"),
    ("train_mlp", ["--checkpoint-dir", "README.md"], "--checkpoint-dir: README.md is not a directory"),
    ("train_mlp", ["--min-accuracy", "nan"], "--min-accuracy must be a number (got nan)"),
    ("train_lm", ["--intra-node-size", "0"], "--intra-node-size must be >= 1 (got 0)"),
    ("train_elastic", ["--plot", "/nonexistent-dir/p.png"], "--plot: no directory /nonexistent-dir"),
    ("train_elastic", ["--plot", "examples"], "--plot: examples is a directory"),
    ("train_elastic", ["--save-state", "/nonexistent-dir/s.npz"],
     "--save-state: no directory /nonexistent-dir"),
    ("train_elastic", ["--load-state", "/nonexistent.npz"], "--load-state: no file /nonexistent.npz"),
    ("train_elastic", ["--step-file", "/nonexistent-dir"], "--step-file: no directory /nonexistent-dir"),
    ("train_elastic", ["--checkpoint-dir", "README.md"],
     "--checkpoint-dir: README.md is not a directory"),
    ("bus_bandwidth", ["--plot", "/nonexistent-dir/b.png"], "--plot: no directory /nonexistent-dir"),
    ("bus_bandwidth", ["--seconds", "nan"], "--seconds must be a finite number > 0"),
    ("bus_bandwidth", ["--seconds", "-1"], "--seconds must be a finite number > 0"),
    ("bus_bandwidth", ["--seconds", "inf"], "--seconds must be a finite number > 0"),
]


def run(script: str, args: list[str], **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "FERRO_ELASTIC", "FERRO_RESTART_COUNT")}
    return subprocess.run([sys.executable, str(EXAMPLES / f"{script}.py"), *args],
                          capture_output=True, text=True, timeout=90, cwd=ROOT,
                          env=dict(environ, **env))


@pytest.mark.parametrize("script, args, message", BAD,
                         ids=[f"{s}{''.join(a)}" for s, a, _ in BAD])
def test_a_bad_flag_is_one_line_naming_it(script, args, message):
    r = run(script, args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert message in last, r.stderr
    if last.startswith(f"{script}: "):  # the scripts' own style: that one line only
        assert r.stderr == last + "\n"


@pytest.mark.parametrize("script", ["train_lm", "train_mlp"])
def test_a_bad_ferro_restart_count_names_the_variable(script):
    r = run(script, ["--no-progress"], FERRO_RESTART_COUNT="abc")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == (f"{script}: FERRO_RESTART_COUNT 'abc' is invalid, expected a whole "
                        "number >= 0\n")


@pytest.mark.parametrize("script", ["train_mlp", "train_lm"])
def test_ranks_per_node_that_do_not_divide_the_world_are_one_line(script):
    """--intra-node-size 3 on 2 ranks: the flag named, not FSDP's traceback."""
    tiny = (["--dataset", "synthetic", "--params", "5000", "--samples", "512"]
            if script == "train_mlp" else ["--dim", "16", "--layers", "1", "--heads", "2",
                                           "--seq", "8", "--corpus-chars", "5000"])
    environ = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "FERRO_ELASTIC", "FERRO_RESTART_COUNT")}
    r = subprocess.run([sys.executable, "-m", "ferro_backend.launch", "--nproc", "2",
                        str(EXAMPLES / f"{script}.py"), "--strategy", "hybrid_shard",
                        "--intra-node-size", "3", "--steps", "1", "--no-progress", *tiny],
                       capture_output=True, text=True, timeout=90, cwd=ROOT, env=environ)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in out, out
    assert f"{script}: 3 ranks per node (--intra-node-size) do not divide the 2 ranks" in out
