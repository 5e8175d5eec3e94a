"""The examples and the README's commands, run as a user runs them."""

import json
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
FERRORUN = [sys.executable, "-m", "ferro_backend.launch"]
pytestmark = pytest.mark.timeout(300)


def ferrorun(nproc: int, script: Path, *args, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run([*FERRORUN, "--nproc", str(nproc), "--transport", "tcp", str(script),
                        *map(str, args)], capture_output=True, text=True, timeout=240,
                       cwd=ROOT)
    if check:
        assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S)
    return [line.strip() for b in blocks for line in b.splitlines()
            if line.strip().startswith(("python3 -m pip", "ferrorun", "nox", "./dev"))]


def test_readme_shows_the_quickstart_verbatim():
    text = (ROOT / "README.md").read_text()
    assert (EXAMPLES / "quickstart.py").read_text().strip() in text


def test_readme_commands_are_the_ones_we_run():
    cmds = readme_commands()
    # the two set-up lines (CI runs the second) and the quickstart line (run below)
    assert "./dev demo" in cmds
    assert "./dev tests" in cmds
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("./dev tests")
    assert "ferrorun --nproc 2 examples/quickstart.py" in cmds


def test_quickstart_as_the_readme_runs_it():
    line = next(c for c in readme_commands() if c.startswith("ferrorun"))
    r = subprocess.run([sys.executable, "-m", "ferro_backend.launch", *line.split()[1:]],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    found = re.findall(r"rank (\d) of 2: loss (\S+) at step 1, (\S+) at step 300", r.stdout)
    assert sorted(rank for rank, _, _ in found) == ["0", "1"], r.stdout
    for _, first, last in found:  # it shows that training happened: the loss fell
        assert float(first) > 1.0 and float(last) < 1e-2 * float(first), r.stdout
    # and the README says what it prints in the same form
    assert re.search(r"`\[rank 0\] rank 0 of 2: loss \S+ at step 1, \S+ at step 300`",
                     (ROOT / "README.md").read_text())


def final_params(tmp_path, name, runs, strategy, optimizer="sgd", start_from=None):
    """Run train_mlp in pieces [(nproc, total_steps), ...] resuming in between (the first
    piece too when ``start_from`` names an earlier run whose checkpoint to resume from);
    return the final full parameters."""
    ckpt = tmp_path / f"ckpt-{name}"
    dump = tmp_path / f"{name}.npz"
    if start_from is not None:
        shutil.copytree(tmp_path / f"ckpt-{start_from}", ckpt)
    for i, (nproc, steps) in enumerate(runs, start=start_from is not None):
        args = ["--steps", steps, "--strategy", strategy, "--optimizer", optimizer,
                "--dtype", "float64", "--batch-size", 48, "--checkpoint-dir", ckpt,
                "--no-progress", "--no-plot", "--dump-params", dump]
        if strategy == "hybrid_shard":
            args += ["--intra-node-size", 1]
        if i:
            args.append("--resume")
        ferrorun(nproc, EXAMPLES / "train_mlp.py", *args)
    with np.load(dump) as z:
        return {k: z[k] for k in z.files}, json.loads((ckpt / "summary.json").read_text())


# the script's paths (save, restore, reshard) are one for every strategy: ZeRO-3 and DDP end
# to end here; every strategy's resume on another world size (hybrid_shard to and from
# full_shard, shard_grad_op and no_shard included) is held by ferro-fsdp's test_state_dict,
# in-process, and the demo and the elastic tests run full_shard under ferrorun too
@pytest.mark.parametrize("strategy", ["full_shard", "ddp"])
def test_train_then_resume_on_1_and_3_ranks_matches_an_uninterrupted_run(tmp_path, strategy):
    straight, summary = final_params(tmp_path, "straight", [(2, 6)], strategy)
    final_params(tmp_path, "half", [(2, 3)], strategy)  # one first half, resumed twice
    for other in (1, 3):
        resumed, rsummary = final_params(tmp_path, f"resume{other}", [(other, 6)], strategy,
                                         start_from="half")
        assert rsummary["steps"] == 6 and rsummary["world_size"] == other
        assert resumed.keys() == straight.keys()
        for k in straight:
            np.testing.assert_allclose(resumed[k], straight[k], rtol=1e-10, atol=1e-12,
                                       err_msg=f"{strategy}: {k} after resume on {other}")
        # the whole held-out set is scored whatever the world size (each rank its share)
        assert rsummary["held_out_accuracy"] == summary["held_out_accuracy"]
        assert rsummary["held_out_loss"] == pytest.approx(summary["held_out_loss"], rel=1e-6)
    assert summary["held_out_accuracy"] > 0.3 and 0 < summary["held_out_loss"] < np.log(10)


def test_loss_curve_continues_across_a_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    ferrorun(2, EXAMPLES / "train_mlp.py", "--steps", 20, "--checkpoint-dir", ckpt,
             "--checkpoint-every", 5, "--no-progress")
    r = ferrorun(1, EXAMPLES / "train_mlp.py", "--steps", 40, "--checkpoint-dir", ckpt,
                 "--resume", "--no-progress")
    assert "resumed from step 20" in r.stdout
    history = json.loads((ckpt / "loss_history.json").read_text())
    assert [run["world_size"] for run in history] == [2, 1]
    first, second = history[0]["losses"], history[1]["losses"]
    assert [s for s, _ in first] == list(range(1, 21))
    assert [s for s, _ in second] == list(range(21, 41))
    # continues where it stopped: no jump back to the untrained loss
    assert second[0][1] < 0.8 * first[0][1]
    assert (ckpt / "loss_curve.png").stat().st_size > 1000


def test_bad_batch_size_is_a_clear_error(tmp_path):
    r = ferrorun(2, EXAMPLES / "train_mlp.py", "--batch-size", 7, "--steps", 1, check=False)
    assert r.returncode != 0 and "not divisible by 2 ranks" in r.stderr


def test_ferrorun_timeout_reaches_the_collectives(tmp_path):
    script = tmp_path / "silent_peer.py"
    script.write_text(
        "import time\n"
        "import numpy as np\n"
        "import ferro_backend, ferro_collective\n"
        # (the rendezvous may take longer than --timeout on a loaded host: not what is tested)
        "b = ferro_backend.init_from_env(connect_timeout=60)\n"
        "assert b.timeout == 0.5, b.timeout\n"
        "if b.rank == 1:\n"
        "    time.sleep(300)\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        "    ferro_collective.allreduce(np.ones(4), b)\n"
        "except ferro_backend.CollectiveTimeoutError as exc:\n"
        "    print(f'TIMED OUT after {time.monotonic() - t0:.2f}s: {exc}', flush=True)\n"
        "    raise SystemExit(3)\n")
    t0 = time.monotonic()
    r = subprocess.run([*FERRORUN, "--nproc", "2", "--transport", "tcp", "--timeout", "0.5",
                        "--grace", "1", str(script)], capture_output=True, text=True, timeout=150,
                       cwd=ROOT)
    assert r.returncode == 3, r.stdout + r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if "TIMED OUT" in ln]
    # at the 0.5 s timeout (nothing else ends the allreduce; the bound allows for load)
    assert float(line.split("after ")[1].split("s:")[0]) < 5
    # rank 1 (asleep for 300 s) was stopped, not waited for; the bound allows for the starts of
    # ferrorun and both ranks on a loaded host
    assert time.monotonic() - t0 < 60


def killed_run_ends_like_an_unbroken_one(tmp_path, common: list[str], seed: int) -> None:
    """train_mlp with ``common`` on 2 ranks, unbroken; then again with rank 1 killed at a
    random step under ferrorun --max-restarts: the same parameters, bit for bit."""
    script = EXAMPLES / "train_mlp.py"
    r = subprocess.run([*FERRORUN, "--nproc", "2", str(script), *common, "--checkpoint-dir",
                        str(tmp_path / "a"), "--dump-params", str(tmp_path / "a.npz")],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    kill_at = random.Random(seed).randrange(5, 29)
    r = subprocess.run([*FERRORUN, "--nproc", "2", "--max-restarts", "2", "--grace", "1",
                        str(script), *common, "--checkpoint-dir", str(tmp_path / "b"),
                        "--dump-params", str(tmp_path / "b.npz"), "--fail-at-step",
                        str(kill_at)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ferrorun: rank 1 was killed by SIGKILL; restarting the job (1 of 2)" in r.stderr
    assert "restart 1)" in r.stdout  # it resumed by itself from its newest checkpoint
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
        assert a[name].tobytes() == b[name].tobytes(), name  # bit for bit


def test_a_killed_rank_restarts_and_the_run_ends_bit_identical(tmp_path):
    killed_run_ends_like_an_unbroken_one(tmp_path, [
        "--strategy", "full_shard", "--optimizer", "adam", "--steps", "30",
        "--checkpoint-every", "4", "--no-progress"], seed=7)


def test_powersgd_state_goes_with_the_checkpoints(tmp_path):
    """DDP with PowerSGD (rank 2, compressing from step 3): its error feedback and warm-start
    Qs are in every checkpoint, so a run killed after compression started resumes exactly."""
    killed_run_ends_like_an_unbroken_one(tmp_path, [
        "--strategy", "ddp", "--comm-hook", "powersgd", "--powersgd-rank", "2",
        "--powersgd-start", "3", "--optimizer", "sgd", "--steps", "30", "--checkpoint-every",
        "4", "--no-progress"], seed=11)


def test_resume_from_a_mistyped_directory_is_refused(tmp_path):
    r = ferrorun(1, EXAMPLES / "train_mlp.py", "--steps", "2", "--resume", "--checkpoint-dir",
                 tmp_path / "no-such-ckpt", "--no-progress", check=False)
    assert r.returncode != 0
    said = r.stderr + r.stdout
    assert "--resume" in said and "no-such-ckpt" in said and "check the path" in said


def test_resume_with_another_hidden_width_is_refused_in_one_line(tmp_path):
    """--resume --hidden 4 over a --hidden 8 checkpoint on 2 ranks: every rank's piece has the
    narrower model's size; it "resumed" (a model of the checkpoint's halves), now it is refused."""
    common = ["--steps", "2", "--checkpoint-dir", tmp_path / "ckpt", "--no-progress", "--no-plot"]
    ferrorun(2, EXAMPLES / "train_mlp.py", "--hidden", "8", *common)
    r = ferrorun(2, EXAMPLES / "train_mlp.py", "--hidden", "4", "--resume", *common, check=False)
    said = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in said, said[-3000:]
    assert "resume: the checkpoint of step 2 does not fit this model" in said, said[-3000:]
    assert "another shape" in said and "resumed from" not in said


def test_bus_bandwidth_sweeps_sizes_and_refuses_an_empty_range():
    r = ferrorun(2, EXAMPLES / "bus_bandwidth.py", "--min-bytes", "4096", "--max-bytes", "65536",
                 "--seconds", "0.01")
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("[rank 0] | ") and "KiB" in ln]
    assert [row.split("|")[1].strip() for row in rows] == ["4 KiB", "16 KiB", "64 KiB"], r.stdout
    for row in rows:  # four positive bus bandwidths per size
        values = [float(v) for v in row.split("|")[2:-1]]
        assert len(values) == 4 and all(v > 0 for v in values), row
    bad = subprocess.run([sys.executable, str(EXAMPLES / "bus_bandwidth.py"), "--min-bytes",
                          "8192", "--max-bytes", "4096"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--min-bytes (8192) <= --max-bytes (4096)" in bad.stderr


def test_bus_bandwidth_names_sizes_under_a_kib_in_bytes():
    """Every size under 1 KiB was "0 KiB" (and 3000 bytes "2 KiB")."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bus_bandwidth", EXAMPLES / "bus_bandwidth.py")
    bus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bus)
    got = [bus.human(n) for n in (4, 256, 1023, 1024, 3000, 4096, 1536 << 10, 16 << 20,
                                   (1 << 20) - 1)]
    assert got == ["4 B", "256 B", "1023 B", "1 KiB", "2.9 KiB", "4 KiB", "1.5 MiB", "16 MiB",
                   "1023.9 KiB"]
