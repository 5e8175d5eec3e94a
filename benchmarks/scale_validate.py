"""The cost model against real runs on this machine: TcpBackend processes (loopback), 2 and 4.

Per world size: ranks 0 and 1 exchange messages both ways at once (as every algorithm's steps
do) to fit the model's alpha (seconds per message, Python's share included) and beta
(bytes/s); rank 0 times the reduction kernel for gamma (s/byte); then
every rank runs allreduce with each algorithm forced, at 4 KiB-16 MiB (the slowest rank's
median of ``--reps``). Prints predicted vs measured and the error.

    python benchmarks/scale_validate.py [--worlds 2 4] [--reps 15] [--out benchmarks/scale]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

SIZES = (4096, 65536, 1 << 20, 16 << 20)
ALGOS = ("ring", "recursive_doubling", "star")
PING = (8, 4096, 65536, 1 << 20, 4 << 20)


def rank_fn(b, reps: int) -> dict:
    import ferro_collective as fc
    from ferro_collective import _reduce
    from ferro_collective.ops import OPS, ReduceOp

    out: dict = {}
    if b.rank < 2:  # ranks 0 and 1 exchange messages both ways at once, as the algorithms do
        peer = 1 - b.rank
        for nbytes in PING:
            buf, inc = np.zeros(nbytes, np.uint8), np.empty(nbytes, np.uint8)
            times = []
            for _ in range(max(10, reps)):
                t0 = time.perf_counter()
                req = b.irecv(inc, peer, tag=7)
                b.send(buf, peer, tag=7)
                req.wait(30)
                times.append(time.perf_counter() - t0)
            out[f"ping{nbytes}"] = statistics.median(times)
    if b.rank == 0:  # the reduction kernel, per byte
        a = np.ones(1 << 20, np.float32)
        c = np.ones(1 << 20, np.float32)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            _reduce.accumulate(a, c, OPS[ReduceOp.SUM].kernel)
            times.append(time.perf_counter() - t0)
        out["gamma"] = statistics.median(times) / a.nbytes
    fc.barrier(b)
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        for algo in ALGOS:
            times = []
            for _ in range(reps):
                fc.barrier(b)
                t0 = time.perf_counter()
                fc.allreduce(x, b, algorithm=algo)
                times.append(time.perf_counter() - t0)
            out[f"{algo}/{nbytes}"] = statistics.median(times)
    return out


def fit(ping: dict[int, float]) -> tuple[float, float]:
    """Least squares of t = alpha + bytes / beta."""
    xs = np.array(list(ping), dtype=float)
    ys = np.array(list(ping.values()))
    slope, intercept = np.polyfit(xs, ys, 1)
    return max(intercept, 1e-7), 1.0 / max(slope, 1e-15)


def main() -> None:
    from ferro_backend.testing import run_processes
    from ferro_collective import costmodel as cm

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "scale")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = ["| ranks | algorithm | size | model (us) | measured (us) | error |",
            "|---|---|---|---|---|---|"]
    raw = {}
    for n in args.worlds:
        res = run_processes(rank_fn, n, args.reps, timeout=600)
        alpha, beta = fit({k: res[0][f"ping{k}"] for k in PING})
        p = cm.Params(alpha, beta, gamma=res[0]["gamma"])
        raw[n] = {"alpha": alpha, "beta": beta, "gamma": p.gamma, "ranks": res}
        print(f"{n} ranks: alpha {alpha * 1e6:.1f} us, beta {beta / 1e9:.2f} GB/s, "
              f"gamma {p.gamma * 1e9:.3f} ns/byte", flush=True)
        for nbytes in SIZES:
            for algo in ALGOS:
                measured = max(r[f"{algo}/{nbytes}"] for r in res)
                model = cm.predict("allreduce", algo, nbytes, n, p)
                rows.append(f"| {n} | {algo} | {nbytes} | {model * 1e6:.0f} | "
                            f"{measured * 1e6:.0f} | {100 * (model - measured) / measured:+.0f}% |")
                print(rows[-1], flush=True)
    (args.out / "model_vs_measured.md").write_text("\n".join(rows) + "\n")
    (args.out / "model_vs_measured.json").write_text(json.dumps(
        {n: {k: v for k, v in d.items() if k != "ranks"} for n, d in raw.items()}, indent=1))


if __name__ == "__main__":
    main()
