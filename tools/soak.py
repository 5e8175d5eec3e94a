"""Chaos soak: train under random faults, in elastic and restart modes, and check every run ends
with the model it must (``nox -s soak -- --minutes N``; not part of the test line).

Each cycle picks a mode and runs a short training job under ferrorun on 3 ranks, and plans its
faults at training steps; an injector waits for the job to reach each (the ranks write their
completed step, ``--step-file``) and sends the fault to a random rank process that is training
(a child of ferrorun). A planned fault the job ended before fails the cycle:

* **elastic** (``ferrorun --nproc 2:3 --max-restarts 2``, ``examples/train_elastic.py``):
  SIGKILL, or SIGSTOP then SIGCONT (shorter than ``--settle``: the job must wait and go on
  unchanged; longer: the rank is fenced and replaced), or a kill during a membership change
  (``kill-in-change``: a rank killed, then a second one once the survivors stall in the
  change: two members lost, both replaced). The run must end with the model of a
  reference run with the same membership history (fixed-size runs chained through states,
  built from the run's own history), bit for bit. Every other elastic cycle trains FULL_SHARD
  (checkpoints every 10 steps: a lost shard comes back from the newest one, in place).
* **link cut** (root, every 6th cycle: ``--emulate-nodes 2 --nnodes 1:2``): node 1's link is
  cut at a random moment; node 0 must fence it and finish alone.
* **restart** (``ferrorun --nproc 3 --max-restarts 3``, ``examples/train_mlp.py`` with
  checkpoints every 5 steps): SIGKILL, at a step or while a checkpoint is being written
  (``kill-in-save``: the moment a new shard's ``.part``/``.tmp`` file appears). The run must
  end bit-identical to an unbroken run (a half-written step is never loaded).
* **coordinator host stopped** (root, every 12th cycle, instead of a link cut): two emulated
  nodes, node 0 (its agent holds the coordinator) stopped whole at a planned step: node 1's
  member must end with the error naming the coordinator within ``2 --timeout + --settle +
  --join-timeout + 10 s``.
* **full disk** (root, every 6th cycle): restart mode's job with its checkpoints on a 64 MiB
  tmpfs, filled at a planned step: the next save must fail with ``CheckpointIOError`` naming
  ENOSPC and the job stop; once the disk is freed, ``--resume`` from the newest committed step
  must end bit-identical to the unbroken run.

At the end: a table of faults planned, injected and recovered per mode and kind, and the time
lost per fault (elastic: the recorded failure-to-training-again time; restart: the run's wall
time beyond the unbroken run's, per fault). Exit code 1 if any run ended wrong, or fewer than
95% of the planned faults were injected.
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

ROOT = Path(__file__).resolve().parents[1]
FERRORUN = [sys.executable, "-m", "ferro_backend.launch"]
ELASTIC = ROOT / "examples" / "train_elastic.py"
MLP = ROOT / "examples" / "train_mlp.py"
#: a soak in which fewer of its planned faults fired tested too little: it fails
MIN_FIRED = 0.95


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


def descendants(pid: int) -> list[int]:
    """``pid``'s children, theirs, and so on."""
    out = []
    for child in children(pid):
        out += [child, *descendants(child)]
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def progress(directory: Path, alive: set[int]) -> dict[int, int]:
    """pid -> last completed step, of the rank processes in ``alive`` that wrote a step file."""
    out = {}
    for f in directory.iterdir():
        if f.name.isdigit() and int(f.name) in alive:
            try:
                out[int(f.name)] = int(f.read_bytes() or b"-1")
            except (OSError, ValueError):
                continue
    return out


class Injector(threading.Thread):
    """Inject the planned faults into ``proc``'s job, each when the job reaches its step: the
    most advanced rank (``--step-file`` files in ``steps``) has completed it. A victim is a
    rank process that is training (it has a step file). ``planned``: (step, kind), in step
    order; ``done`` lists the kinds injected, ``missed`` the planned ones the job ended
    before (the cycle fails on those: a fault that never fired tested nothing)."""

    def __init__(self, proc, planned: list[tuple[int, str]], steps: Path, settle: float,
                 rng: random.Random, ckpt: Path | None = None) -> None:
        super().__init__(daemon=True)
        self.proc, self.planned, self.steps = proc, planned, steps
        self.settle, self.rng, self.ckpt = settle, rng, ckpt
        self.done: list[str] = []
        self.missed: list[str] = []

    def run(self) -> None:
        for i, (at, kind) in enumerate(self.planned):
            victim = self._wait_for(at)
            if victim is None or not self._inject(victim, kind):
                self.missed += [k for _, k in self.planned[i:]]
                return
            self.done.append(kind)

    def _wait_for(self, step: int) -> int | None:
        """A training rank's pid once the job has completed ``step``; None if it ended."""
        while self.proc.poll() is None:
            seen = progress(self.steps, set(children(self.proc.pid)))
            if seen and max(seen.values()) >= step:
                return self.rng.choice(sorted(seen))
            time.sleep(0.01)
        return None

    def _saving(self) -> int | None:
        """A training rank's pid the moment a checkpoint save is being written (a shard's
        ``.part`` or uncommitted ``.tmp`` file under ``ckpt``, not one a killed save left);
        None if the job ended first."""
        pattern = "step_*/.rank_*.safetensors.*"
        left = set(self.ckpt.glob(pattern))
        while self.proc.poll() is None:
            if set(self.ckpt.glob(pattern)) - left:
                seen = progress(self.steps, set(children(self.proc.pid)))
                if seen:
                    return self.rng.choice(sorted(seen))
            time.sleep(0.0005)
        return None

    def _changing(self, gone: int) -> int | None:
        """Another training rank's pid once the job is in the membership change ``gone``'s
        loss began: no survivor's step has moved for 0.1 s (they wait in the rebuild); None
        if the job ended first."""
        last, since = None, time.monotonic()
        while self.proc.poll() is None:
            seen = progress(self.steps, set(children(self.proc.pid)) - {gone})
            if seen != last:
                last, since = seen, time.monotonic()
            elif seen and time.monotonic() - since > 0.1:
                return self.rng.choice(sorted(seen))
            time.sleep(0.005)
        return None

    def _inject(self, victim: int, kind: str) -> bool:
        try:
            if kind == "kill-in-save":
                victim = self._saving()
                if victim is None:
                    return False
                os.kill(victim, signal.SIGKILL)
            elif kind == "kill-in-change":  # a second loss while the first is being handled
                os.kill(victim, signal.SIGKILL)
                second = self._changing(victim)
                if second is None:
                    return False
                os.kill(second, signal.SIGKILL)
            elif kind == "kill":
                os.kill(victim, signal.SIGKILL)
            elif kind == "full disk":  # the checkpoints' file system: nothing more fits
                full = threading.Event()
                threading.Thread(target=fill, daemon=True, args=(
                    self.ckpt.parent / "filler",
                    lambda: full.set() or self.proc.poll() is not None)).start()
                full.wait(30)
            else:
                pause = self.settle * (0.3 if kind == "stop-short" else 2.0)
                os.kill(victim, signal.SIGSTOP)
                time.sleep(pause)
                os.kill(victim, signal.SIGCONT)
        except ProcessLookupError:
            return False
        return True


def fill(path: Path, done=None) -> None:
    """Write ``path`` until its file system is full; with ``done`` (a callable), keep it full
    until ``done()`` (space a checkpoint rotation frees is taken back at once, else a save may
    find room again)."""
    with open(path, "ab", buffering=0) as f:
        while True:
            try:
                f.write(bytes(1 << 16))
            except OSError:
                if done is None or done():
                    return
                time.sleep(0.002)


def plan(rng: random.Random, steps: int, faults: int, kinds: list[str],
         window: tuple[float, float]) -> list[tuple[int, str]]:
    """``faults`` faults at steps drawn in ``window`` (fractions of ``steps``), in step order."""
    at = sorted(rng.randint(max(1, int(steps * window[0])), int(steps * window[1]))
                for _ in range(faults))
    return [(s, rng.choice(kinds)) for s in at]


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def elastic_cycle(tmp: Path, rng: random.Random, steps: int, strategy: str) -> dict:
    history, final = tmp / "history.json", tmp / "elastic.npz"
    common = ["--dtype", "float64", "--batch-size", "96", "--strategy", strategy]
    if strategy != "ddp":   # a lost shard comes back from the newest checkpoint
        common += ["--checkpoint-every", "10"]
        steps = min(steps, 1500)
    settle = 3.0
    step_dir = tmp / "steps"
    step_dir.mkdir()
    proc = subprocess.Popen([*FERRORUN, "--nproc", "2:3", "--max-restarts", "2", "--settle",
                             str(settle), "--timeout", "2", str(ELASTIC), *common, "--steps",
                             str(steps), "--history", str(history), "--save-state", str(final),
                             "--step-file", str(step_dir), *sharded_dir(strategy, tmp / "ckpt")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    planned = plan(rng, steps, rng.randint(1, 2), ["kill", "stop-short", "stop-long"],
                   (0.05, 0.5))
    if rng.random() < 0.3:  # or one loss during the change another began (two members lost)
        planned = plan(rng, steps, 1, ["kill-in-change"], (0.05, 0.5))
    inj = Injector(proc, planned, step_dir, settle, rng)
    inj.start()
    out, err = proc.communicate(timeout=600)
    inj.join(60)
    result = outcome(f"elastic {strategy}", inj)
    if inj.missed:
        return result
    if proc.returncode != 0 or not history.exists():
        said = [line for line in err.splitlines() if line.startswith("ferrorun:")]
        result["why"] = f"ferrorun exited {proc.returncode}: {said} {err[-800:]}"
        result["err"] = err
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
    reference is not rebuilt: a cross-node TCP pair and one host's differ in algorithm). The
    cut is ferrorun's, by the clock: the job is long enough (40000 steps, tens of seconds
    here) to run past it, and a run that ended before the cut counts as a fault not injected."""
    history = tmp / "history.json"
    at = rng.uniform(5.0, 8.0)
    t0 = time.monotonic()
    r = run([*FERRORUN, "--emulate-nodes", "2", "--nnodes", "1:2", "--nproc", "1",
             "--cut-link", f"1@{at:.1f}", "--timeout", "2", "--settle", "2", str(ELASTIC),
             "--dtype", "float64", "--steps", "40000", "--history", str(history)], 600)
    wall = time.monotonic() - t0
    fired = wall > at + 0.5
    result = {"mode": "elastic, emulated nodes", "planned": ["link cut"],
              "faults": ["link cut"] if fired else [], "ok": False, "lost": []}
    if not fired:
        result["why"] = f"planned fault not injected: the job ended after {wall:.1f} s, " \
                        f"before the cut at {at:.1f} s"
        return result
    if r.returncode != 0 or not history.exists():
        result["why"] = f"ferrorun exited {r.returncode} after {wall:.0f} s: {r.stderr[-800:]}"
        return result
    changes = json.loads(history.read_text())["changes"]
    result["lost"] = [c["seconds"] + 2.0 for c in changes]   # + the deadline that detected it
    result["ok"] = [(c["world_size"], c["reason"]) for c in changes] == [(1, "a member failed")]
    if not result["ok"]:
        result["why"] = f"membership {changes}"
    return result


def outcome(mode: str, inj: Injector) -> dict:
    """A cycle's result so far: its planned, injected and missed faults (not yet judged)."""
    result = {"mode": mode, "planned": [k for _, k in inj.planned], "faults": inj.done,
              "ok": False, "lost": []}
    if inj.missed:
        result["why"] = (f"planned faults not injected (the job ended first): {inj.missed}, "
                         f"injected {inj.done}")
    return result


def sharded_dir(strategy: str, path: Path) -> list[str]:
    return [] if strategy == "ddp" else ["--checkpoint-dir", str(path)]


def same_state(a: Path, b: Path) -> bool:
    import numpy as np  # (here: the soak's plan and table need no numpy)

    with np.load(a, allow_pickle=True) as fa, np.load(b, allow_pickle=True) as fb:
        sa, sb = fa["state"].item(), fb["state"].item()
    return all(np.array_equal(x, y) for x, y in zip(sa["params"], sb["params"], strict=True))


def same_params(dump: Path, reference: Path) -> bool:
    """Whether two ``--dump-params`` files hold the same arrays, bit for bit."""
    import numpy as np

    with np.load(dump) as got, np.load(reference) as want:
        return sorted(got.files) == sorted(want.files) and all(
            np.array_equal(got[k], want[k]) for k in want.files)


def restart_cycle(tmp: Path, rng: random.Random, steps: int, reference: Path,
                  unbroken: float) -> dict:
    dump = tmp / "restart.npz"
    step_dir = tmp / "steps"
    step_dir.mkdir()
    args = ["--dtype", "float64", "--strategy", "ddp", "--steps", str(steps), "--no-progress",
            "--no-plot", "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", "5",
            "--dump-params", str(dump), "--step-file", str(step_dir)]
    t0 = time.monotonic()
    proc = subprocess.Popen([*FERRORUN, "--nproc", "3", "--max-restarts", "3", "--grace", "1",
                             str(MLP), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    # the second fault's step is reached again after the first restart's resume
    inj = Injector(proc, plan(rng, steps, rng.randint(1, 2), ["kill", "kill-in-save"], (0.1, 0.6)),
                   step_dir, 0.0, rng, tmp / "ckpt")
    inj.start()
    _, err = proc.communicate(timeout=600)
    inj.join(60)
    wall = time.monotonic() - t0
    result = outcome("restart", inj)
    result["lost"] = [(wall - unbroken) / len(inj.done)] if inj.done else []
    if inj.missed:
        return result
    if proc.returncode != 0 or not dump.exists():
        result["why"] = f"ferrorun exited {proc.returncode}: {err[-800:]}"
        return result
    result["ok"] = same_params(dump, reference)
    if not result["ok"]:
        result["why"] = "the model differs from the unbroken run"
    return result


def stop_cycle(tmp: Path, rng: random.Random) -> dict:
    """Two emulated nodes (``--emulate-nodes 2 --nnodes 1:2``); node 0, whose agent holds the
    coordinator, stopped whole (SIGSTOP, its agent and rank) once the job reaches a planned
    step: node 1's member must end with the error naming the coordinator (``no 'generation'
    from the coordinator``) within its deadline: ``--timeout`` to see node 0's rank gone, then
    ferrorun's ``FERRO_ELASTIC_TIMEOUT`` for its ranks (``--settle`` + ``--join-timeout`` +
    ``--timeout`` + 10 s) for the next generation; and node 1's agent end with it. Then node 0
    is killed."""
    timeout, settle, join = 2.0, 2.0, 8.0
    bound = timeout + settle + join + timeout + 10.0
    step_dir = tmp / "steps"
    step_dir.mkdir()
    proc = subprocess.Popen([*FERRORUN, "--emulate-nodes", "2", "--nnodes", "1:2", "--nproc",
                             "1", "--timeout", str(timeout), "--settle", str(settle),
                             "--join-timeout", str(join), str(ELASTIC), "--dtype", "float64",
                             "--steps", "40000", "--step-file", str(step_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    at = rng.randint(200, 2000)
    result = {"mode": "elastic, emulated nodes", "planned": ["coordinator host stopped"],
              "faults": [], "ok": False, "lost": []}
    stopped: list[int] = []
    ended = float("inf")
    try:
        node1 = None
        while proc.poll() is None:
            seen = progress(step_dir, set(descendants(proc.pid)))
            agents = {int(cmdline(a).split("--node-rank ")[1].split()[0]): a
                      for a in children(proc.pid) if "--node-rank " in cmdline(a)}
            if seen and max(seen.values()) >= at and len(agents) == 2:
                stopped = [agents[0], *descendants(agents[0])]
                node1 = agents[1]
                break
            time.sleep(0.01)
        if node1 is None:
            result["why"] = f"planned fault not injected: the job ended before step {at}"
            return result
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        result["faults"].append("coordinator host stopped")
        while Path(f"/proc/{node1}").exists() and \
                Path(f"/proc/{node1}/stat").read_text().split()[2] != "Z" and \
                time.monotonic() - t0 < bound + 30:
            time.sleep(0.1)
        ended = time.monotonic() - t0
        result["lost"] = [ended]
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    said = "no 'generation' from the coordinator" in err
    result["ok"] = ended <= bound + 5 and said
    if not result["ok"]:
        result["why"] = (f"node 1 ended {ended:.1f} s after node 0 stopped (bound {bound:g} s), "
                         f"the coordinator named: {said}: {err[-800:]}")
    return result


def full_disk_cycle(tmp: Path, rng: random.Random, steps: int, reference: Path) -> dict:
    """Restart mode's job with its checkpoints on a small tmpfs, filled at a planned step: the
    next save must fail naming ENOSPC (ferro-checkpoint's typed error names the path too), and
    the job stop (no restarts: the disk stays full). The newest committed checkpoint must be
    whole: once the disk is freed, a ``--resume`` run from it must end bit-identical to the
    unbroken run."""
    disk, step_dir = tmp / "disk", tmp / "steps"
    disk.mkdir()
    step_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], check=True)
    try:
        ckpt, dump = disk / "ckpt", tmp / "resumed.npz"
        args = ["--dtype", "float64", "--strategy", "ddp", "--steps", str(steps),
                "--no-progress", "--no-plot", "--checkpoint-dir", str(ckpt),
                "--checkpoint-every", "5", "--step-file", str(step_dir)]
        proc = subprocess.Popen([*FERRORUN, "--nproc", "3", str(MLP), *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=ROOT)
        inj = Injector(proc, plan(rng, steps, 1, ["full disk"], (0.2, 0.6)), step_dir, 0.0,
                       rng, ckpt)
        inj.start()
        _, err = proc.communicate(timeout=600)
        inj.join(60)
        result = outcome("restart, full disk", inj)
        if inj.missed:
            return result
        committed = sorted(int(p.parent.name[5:]) for p in ckpt.glob("step_*/metadata.json"))
        # ferro-checkpoint's saves fail with CheckpointIOError naming ENOSPC; the example's
        # own files in the same directory (its loss history) with OSError's ENOSPC
        if proc.returncode == 0 or "No space left on device" not in err or not committed:
            result["why"] = (f"a full disk: ferrorun exited {proc.returncode}, committed steps "
                             f"{committed}: {err[-800:]}")
            return result
        (disk / "filler").unlink()
        t0 = time.monotonic()
        r = run([*FERRORUN, "--nproc", "3", str(MLP), *args, "--resume", "--dump-params",
                 str(dump)], 600)
        result["lost"] = [time.monotonic() - t0]
        if r.returncode != 0:
            result["why"] = f"the resume from step {committed[-1]} failed: {r.stderr[-800:]}"
            return result
        result["ok"] = same_params(dump, reference)
        if not result["ok"]:
            result["why"] = f"resumed from step {committed[-1]}: the model differs"
        return result
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def can_mount() -> str | None:
    """Why a tmpfs cannot be mounted here (not root...), or None."""
    if os.geteuid() != 0:
        return "not root"
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return r.stderr.strip() or "mount failed"
        subprocess.run(["umount", d], check=False)
    return None


def table(results: list[dict]) -> str:
    """Per mode and kind: faults planned, injected, runs they were in and those that ended
    right, and the time lost per fault."""
    rows = ["| mode | fault | planned | injected | runs | runs ended right | time lost per fault "
            "(median, min-max) |", "|---|---|---|---|---|---|---|"]
    for mode in ("elastic ddp", "elastic full_shard", "elastic, emulated nodes", "restart",
                 "restart, full disk"):
        mine = [r for r in results if r["mode"] == mode]
        kinds = sorted({k for r in mine for k in r["planned"]})
        lost = [x for r in mine for x in r["lost"]]
        spread = (f"{statistics.median(lost):.2f} s ({min(lost):.2f}-{max(lost):.2f})"
                  if lost else "-")
        for kind in kinds:
            hit = [r for r in mine if kind in r["faults"]]
            rows.append(f"| {mode} | {kind} | {sum(r['planned'].count(kind) for r in mine)} | "
                        f"{sum(r['faults'].count(kind) for r in mine)} | {len(hit)} | "
                        f"{sum(r['ok'] for r in hit)} | {spread} |")
    return "\n".join(rows)


def fired(results: list[dict]) -> float:
    """The share of planned faults injected (1.0 with none planned)."""
    planned = sum(len(r["planned"]) for r in results)
    return sum(len(r["faults"]) for r in results) / planned if planned else 1.0


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
    no_disk = can_mount()
    if no_disk:
        print(f"soak: no tmpfs to fill here ({no_disk}): no full disks", flush=True)
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
                res = cut_cycle(work, rng) if cycle % 12 else stop_cycle(work, rng)
            elif cycle % 6 == 4 and not no_disk:
                res = full_disk_cycle(work, rng, 300, ref)
            else:
                res = restart_cycle(work, rng, 300, ref, unbroken)
            results.append(res)
            print(f"cycle {cycle} {res['mode']}: planned {res['planned']}, injected "
                  f"{res['faults']} -> "
                  f"{'ok' if res['ok'] else 'WRONG: ' + res.get('why', '')}", flush=True)
    print(table(results))
    share = fired(results)
    print(f"planned faults injected: {share:.0%} (at least {MIN_FIRED:.0%} needed)")
    return 0 if all(r["ok"] for r in results) and share >= MIN_FIRED else 1


if __name__ == "__main__":
    sys.exit(main())
