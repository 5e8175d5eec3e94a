"""Long-run leak check (issue 29): nothing grows over many collectives or many failures.

Two modes, each on real processes started by ``python -m ferro_backend.launch`` (ferrorun):

``collectives``
    One job per transport (``--transport shm,tcp``) of ``--nproc`` ranks runs ``--collectives``
    mixed collectives (allreduce, broadcast, all_gather, reduce_scatter, barrier; 4 B to 4 MiB,
    small sizes more often). Every ``--sample-every`` calls each rank records its RSS
    (``VmRSS``), open fds, threads (``threading.active_count`` and ``/proc/self/task``),
    ``memfd:`` fds and the entries of ``/dev/shm``. The first ``--warmup`` fraction of the run is
    the warm-up (allocator and plan caches fill); growth is measured from the first sample
    after it to the last.
``faults``
    ``--cycles`` jobs, alternating transports: once every rank is running collectives, one
    random rank gets SIGKILL at a random moment; the survivors must end with a typed ferro
    error (``DistributedError``) and ferrorun must exit non-zero. After each cycle: no process
    of the job left, ``/dev/shm`` as before, the parent's fds as before.

Prints a table (first, last, max, slope per 10,000 calls or per 10 cycles, growth, tolerance)
and exits 1 if any metric grows beyond its tolerance, or a fault cycle ends badly.

Examples
--------
``python tools/leak_check.py --collectives 200000`` (both modes, shm and tcp);
``python tools/leak_check.py --mode faults --cycles 100``; ``nox -s leaks -- --collectives 2000``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

#: message sizes in bytes and how often each is drawn (small ones dominate, as in training)
SIZES = (4, 64, 1 << 10, 16 << 10, 256 << 10, 4 << 20)
WEIGHTS = (30, 20, 20, 15, 10, 5)
OPS = ("allreduce", "broadcast", "all_gather", "reduce_scatter", "barrier")
#: growth allowed from the first sample after the warm-up to the last (collectives mode);
#: None: shown, not checked (``shm`` counts every entry of /dev/shm on the machine, other
#: programs' too; ``shm_mapped`` is this process's own: /dev/shm files it maps or holds open)
TOLERANCE = {"rss_kib": 16 << 10, "fds": 0, "threads": 0, "tasks": 0, "memfd": 0,
             "shm_mapped": 0, "shm": None}
#: growth allowed over the fault cycles (the parent's fds, leftover processes; /dev/shm is
#: machine-wide, shown only, with the names of new entries)
FAULT_TOLERANCE = {"parent_fds": 0, "leftover": 0, "shm": None}


# ---------------------------------------------------------------------- measuring a process
def _count(path: str) -> int:
    try:
        return len(os.listdir(path))
    except OSError:
        return -1


def _shm_mapped() -> int:
    """/dev/shm files this process maps or holds open."""
    names = set()
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/" in line:
                names.add(line.split(None, 5)[-1].strip())
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            names.add(target)
    return len(names)


def _memfds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "memfd:" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def sample(calls: int) -> dict[str, int]:
    """This process's counters now, after ``calls`` collectives."""
    return {"calls": calls, "rss_kib": _rss_kib(), "fds": _count("/proc/self/fd"),
            "threads": threading.active_count(), "tasks": _count("/proc/self/task"),
            "memfd": _memfds(), "shm_mapped": _shm_mapped(), "shm": _count("/dev/shm")}


# ---------------------------------------------------------------------- the ranks
def _one_call(fc, np, backend, op: str, nbytes: int, bufs: dict) -> None:
    n = backend.world_size
    if op == "barrier":
        fc.barrier(backend)
        return
    count = max(1, nbytes // 4)
    if op == "reduce_scatter":
        count = max(n, count // n * n)
    if op == "all_gather":
        count = max(1, count // n)
    key = (op, count)
    x = bufs.get(key)
    if x is None:
        x = bufs[key] = np.full(count, backend.rank + 1, dtype=np.float32)
    if op == "allreduce":
        out = fc.allreduce(x, backend)
        expect = n * (n + 1) / 2
    elif op == "broadcast":
        out = fc.broadcast(x, backend, root=count % n)
        expect = count % n + 1
    elif op == "all_gather":
        out = fc.all_gather(x, backend)[::count]
        expect = np.arange(1, n + 1, dtype=np.float32)
    else:
        out = fc.reduce_scatter(x, backend)
        expect = n * (n + 1) / 2
    if not np.all(out[:1] == expect if op != "all_gather" else out == expect):
        raise AssertionError(f"{op} of {nbytes} B: got {out[:4]}, expected {expect}")


def worker_collectives(args: argparse.Namespace) -> int:
    import numpy as np

    import ferro_collective as fc
    from ferro_backend import init_from_env

    backend = init_from_env()
    rng = random.Random(args.seed)  # the same sequence on every rank
    bufs: dict = {}
    samples = [sample(0)]
    end = time.monotonic() + args.max_seconds
    stop = np.zeros(1, dtype=np.int32)
    calls = 0
    t0 = time.perf_counter()
    while calls < args.collectives:
        for _ in range(min(args.sample_every, args.collectives - calls)):
            op = rng.choice(OPS)
            nbytes = rng.choices(SIZES, WEIGHTS)[0]
            _one_call(fc, np, backend, op, nbytes, bufs)
            calls += 1
        samples.append(sample(calls))
        # rank 0's clock decides for everyone when the time is up (one more collective)
        stop[0] = int(time.monotonic() > end)
        fc.broadcast(stop, backend, root=0, out=stop)
        calls += 1
        if stop[0]:
            break
    seconds = time.perf_counter() - t0
    backend.close()
    out = Path(args.out) / f"rank_{backend.rank}.json"
    out.write_text(json.dumps({"rank": backend.rank, "world": backend.world_size,
                               "calls": calls, "seconds": seconds, "samples": samples}))
    return 0


def worker_fault(args: argparse.Namespace) -> int:
    """Run collectives until a peer dies; record the error the survivor saw."""
    import numpy as np

    import ferro_collective as fc
    from ferro_backend import DistributedError, init_from_env

    backend = init_from_env()
    rank = backend.rank
    Path(args.out, f"pid_{rank}").write_text(str(os.getpid()))
    rng = random.Random(args.seed)
    bufs: dict = {}
    outcome = "finished"
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < args.max_seconds:
            _one_call(fc, np, backend, rng.choice(OPS), rng.choices(SIZES, WEIGHTS)[0], bufs)
    except DistributedError as exc:
        outcome = type(exc).__name__
    except BaseException as exc:  # an untyped error is what this check is looking for
        outcome = f"UNTYPED {type(exc).__module__}.{type(exc).__name__}: {exc}"
    Path(args.out, f"outcome_{rank}").write_text(
        json.dumps({"outcome": outcome, "after": time.monotonic() - t0}))
    backend.close()
    return 3 if outcome != "finished" else 0


# ---------------------------------------------------------------------- the parent
def _ferrorun(nproc: int, transport: str, worker: list[str], tag: str) -> list[str]:
    return [sys.executable, "-m", "ferro_backend.launch", "--nproc", str(nproc),
            "--transport", transport, "--grace", "2", "--timeout", "30", "--no-prefix",
            str(Path(__file__).resolve()), "--job-tag", tag, *worker]


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def _row(name: str, values: list[int], xs: list[float], base_index: int, tol: int | None,
         per: float) -> tuple[list[str], bool]:
    base = values[base_index]
    growth = values[-1] - base
    slope = _slope(xs[base_index:], values[base_index:]) * per
    ok = tol is None or growth <= tol
    verdict = "info" if tol is None else "ok" if ok else "GREW"
    return ([name, str(values[0]), str(base), str(values[-1]), str(max(values)),
             f"{slope:+.2f}", f"{growth:+d}", "-" if tol is None else f"<= {tol}", verdict], ok)


def _print_table(title: str, rows: list[list[str]]) -> None:
    head = ["metric", "first", "baseline", "last", "max", "slope", "growth", "tolerance",
            "verdict"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print(f"\n{title}")
    for r in [head, ["-" * w for w in widths], *rows]:
        print("  " + "  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))))


def run_collectives(args: argparse.Namespace, transport: str) -> bool:
    with tempfile.TemporaryDirectory(prefix="ferro-leaks-") as tmp:
        worker = ["--worker", "collectives", "--out", tmp, "--collectives",
                  str(args.collectives), "--sample-every", str(args.sample_every),
                  "--max-seconds", str(args.max_seconds), "--seed", str(args.seed)]
        t0 = time.perf_counter()
        proc = subprocess.run(_ferrorun(args.nproc, transport, worker, uuid.uuid4().hex),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(proc.stdout[-4000:])
            print(f"{transport}: the job failed (exit {proc.returncode})")
            return False
        results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank_*.json"))]
    ok = True
    calls = results[0]["calls"]
    print(f"\n== collectives on {transport}: {args.nproc} ranks, {calls} collectives in "
          f"{results[0]['seconds']:.1f} s ({calls / results[0]['seconds']:.0f}/s; job "
          f"{wall:.1f} s), a sample every {args.sample_every} calls")
    for res in results:
        samples = res["samples"]
        xs = [s["calls"] for s in samples]
        base = next((i for i, x in enumerate(xs) if x >= args.warmup * xs[-1]), 0)
        base = min(max(base, 1), len(xs) - 1)
        rows = []
        for metric, tol in TOLERANCE.items():
            row, good = _row(metric, [s[metric] for s in samples], xs, base, tol, 10_000)
            rows.append(row)
            ok &= good
        _print_table(f"rank {res['rank']} (baseline: the sample after {xs[base]} calls; "
                     f"slope per 10,000 calls)", rows)
    return ok


def _job_processes(tag: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if tag.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def _fault_cycle(args: argparse.Namespace, transport: str, rng: random.Random,
                 leftover: list[int]) -> tuple[bool, str, float, list[str]]:
    """One job, one SIGKILL: (ok, what happened, seconds from the kill to ferrorun's exit, the
    survivors' errors)."""
    tag = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="ferro-faults-") as tmp:
        worker = ["--worker", "fault", "--out", tmp, "--max-seconds", "60",
                  "--seed", str(rng.randrange(1 << 30))]
        proc = subprocess.Popen(_ferrorun(args.nproc, transport, worker, tag),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
        reader.start()
        pids: dict[int, int] = {}
        end = time.monotonic() + 60
        while len(pids) < args.nproc and time.monotonic() < end and proc.poll() is None:
            for p in Path(tmp).glob("pid_*"):
                text = p.read_text()
                if text:
                    pids[int(p.name[4:])] = int(text)
            time.sleep(0.01)
        if len(pids) < args.nproc:
            proc.kill()
            proc.wait()
            leftover.append(len(_job_processes(tag)))
            return False, f"the job did not start ({len(pids)} ranks up)", 0.0, []
        time.sleep(rng.uniform(0.0, args.kill_within))
        victim = rng.randrange(args.nproc)
        os.kill(pids[victim], signal.SIGKILL)
        killed = time.monotonic()
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            leftover.append(len(_job_processes(tag)))
            return (False, f"ferrorun still running 60 s after rank {victim}'s SIGKILL", 60.0,
                    [])
        took = time.monotonic() - killed
        reader.join(5)
        outcomes = {}
        for r in range(args.nproc):
            p = Path(tmp, f"outcome_{r}")
            if p.exists():
                outcomes[r] = json.loads(p.read_text())["outcome"]
    problems = []
    if code == 0:
        problems.append("ferrorun exited 0")
    survivors = {r: o for r, o in outcomes.items() if r != victim}
    bad = {r: o for r, o in survivors.items() if o.startswith("UNTYPED") or o == "finished"}
    if bad:
        problems.append(f"survivors' outcomes {bad}")
    left = _job_processes(tag)
    leftover.append(len(left))
    if left:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        problems.append(f"processes left: {left}")
    errors = sorted(set(survivors.values()))
    what = (f"rank {victim} killed; survivors {len(survivors)}/{args.nproc - 1} reported "
            f"{errors or 'nothing (stopped by ferrorun first)'}; ferrorun exit {code}")
    return (not problems, what + ("; " + "; ".join(problems) if problems else ""), took,
            list(survivors.values()))


def run_faults(args: argparse.Namespace, transports: list[str]) -> bool:
    rng = random.Random(args.seed)
    series: dict[str, list[int]] = {"parent_fds": [], "shm": [], "leftover": []}
    took: list[float] = []
    errors: dict[str, int] = {}
    failures = []
    t0 = time.monotonic()
    before = (_count("/proc/self/fd"), _count("/dev/shm"))
    shm_before = set(os.listdir("/dev/shm"))
    new_shm: set[str] = set()
    cycles = 0
    for cycle in range(args.cycles):
        if time.monotonic() - t0 > args.fault_seconds:
            break
        transport = transports[cycle % len(transports)]
        ok, what, dt, seen = _fault_cycle(args, transport, rng, series["leftover"])
        cycles += 1
        took.append(dt)
        for name in seen or ["(none: stopped by ferrorun first)"]:
            errors[name] = errors.get(name, 0) + 1
        series["parent_fds"].append(_count("/proc/self/fd"))
        series["shm"].append(_count("/dev/shm"))
        new_shm |= set(os.listdir("/dev/shm")) - shm_before
        if not ok:
            failures.append(f"cycle {cycle} ({transport}): {what}")
        if args.verbose:
            print(f"cycle {cycle} ({transport}): {what} ({dt:.2f} s)")
    elapsed = time.monotonic() - t0
    took.sort()
    print(f"\n== fault cycles: {cycles} in {elapsed:.0f} s ({'/'.join(transports)} "
          f"alternating, {args.nproc} ranks, SIGKILL of a random rank within "
          f"{args.kill_within:g} s of start); before: parent fds {before[0]}, /dev/shm "
          f"{before[1]}")
    if took:
        print(f"   from the SIGKILL to ferrorun's exit: median {took[len(took) // 2]:.2f} s, "
              f"max {took[-1]:.2f} s; survivors' errors: {errors}")
    rows = []
    ok = not failures
    xs = list(range(1, cycles + 1))
    for metric, tol in FAULT_TOLERANCE.items():
        values = series[metric]
        if not values:
            continue
        base = {"parent_fds": before[0], "shm": before[1], "leftover": 0}[metric]
        row, good = _row(metric, [base, *values], [0, *xs], 0, tol, 10)
        rows.append(row)
        ok &= good
    if rows:
        _print_table("parent after each cycle (baseline: before the first; slope per 10 cycles)",
                     rows)
    still = sorted(new_shm & set(os.listdir("/dev/shm")))
    print(f"   /dev/shm entries that appeared during the cycles and are still there: "
          f"{still or 'none'} (the ranks' engine is a memfd: it has no name there)")
    for f in failures[:20]:
        print("FAILED", f)
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("all", "collectives", "faults"), default="all")
    p.add_argument("--transport", default="shm,tcp", help="comma-separated: shm, tcp")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--collectives", type=int, default=200_000)
    p.add_argument("--sample-every", type=int, default=2000)
    p.add_argument("--warmup", type=float, default=0.1,
                   help="fraction of the run before the baseline sample")
    p.add_argument("--max-seconds", type=float, default=600.0,
                   help="stop a collectives job after this long (the figures say how far it got)")
    p.add_argument("--cycles", type=int, default=100)
    p.add_argument("--fault-seconds", type=float, default=300.0,
                   help="stop the fault cycles after this long")
    p.add_argument("--kill-within", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=29)
    p.add_argument("-v", "--verbose", action="store_true")
    # the ranks' side (under ferrorun)
    p.add_argument("--worker", choices=("collectives", "fault"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--job-tag", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker == "collectives":
        return worker_collectives(args)
    if args.worker == "fault":
        return worker_fault(args)
    transports = [t for t in args.transport.split(",") if t]
    ok = True
    if args.mode in ("all", "collectives"):
        for t in transports:
            ok &= run_collectives(args, t)
    if args.mode in ("all", "faults"):
        ok &= run_faults(args, transports)
    print("\nleak check:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
