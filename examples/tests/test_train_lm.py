"""examples/train_lm.py: a tiny GPT trained on 2 ranks under ferrorun (real processes, the
default transport), checkpointed, resumed on 1 rank; and its data pipeline in-process."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ferro_backend.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_lm.py"
FERRORUN = [sys.executable, "-m", "ferro_backend.launch"]
TINY = ["--dim", 32, "--layers", 2, "--heads", 2, "--seq", 32, "--batch-size", 8,
        "--corpus-chars", 60_000, "--lr", 1e-2, "--warmup", 5, "--eval-every", 0,
        "--eval-batches", 1, "--sample-chars", 60, "--no-progress"]
# one BLAS thread per rank: two ranks on two cores, no oversubscription
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _load_module():
    spec = importlib.util.spec_from_file_location("train_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ferrorun(nproc: int, *args) -> subprocess.CompletedProcess:
    r = subprocess.run([*FERRORUN, "--nproc", str(nproc), str(SCRIPT), *map(str, args)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.timeout(200)
def test_train_lm_on_2_ranks_then_resume_on_1(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = ferrorun(2, *TINY, "--steps", 30, "--checkpoint-every", 10, "--checkpoint-dir", ckpt)
    assert "units ['', 'h.0', 'h.1']" in first.stdout     # one FSDP unit per block
    assert "sample (temperature 0.8, seed 0):" in first.stdout
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 30
    losses = [v for _, v in json.loads((ckpt / "loss_history.json").read_text())[0]["losses"]]
    assert len(losses) == 30
    assert np.mean(losses[-5:]) < 0.8 * losses[0], losses     # it learned something
    assert np.log(98) - 0.2 < losses[0] < np.log(98) + 0.5    # and started from chance
    assert (ckpt / "step_30").is_dir()

    second = ferrorun(1, *TINY, "--steps", 40, "--checkpoint-dir", ckpt, "--resume")
    assert "resumed from step 30" in second.stdout and "saved on 2 ranks" in second.stdout
    history = json.loads((ckpt / "loss_history.json").read_text())
    assert [run["world_size"] for run in history] == [2, 1]
    resumed = history[1]["losses"]
    assert [s for s, _ in resumed] == list(range(31, 41))
    # continues where it stopped: no jump back towards the untrained loss
    assert resumed[0][1] < 0.85 * losses[0] and resumed[0][1] < np.mean(losses[-5:]) + 0.3
    out = "\n".join(line.removeprefix("[rank 0] ") for line in second.stdout.splitlines())
    sample = out.split("-" * 72 + "\n")[1]
    assert sample.startswith("def ") and len(sample.rstrip("\n")) >= 60
    assert json.loads((ckpt / "summary.json").read_text())["steps"] == 40
    if importlib.util.find_spec("matplotlib") is not None:
        assert (ckpt / "loss_curve.png").stat().st_size > 1000
    assert "another corpus" not in second.stdout
    # resuming on another corpus goes on (fine-tuning) and says so: its held-out loss is another's
    third = ferrorun(1, *TINY, "--corpus-chars", 50_000, "--steps", 41, "--sample-chars", 0,
                     "--checkpoint-dir", ckpt, "--resume")
    assert "resumed from step 40" in third.stdout
    assert "train_lm: resuming a model trained on another corpus (sha256 " in third.stdout


def test_train_lm_data_is_deterministic_and_round_trips():
    lm = _load_module()
    text, files = lm.load_corpus(20_000)
    again, files_again = lm.load_corpus(20_000)
    assert text == again and files == files_again and len(text) == 20_000
    texts = lm.read_sources(200_000)
    train, held = lm.split_corpus(texts, 0.1)
    assert len(train) + len(held) == 200_000 and "".join(texts).startswith(text)
    assert held == "".join(texts[9::10]) and held and train.startswith(texts[0])
    tokens = lm.encode(text)
    assert tokens.min() >= 0 and tokens.max() < lm.VOCAB
    assert lm.decode(lm.encode("def f(x):\n\treturn x  # ok")) == "def f(x):\n\treturn x  # ok"
    assert lm.decode(lm.encode("caf\u00e9")) == "caf" + lm.OTHER_CHAR
    a = lm.batch_starts(len(tokens), 16, 4, seed=3, step=5)
    np.testing.assert_array_equal(a, lm.batch_starts(len(tokens), 16, 4, seed=3, step=5))
    x, y = lm.windows(tokens, a, 16)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])            # targets: the next character
    assert x.shape == y.shape == (4, 16)


@pytest.mark.timeout(180)
def test_int8_gradients_resume_with_the_bits_of_an_unbroken_run(tmp_path):
    """FSDP with --grads-wire int8: each rank's error feedback goes into the checkpoint, so the
    steps after a resume lose exactly what the unbroken run's did. The unbroken run also
    gathers its backward's parameters from secondary shards (--secondary-shard, one rank a
    node), which must not change a bit either."""
    wire = ["--grads-wire", "int8"]
    ferrorun(2, *TINY, *wire, "--steps", 8, "--checkpoint-every", 4, "--checkpoint-dir",
             tmp_path / "straight", "--secondary-shard", "--intra-node-size", 1)
    assert json.loads((tmp_path / "straight" / "summary.json").read_text())["secondary_shard"]
    ferrorun(2, *TINY, *wire, "--steps", 4, "--checkpoint-every", 4, "--checkpoint-dir",
             tmp_path / "broken")
    ferrorun(2, *TINY, *wire, "--steps", 8, "--checkpoint-every", 4, "--checkpoint-dir",
             tmp_path / "broken", "--resume")
    straight = json.loads((tmp_path / "straight" / "loss_history.json").read_text())
    broken = json.loads((tmp_path / "broken" / "loss_history.json").read_text())
    assert [s for s, _ in broken[1]["losses"]] == [5, 6, 7, 8]
    assert broken[1]["losses"] == straight[0]["losses"][4:]  # the same floats, bit for bit


@pytest.mark.timeout(180)
def test_powersgd_state_resumes_with_the_bits_of_an_unbroken_run(tmp_path):
    """DDP with --grads-wire powersgd: each rank's error feedback and warm-start Qs go into the
    checkpoint, so a run stopped after compression started ends with the unbroken run's bits;
    the same steps averaged exactly end elsewhere."""
    wire = ["--strategy", "ddp", "--grads-wire", "powersgd", "--powersgd-rank", 2,
            "--powersgd-start", 2, "--checkpoint-every", 4]
    ferrorun(2, *TINY, *wire, "--steps", 8, "--checkpoint-dir", tmp_path / "straight")
    ferrorun(2, *TINY, *wire, "--steps", 4, "--checkpoint-dir", tmp_path / "broken")
    resumed = ferrorun(2, *TINY, *wire, "--steps", 8, "--checkpoint-dir", tmp_path / "broken",
                       "--resume")
    assert "PowerSGD" not in resumed.stdout     # (no "starts afresh": its state was there)
    summary = json.loads((tmp_path / "broken" / "summary.json").read_text())
    assert summary["powersgd"] == {"rank": 2, "start": 2} and summary["grads_wire"] == "powersgd"
    straight = json.loads((tmp_path / "straight" / "loss_history.json").read_text())
    broken = json.loads((tmp_path / "broken" / "loss_history.json").read_text())
    assert [s for s, _ in broken[1]["losses"]] == [5, 6, 7, 8]
    assert broken[1]["losses"] == straight[0]["losses"][4:]  # the same floats, bit for bit
    ferrorun(2, *TINY, "--strategy", "ddp", "--steps", 8, "--checkpoint-dir", tmp_path / "exact")
    exact = json.loads((tmp_path / "exact" / "loss_history.json").read_text())
    assert exact[0]["losses"][:3] == straight[0]["losses"][:3]   # exact until it starts
    assert exact[0]["losses"][4:] != straight[0]["losses"][4:]   # then low rank
    # switched over a resume: PowerSGD's state left unused; PowerSGD started afresh
    r = ferrorun(1, *TINY, "--strategy", "ddp", "--steps", 9, "--checkpoint-dir",
                 tmp_path / "broken", "--resume")
    assert "PowerSGD state is left unused: this run averages exactly" in r.stdout
    r = ferrorun(2, *TINY, *wire, "--steps", 9, "--checkpoint-dir", tmp_path / "exact",
                 "--resume")
    assert "holds no PowerSGD state: PowerSGD starts afresh (2 exact steps first)" in r.stdout


@pytest.mark.timeout(120)
def test_smaller_ddp_buckets_give_the_same_bits(tmp_path):
    """--bucket-cap-mb splits DDP's gradients into more buckets (each averaged as soon as the
    backward has written it): the losses are the one-bucket run's, bit for bit."""
    runs = {}
    for cap in (None, 0.01):
        extra = [] if cap is None else ["--bucket-cap-mb", cap]
        ferrorun(2, *TINY, "--strategy", "ddp", "--steps", 4, "--checkpoint-dir",
                 tmp_path / str(cap), *extra)
        runs[cap] = (json.loads((tmp_path / str(cap) / "summary.json").read_text()),
                     json.loads((tmp_path / str(cap) / "loss_history.json").read_text()))
    assert runs[None][0]["ddp_buckets"] == 1 and runs[0.01][0]["ddp_buckets"] > 4
    assert runs[0.01][1][0]["losses"] == runs[None][1][0]["losses"]
    for extra in (["--bucket-cap-mb", "1"], ["--strategy", "ddp", "--bucket-cap-mb", "0"]):
        r = subprocess.run([sys.executable, str(SCRIPT), *map(str, TINY), "--steps", "1", *extra],
                           capture_output=True, text=True, timeout=60, cwd=ROOT, env=ENV)
        assert r.returncode != 0 and "--bucket-cap-mb is DDP's bucket size: it needs " \
            "--strategy ddp and a size > 0" in r.stderr, r.stderr[-2000:]


def test_powersgd_is_refused_outside_ddp_and_with_a_bad_rank():
    ddp = ["--strategy", "ddp", "--grads-wire"]
    for extra, said in [
            (["--grads-wire", "powersgd"], "it needs --strategy ddp"),
            ([*ddp, "powersgd", "--powersgd-rank", "0"],
             "--powersgd-rank must be >= 1 and --powersgd-start >= 0 (got 0 and 10)"),
            ([*ddp, "int8"], "--strategy ddp takes --grads-wire bf16, fp16, powersgd and no "
                             "--weights-wire")]:
        r = subprocess.run([sys.executable, str(SCRIPT), *map(str, TINY), "--steps", "1", *extra],
                           capture_output=True, text=True, timeout=60, cwd=ROOT, env=ENV)
        assert r.returncode != 0 and said in r.stderr, r.stderr[-2000:]


def test_a_bad_powersgd_flag_is_refused_before_the_backend_connects():
    """The flags are checked before the job's ranks connect: a rank whose peers never come
    (rank 1 of 2, nobody at the address) still says what is wrong at once, not after its
    connect timeout."""
    env = {**ENV, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    r = subprocess.run([sys.executable, str(SCRIPT), *map(str, TINY), "--steps", "1",
                        "--strategy", "ddp", "--grads-wire", "powersgd", "--powersgd-start", "-1"],
                       capture_output=True, text=True, timeout=50, cwd=ROOT, env=env)
    assert r.returncode != 0 and "--powersgd-start >= 0 (got 4 and -1)" in r.stderr, \
        r.stderr[-2000:]
