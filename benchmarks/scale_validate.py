"""The cost model against real runs on this machine: TcpBackend processes (loopback), 2 and 4.

Per world size: ranks 0 and 1 exchange messages both ways at once (as every algorithm's steps
do) to fit the model's alpha (seconds per message, Python's share included) and beta
(bytes/s); rank 0 times the reduction kernel for gamma (s/byte); then
every rank runs allreduce with each algorithm forced, at 4 KiB-16 MiB (the slowest rank's
median of ``--reps``). Prints predicted vs measured and the error.

Two models per world size: **ping** (alpha, beta from the message exchange, gamma from the
kernel: what the network alone costs) and **fitted** (the local costs added: a per-call term
``call`` and effective alpha, beta, gamma fitted by non-negative least squares to the ring and
star runs of that world size; the recursive doubling rows are held out, so their error is the
model's error on an algorithm it was not fitted to). ``costmodel.terms`` gives each row's
critical path (messages, bytes sent, bytes folded), in which the time is linear.

    python benchmarks/scale_validate.py [--worlds 2 4] [--reps 15] [--out benchmarks/scale]
    python benchmarks/scale_validate.py --refit     (the fit again from the saved measurements)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import tables

SIZES = (4096, 65536, 1 << 20, 16 << 20)
ALGOS = ("ring", "recursive_doubling", "star")
PING = (8, 4096, 65536, 1 << 20, 4 << 20)


def rank_fn(b, reps: int) -> dict:
    import ferro_collective as fc

    out: dict = {}
    if b.rank < 2:  # ranks 0 and 1 exchange messages both ways at once, as the algorithms do
        out.update(ping_both_ways(b, 1 - b.rank, max(10, reps)))
    if b.rank == 0:  # the reduction kernel, per byte
        out["gamma"] = gamma()
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


def ping_both_ways(b, peer: int, reps: int, timeout: float = 60) -> dict[str, float]:
    """``ping<bytes>``: the median time of ``reps`` messages of each of PING's sizes sent to and
    received from ``peer`` at once (both ranks call this)."""
    out = {}
    for nbytes in PING:
        buf, inc = np.zeros(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            req = b.irecv(inc, peer, tag=7)
            b.send(buf, peer, tag=7)
            req.wait(timeout)
            times.append(time.perf_counter() - t0)
        out[f"ping{nbytes}"] = statistics.median(times)
    return out


def gamma() -> float:
    """Seconds per byte of the reduction kernel (float32 sum, 4 MiB, median of 20): the figure
    ``ferro_collective.learn_network`` learns, measured by the same function."""
    from ferro_collective.learn import local_terms

    return local_terms(reps=20)[1]


def fit(ping: dict[int, float]) -> tuple[float, float]:
    """Least squares of t = alpha + bytes / beta."""
    xs = np.array(list(ping), dtype=float)
    ys = np.array(list(ping.values()))
    slope, intercept = np.polyfit(xs, ys, 1)
    return max(intercept, 1e-7), 1.0 / max(slope, 1e-15)


#: the algorithms the local terms are fitted to; the others are held out
TRAIN = ("ring", "star")


def fit_local(n: int, measured: dict[str, float]):
    """``Params`` with ``call``, alpha, beta and gamma fitted (non-negative least squares) to
    the TRAIN algorithms' measured times on ``n`` ranks: time = call + messages * alpha +
    bytes / beta + folded * gamma along each run's critical path (``costmodel.terms``)."""
    from scipy.optimize import nnls

    from ferro_collective import costmodel as cm

    rows, ys = [], []
    for nbytes in SIZES:
        for algo in TRAIN:
            msgs, sent, folded = cm.terms("allreduce", algo, nbytes, n)
            t = measured[f"{algo}/{nbytes}"]
            # relative errors count alike at every size: each row divided by its time
            rows.append([1.0 / t, msgs / t, sent / t, folded / t])
            ys.append(1.0)
    (call, alpha, inv_beta, gamma), _ = nnls(np.array(rows), np.array(ys))
    return cm.Params(alpha, 1.0 / max(inv_beta, 1e-15), gamma=gamma, call=call)


def main() -> None:
    from ferro_collective import costmodel as cm

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None,
                    help="default: a new results/<version>/<machine>/scale_validate-<date>")
    ap.add_argument("--refit", action="store_true",
                    help="no runs: fit again from <out>/model_vs_measured.json")
    args = ap.parse_args()
    if args.out is None:
        args.out = tables.run_dir("scale_validate")
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "model_vs_measured.json"
    raw: dict = {}
    if args.refit:
        raw = {int(n): d for n, d in json.loads(saved.read_text()).items()}
    else:
        from ferro_backend.testing import run_processes

        for n in args.worlds:
            res = run_processes(rank_fn, n, args.reps, timeout=600)
            alpha, beta = fit({k: res[0][f"ping{k}"] for k in PING})
            raw[n] = {"alpha": alpha, "beta": beta, "gamma": res[0]["gamma"],
                      "measured": {f"{a}/{s}": max(r[f"{a}/{s}"] for r in res)
                                   for s in SIZES for a in ALGOS}}
    rows = ["| ranks | algorithm | size | ping model (us) | fitted model (us) | measured (us) "
            "| ping error | fitted error | fitted to |",
            "|---|---|---|---|---|---|---|---|---|"]
    for n, d in raw.items():
        ping = cm.Params(d["alpha"], d["beta"], gamma=d["gamma"])
        local = fit_local(n, d["measured"])
        d["fitted"] = {"call": local.call, "alpha": local.alpha, "beta": local.beta,
                       "gamma": local.gamma}
        print(f"{n} ranks: ping alpha {ping.alpha * 1e6:.1f} us, beta {ping.beta / 1e9:.2f} "
              f"GB/s, gamma {ping.gamma * 1e9:.3f} ns/byte; fitted call {local.call * 1e6:.1f}"
              f" us, alpha {local.alpha * 1e6:.1f} us, beta {local.beta / 1e9:.2f} GB/s, "
              f"gamma {local.gamma * 1e9:.3f} ns/byte", flush=True)
        for nbytes in SIZES:
            for algo in ALGOS:
                measured = d["measured"][f"{algo}/{nbytes}"]
                a = cm.predict("allreduce", algo, nbytes, n, ping)
                b = cm.predict("allreduce", algo, nbytes, n, local)
                rows.append(f"| {n} | {algo} | {nbytes} | {a * 1e6:.0f} | {b * 1e6:.0f} | "
                            f"{measured * 1e6:.0f} | {100 * (a - measured) / measured:+.0f}% | "
                            f"{100 * (b - measured) / measured:+.0f}% | "
                            f"{'yes' if algo in TRAIN else 'held out'} |")
                print(rows[-1], flush=True)
    (args.out / "model_vs_measured.md").write_text("\n".join(rows) + "\n")
    saved.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
