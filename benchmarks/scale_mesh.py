"""Forming a big TCP job on one host: the full mesh (eager) against connections on first use (lazy).

Each layout runs ``ferrorun --nproc N --transport tcp`` with ``FERRO_TCP_CONNECT`` set; every rank
notes the wall clock just before ``init_from_env()`` (imports done) and when it returns, runs one
allreduce of 256 K float32 (checked), then three more and a barrier, and reports its TCP
connections, its threads and its RSS. "init" is the last rank's return minus the last rank's
call (what a job waits for once everyone has started).

    python benchmarks/scale_mesh.py [--worlds 2 32 64 128 256] [--modes lazy eager]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import tables

JOB = """
    import json, threading, time
    import numpy as np
    import ferro_backend as fb
    import ferro_collective as fc
    t0 = time.time()
    b = fb.init_from_env()
    t1 = time.time()
    x = fc.allreduce(np.full(1 << 18, b.rank + 1.0, np.float32), b)
    t2 = time.time()
    ok = bool((x == sum(range(1, b.world_size + 1))).all())
    for _ in range(3):
        fc.allreduce(np.ones(1 << 18, np.float32), b)
    fc.barrier(b)
    t3 = time.time()
    rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
    print("row", json.dumps([b.rank, ok, getattr(b, "lazy", False), getattr(b, "connections", 0),
                             threading.active_count(), t0, t1, t2, t3, rss]), flush=True)
    b.close()
"""


def measure(n: int, mode: str, script: Path) -> dict:
    env = dict(os.environ, FERRO_TCP_CONNECT=mode)
    r = subprocess.run([sys.executable, "-m", "ferro_backend.launch", "--nproc", str(n),
                        "--transport", "tcp", "--timeout", "600", str(script)],
                       capture_output=True, text=True, timeout=1800, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{n} ranks, {mode}: exit {r.returncode}\n{r.stderr[-2000:]}")
    rows = [json.loads(line.split("row ", 1)[1]) for line in r.stdout.splitlines()
            if "] row [" in line]
    assert len(rows) == n and all(row[1] for row in rows), rows
    return {"world": n, "mode": mode,
            "init_s": max(r[6] for r in rows) - max(r[5] for r in rows),
            "first_allreduce_s": max(r[7] for r in rows) - max(r[6] for r in rows),
            "next_3_allreduces_s": max(r[8] for r in rows) - max(r[7] for r in rows),
            "connections_max": max(r[3] for r in rows),
            "threads_max": max(r[4] for r in rows),
            "rss_mib_max": max(r[9] for r in rows) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 32, 64, 128, 256])
    ap.add_argument("--modes", nargs="+", default=["lazy", "eager"])
    ap.add_argument("--out", type=Path, default=None,
                    help="default: mesh.json in a new results/<version>/<machine>/scale_mesh-<date>")
    args = ap.parse_args()
    if args.out is None:
        args.out = tables.run_dir("scale_mesh") / "mesh.json"
    script = args.out.parent / "_mesh_job.py"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(textwrap.dedent(JOB))
    rows = []
    try:
        for n in args.worlds:
            for mode in args.modes:
                print(f"scale_mesh: {n} ranks, {mode}", file=sys.stderr, flush=True)
                rows.append(measure(n, mode, script))
    finally:
        script.unlink()
    args.out.write_text(json.dumps(rows, indent=1))
    print("| ranks | connect | init | first allreduce | next 3 + barrier | connections "
          "| threads | RSS |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world']} | {r['mode']} | {r['init_s']:.2f} s | "
              f"{r['first_allreduce_s']:.2f} s | {r['next_3_allreduces_s']:.2f} s | "
              f"{r['connections_max']} | {r['threads_max']} | {r['rss_mib_max']:.1f} MiB |")


if __name__ == "__main__":
    main()
