"""Chaos soak: train under random faults, in elastic and restart modes, and check every run ends
with the model it must (``nox -s soak -- --minutes N``; not part of the test line).

Each cycle picks a mode and runs a short training job under ferrorun on 3 ranks while an
injector sends random faults to random rank processes (the children of ferrorun):

* **elastic** (``ferrorun --nproc 2:3 --max-restarts 2``, ``examples/train_elastic.py``):
  SIGKILL, or SIGSTOP then SIGCONT (shorter than ``--settle``: the job must wait and go on
  unchanged; longer: the rank is fenced and replaced). The run must end with the model of a
  reference run with the same membership history (fixed-size runs chained through states,
  built from the run's own history), bit for bit. Every other elastic cycle trains FULL_SHARD
  (checkpoints every 10 steps: a lost shard comes back from the newest one, in place).
* **link cut** (root, every 6th cycle: ``--emulate-nodes 2 --nnodes 1:2``): node 1's link is
  cut at a random moment; node 0 must fence it and finish alone.
* **restart** (``ferrorun --nproc 3 --max-restarts 3``, ``examples/train_mlp.py`` with
  checkpoints every 5 steps): SIGKILL. The run must end bit-identical to an unbroken run.

At the end: a table of faults injected and recovered per mode and kind, and the time lost per
fault (elastic: the recorded failure-to-training-again time; restart: the run's wall time
beyond the unbroken run's, per fault). Exit code 1 if any run ended wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FERRORUN = [sys.executable, "-m", "ferro_backend.launch"]
ELASTIC = ROOT / "examples" / "train_elastic.py"
MLP = ROOT / "examples" / "train_mlp.py"


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (ferrorun's rank processes)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


class Injector(threading.Thread):
    """Send ``faults`` random faults to random children of ``proc`` between ``window`` seconds
    after its start; records (kind, seconds) of each."""

    def __init__(self, proc, faults: int, window: tuple[float, float], kinds: list[str],
                 settle: float, rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.proc, self.faults, self.window, self.kinds = proc, faults, window, kinds
        self.settle, self.rng = settle, rng
        self.done: list[str] = []

    def run(self) -> None:
        times = sorted(self.rng.uniform(*self.window) for _ in range(self.faults))
        t0 = time.monotonic()
        for at in times:
            time.sleep(max(0.0, at - (time.monotonic() - t0)))
            if self.proc.poll() is not None:
                return
            ranks = children(self.proc.pid)
            if not ranks:
                continue
            victim, kind = self.rng.choice(ranks), self.rng.choice(self.kinds)
            try:
                if kind == "kill":
                    os.kill(victim, signal.SIGKILL)
                else:
                    pause = self.settle * (0.3 if kind == "stop-short" else 2.0)
                    os.kill(victim, signal.SIGSTOP)
                    time.sleep(pause)
                    os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                continue
            self.done.append(kind)


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def elastic_cycle(tmp: Path, rng: random.Random, steps: int, strategy: str) -> dict:
    history, final = tmp / "history.json", tmp / "elastic.npz"
    common = ["--dtype", "float64", "--batch-size", "96", "--strategy", strategy]
    if strategy != "ddp":   # a lost shard comes back from the newest checkpoint
        common += ["--checkpoint-every", "10"]
        steps = min(steps, 1500)
    settle = 3.0
    proc = subprocess.Popen([*FERRORUN, "--nproc", "2:3", "--max-restarts", "2", "--settle",
                             str(settle), "--timeout", "2", str(ELASTIC), *common, "--steps",
                             str(steps), "--history", str(history), "--save-state", str(final),
                             *sharded_dir(strategy, tmp / "ckpt")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    inj = Injector(proc, rng.randint(1, 2), (1.5, 5.0), ["kill", "stop-short", "stop-long"],
                   settle, rng)
    inj.start()
    out, err = proc.communicate(timeout=600)
    inj.join(60)
    result = {"mode": f"elastic {strategy}", "faults": inj.done, "ok": False, "lost": []}
    if proc.returncode != 0 or not history.exists():
        result["why"] = f"ferrorun exited {proc.returncode}: {err[-800:]}"
        return result
    changes = json.loads(history.read_text())["changes"]
    result["lost"] = [c["seconds"] for c in changes]
    bounds = [(0, 3)] + [(c["step"], c["world_size"]) for c in changes]
    previous = None
    for (start, world), end in zip(bounds, [s for s, _ in bounds[1:]] + [steps]):
        if end == start:
            continue
        state = tmp / f"ref_{start}_{world}.npz"
        args = [*FERRORUN, "--nproc", str(world), str(ELASTIC), *common, "--start", str(start),
                "--steps", str(end), "--save-state", str(state),
                *sharded_dir(strategy, tmp / "ref-ckpt")]
        if previous is not None:
            args += ["--load-state", str(previous)] if strategy == "ddp" else ["--resume"]
        r = run(args, 600)
        if r.returncode != 0:
            result["why"] = f"reference run failed: {r.stderr[-800:]}"
            return result
        previous = state
    result["ok"] = same_state(final, previous)
    if not result["ok"]:
        result["why"] = f"the model differs from the reference (changes {changes})"
    return result


def cut_cycle(tmp: Path, rng: random.Random) -> dict:
    """Two emulated nodes (``--emulate-nodes 2 --nnodes 1:2``), node 1's link cut at a random
    moment: node 0 must fence it and train to the end alone (the membership is checked; the
    reference is not rebuilt: a cross-node TCP pair and one host's differ in algorithm)."""
    history = tmp / "history.json"
    at = rng.uniform(5.0, 8.0)
    t0 = time.monotonic()
    r = run([*FERRORUN, "--emulate-nodes", "2", "--nnodes", "1:2", "--nproc", "1",
             "--cut-link", f"1@{at:.1f}", "--timeout", "2", "--settle", "2", str(ELASTIC),
             "--dtype", "float64", "--steps", "8000", "--history", str(history)], 600)
    result = {"mode": "elastic, emulated nodes", "faults": ["link cut"], "ok": False, "lost": []}
    if r.returncode != 0 or not history.exists():
        result["why"] = f"ferrorun exited {r.returncode} after {time.monotonic() - t0:.0f} s: " \
                        f"{r.stderr[-800:]}"
        return result
    changes = json.loads(history.read_text())["changes"]
    result["lost"] = [c["seconds"] + 2.0 for c in changes]   # + the deadline that detected it
    result["ok"] = [(c["world_size"], c["reason"]) for c in changes] == [(1, "a member failed")]
    if not result["ok"]:
        result["why"] = f"membership {changes}"
    return result


def sharded_dir(strategy: str, path: Path) -> list[str]:
    return [] if strategy == "ddp" else ["--checkpoint-dir", str(path)]


def same_state(a: Path, b: Path) -> bool:
    with np.load(a, allow_pickle=True) as fa, np.load(b, allow_pickle=True) as fb:
        sa, sb = fa["state"].item(), fb["state"].item()
    return all(np.array_equal(x, y) for x, y in zip(sa["params"], sb["params"], strict=True))


def restart_cycle(tmp: Path, rng: random.Random, steps: int, reference: Path,
                  unbroken: float) -> dict:
    dump = tmp / "restart.npz"
    args = ["--dtype", "float64", "--strategy", "ddp", "--steps", str(steps), "--no-progress",
            "--no-plot", "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", "5",
            "--dump-params", str(dump)]
    t0 = time.monotonic()
    proc = subprocess.Popen([*FERRORUN, "--nproc", "3", "--max-restarts", "3", "--grace", "1",
                             str(MLP), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    inj = Injector(proc, rng.randint(1, 2), (1.5, 4.0), ["kill"], 0.0, rng)
    inj.start()
    _, err = proc.communicate(timeout=600)
    inj.join(60)
    wall = time.monotonic() - t0
    result = {"mode": "restart", "faults": inj.done, "ok": False,
              "lost": [(wall - unbroken) / len(inj.done)] if inj.done else []}
    if proc.returncode != 0 or not dump.exists():
        result["why"] = f"ferrorun exited {proc.returncode}: {err[-800:]}"
        return result
    with np.load(dump) as got, np.load(reference) as want:
        result["ok"] = sorted(got.files) == sorted(want.files) and all(
            np.array_equal(got[k], want[k]) for k in want.files)
    if not result["ok"]:
        result["why"] = "the model differs from the unbroken run"
    return result


def table(results: list[dict]) -> str:
    rows = ["| mode | fault | injected | runs | runs ended right | time lost per fault (median, "
            "min-max) |", "|---|---|---|---|---|---|"]
    for mode in ("elastic ddp", "elastic full_shard", "elastic, emulated nodes", "restart"):
        mine = [r for r in results if r["mode"] == mode]
        kinds = sorted({k for r in mine for k in r["faults"]})
        lost = [x for r in mine for x in r["lost"]]
        spread = (f"{statistics.median(lost):.2f} s ({min(lost):.2f}-{max(lost):.2f})"
                  if lost else "-")
        for kind in kinds:
            hit = [r for r in mine if kind in r["faults"]]
            rows.append(f"| {mode} | {kind} | {sum(r['faults'].count(kind) for r in mine)} | "
                        f"{len(hit)} | {sum(r['ok'] for r in hit)} | {spread} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3000, help="steps per elastic run")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    from ferro_backend.launch.netns import unavailable

    why = unavailable(None)
    emulation = why is None
    if not emulation:
        print(f"soak: no emulated nodes here ({why}): no link cuts", flush=True)
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ferro-soak-") as d:
        tmp = Path(d)
        ref = tmp / "unbroken.npz"
        t0 = time.monotonic()
        r = run([*FERRORUN, "--nproc", "3", str(MLP), "--dtype", "float64", "--strategy", "ddp",
                 "--steps", "300", "--no-progress", "--no-plot", "--dump-params", str(ref)], 600)
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            return 1
        unbroken = time.monotonic() - t0
        end = time.monotonic() + args.minutes * 60
        cycle = 0
        while time.monotonic() < end:
            cycle += 1
            work = tmp / f"cycle_{cycle}"
            work.mkdir()
            if cycle % 2:
                strategy = "ddp" if cycle % 4 == 1 else "full_shard"
                res = elastic_cycle(work, rng, args.steps, strategy)
            elif cycle % 6 == 0 and emulation:
                res = cut_cycle(work, rng)
            else:
                res = restart_cycle(work, rng, 300, ref, unbroken)
            results.append(res)
            print(f"cycle {cycle} {res['mode']}: faults {res['faults']} -> "
                  f"{'ok' if res['ok'] else 'WRONG: ' + res.get('why', '')}", flush=True)
    print(table(results))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
