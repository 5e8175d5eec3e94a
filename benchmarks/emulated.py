"""Collectives on emulated clusters (``ferrorun --emulate-nodes``, Linux, root): measured against
the link bound and against the cost model, with the link rate known by construction.

For each layout (nodes x ranks per node) the job runs on emulated nodes whose links are shaped to
``--link-rate`` (tc tbf, both directions). Every rank times allreduce with each algorithm
("auto": the hierarchy where the layout has one, the engine inside each node; the flat ring,
recursive doubling and star over every rank) at 4 KiB-64 MiB; a call's time is the slowest
rank's, the median of its rounds (spread: (max - min) / median): the algorithms take turns call
by call, ``4 x --reps`` rounds up to 64 KiB, ``2 x`` at 1 MiB, ``--reps`` at 16 MiB, half at
64 MiB. Ranks 0 and L (first ranks of
nodes 0 and 1) exchange messages both ways at once to fit the link's alpha and beta; the
reduction kernel gives gamma. The model (``ferro_collective.costmodel``) is then asked for every
cell with those parameters ("ping" model: nothing fitted to the collectives themselves).

The bound: an allreduce of S bytes moves at least 2 (N - 1) / N * S bytes through each node's
link in each direction (every node must send its share out and receive the others'), so no
algorithm beats ``2 (N - 1) / N * S * 8 / rate`` seconds.

    python benchmarks/emulated.py [--layouts 2x1 2x2 4x1 4x2] [--link-rate 1gbit] [--reps 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import tables

SIZES = (4096, 65536, 1 << 20, 16 << 20, 64 << 20)
#: "auto": what auto runs once the job learned its network (ferro_collective.learn_network);
#: "hierarchical": the stages, the engine inside each node (auto before learning, on L > 1)
ALGOS = ("auto", "hierarchical", "ring", "recursive_doubling", "star")
PING = (8, 4096, 65536, 1 << 20, 4 << 20)  # as scale_validate's (the worker pings with it)


def _slowest(b, seconds: float) -> float:
    import ferro_collective as fc

    t = np.array([seconds])
    return float(fc.allreduce(t, b, op="max")[0])


def _last_entry_to_last_exit(b, start: float, end: float) -> float:
    """The call from the moment its last rank entered to the moment its last rank left (the
    ranks share this host's monotonic clock): the barrier's exit skew, which ``_slowest``
    counts, left out."""
    import ferro_collective as fc

    t = fc.allreduce(np.array([start, end]), b, op="max")
    return float(t[1] - t[0])


def worker(out: Path, reps: int, sizes: list[int], algos: list[str]) -> None:
    from scale_validate import gamma, ping_both_ways

    import ferro_backend as fb
    import ferro_collective as fc
    from ferro_collective import costmodel as cm
    from ferro_collective.executors import auto_algorithm

    b = fb.init_from_env()
    h = b.hierarchy
    local = h.local_world if h is not None else 1
    res: dict = {"world": b.world_size, "ranks_per_node": local, "cells": {}}
    fc.barrier(b)
    if b.rank in (0, local):  # first ranks of nodes 0 and 1: the link, both ways at once
        res.update(ping_both_ways(b, local - b.rank, 7))
    if b.rank == 0:
        res["gamma"] = gamma()
    t0 = time.perf_counter()
    learned = fc.learn_network(b)
    res["learn_s"] = _slowest(b, time.perf_counter() - t0)
    res["learned"] = dataclasses.asdict(learned)
    res["auto_picks"] = {str(s): auto_algorithm("allreduce", s, b) for s in sizes}
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        y = np.empty_like(x)
        run = [a for a in algos if not (a == "star" and nbytes > (16 << 20))  # minutes, no news
               and not (a == "hierarchical" and local == 1)]
        times: dict[str, list[float]] = {a: [] for a in run}
        aligned: dict[str, list[float]] = {a: [] for a in run}
        # the algorithms take turns, call by call (the order turning each round), so a slow
        # minute of the host weighs on all of them alike; small calls get more rounds
        rounds = reps * (4 if nbytes <= (64 << 10) else 2 if nbytes <= (1 << 20) else 1)
        rounds = rounds if nbytes < (64 << 20) else max(3, reps // 2)
        for i in range(-1, rounds):  # round -1: a warm-up call each (and the connections)
            for j in range(len(run)):
                algo = run[(i + j) % len(run)]
                if algo == "hierarchical":  # auto as before learning: the stages, always
                    cm.forget(b)
                call = "auto" if algo == "hierarchical" else algo
                fc.barrier(b)
                t0 = time.perf_counter()
                fc.allreduce(x, b, algorithm=call, out=y)
                t1 = time.perf_counter()
                took = _slowest(b, t1 - t0)
                from_last = _last_entry_to_last_exit(b, t0, t1)
                cm.remember(b, learned)
                assert float(y[0]) == b.world_size, (algo, nbytes, y[:4])
                if i >= 0:
                    times[algo].append(took)
                    aligned[algo].append(from_last)
        for algo, ts in times.items():
            res["cells"][f"{algo}/{nbytes}"] = ts
            res.setdefault("cells_from_last_entry", {})[f"{algo}/{nbytes}"] = aligned[algo]
    if b.rank == 0:
        out.write_text(json.dumps(res))
    fc.barrier(b)
    b.close()


def run_layout(nodes: int, per_node: int, rate: str, reps: int, sizes: list[int],
               out: Path, algos: tuple[str, ...] = ALGOS) -> dict:
    target = out / f"raw_{nodes}x{per_node}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "ferro_backend.launch", "--emulate-nodes", str(nodes),
           "--nproc", str(per_node), "--link-rate", rate, "--timeout", "600", __file__,
           "--worker", str(target), "--reps", str(reps), "--sizes", *map(str, sizes),
           "--algos", *algos]
    print(f"emulated: {nodes} nodes x {per_node} ranks, links {rate}", file=sys.stderr,
          flush=True)
    subprocess.run(cmd, check=True, timeout=3600, env=env)
    return json.loads(target.read_text())


def model_params(res: dict):
    """The parameters the job learned (ferro_collective.learn_network); for runs from before
    it, alpha and beta fitted to the ping of ranks 0 and L with the kernel's gamma."""
    from scale_validate import fit

    from ferro_collective import costmodel as cm

    if "learned" in res:
        return cm.Params(**res["learned"])
    alpha, beta = fit({k: res[f"ping{k}"] for k in PING})
    return cm.Params(alpha, beta, 0.5e-6, 10e9, res["ranks_per_node"], gamma=res["gamma"],
                     shared_link=True)


def ran(res: dict, algo: str, nbytes: int) -> str:
    """The model's name for what a cell ran: auto's pick, recorded by the job (older runs:
    what auto ran before learning), "hierarchical_engine" for the stages."""
    if algo == "auto":
        pick = res["auto_picks"][str(nbytes)] if "auto_picks" in res else \
            ran_auto(nbytes, res["world"], res["ranks_per_node"])
        return "hierarchical_engine" if pick.startswith("hierarchical") else pick
    return "hierarchical_engine" if algo == "hierarchical" else algo


def table(results: dict[str, dict], rate: str) -> str:
    from ferro_collective import costmodel as cm

    bits = _rate_bits(rate)
    lines = [f"Links shaped to {rate} (tc tbf, both directions). Time: the slowest rank's, median "
             "(spread = (max - min) / median); model: the parameters the job learned "
             "(`ferro_collective.learn_network`: the link pinged by ranks 0 and L after it "
             "rested, with its token bucket's burst; a round of the whole job; the engine step "
             "inside a staged call; the route between a node's ranks; the local terms, in "
             "the cache and beyond it), each node's link shared by its ranks; "
             "bound: 2 (N - 1) / N x S over the link rate.", "",
             "| layout | size | algorithm | measured | spread | model | model / measured | "
             "bound | bound / measured |", "|---|---|---|---|---|---|---|---|---|"]
    for layout, res in results.items():
        n, L = res["world"], res["ranks_per_node"]
        N = n // L
        p = model_params(res)
        for key, times in res["cells"].items():
            algo, nbytes = key.split("/")
            nbytes = int(nbytes)
            med = statistics.median(times)
            spread = (max(times) - min(times)) / med
            model_algo = ran(res, algo, nbytes)
            model = cm.predict("allreduce", model_algo, nbytes, n, p)
            bound = 2 * (N - 1) / N * nbytes * 8 / bits
            lines.append(f"| {layout} | {_size(nbytes)} | {algo} ({model_algo}) | "
                         f"{_secs(med)} | {spread:.0%} | {_secs(model)} | {model / med:.2f} | "
                         f"{_secs(bound)} | {bound / med:.0%} |")
    return "\n".join(lines) + "\n\n" + picks(results)


def ran_auto(nbytes: int, n: int, L: int) -> str:
    """What algorithm="auto" ran before the job learned its network: the hierarchy (engine
    inside each node) when the layout has one, else the flat algorithm auto picks (the
    thresholds measured up to 4 ranks, the model beyond)."""
    import dataclasses

    from ferro_collective import costmodel as cm

    if L > 1 and cm.choose_hierarchical("allreduce", nbytes, n, dataclasses.replace(
            cm.DEFAULT, ranks_per_node=L), engine=True):
        return "hierarchical_engine"
    return cm.auto_pick("allreduce", nbytes, n, dataclasses.replace(cm.DEFAULT,
                                                                   ranks_per_node=L))


def picks(results: dict[str, dict]) -> str:
    """Per cell: the measured fastest algorithm, and auto's pick (on the learned parameters):
    is it the fastest, or within 10% of it (each algorithm timed on its own)?"""
    lines = ["| layout | size | measured fastest | auto's pick | pick / fastest | ok |",
             "|---|---|---|---|---|---|"]
    good = total = 0
    for layout, res in results.items():
        sizes = sorted({int(k.split("/")[1]) for k in res["cells"]})
        for nbytes in sizes:
            measured = {}
            for key, times in res["cells"].items():
                algo, size = key.split("/")
                if int(size) == nbytes and algo != "auto":
                    measured[ran(res, algo, nbytes)] = statistics.median(times)
            pick = ran(res, "auto", nbytes)
            if pick not in measured and f"auto/{nbytes}" in res["cells"]:
                measured[pick] = statistics.median(res["cells"][f"auto/{nbytes}"])
            fastest = min(measured, key=measured.get)
            ratio = measured[pick] / measured[fastest]
            ok = ratio <= 1.10
            good += ok
            total += 1
            lines.append(f"| {layout} | {_size(nbytes)} | {fastest} | {pick} | {ratio:.2f} | "
                         f"{'yes' if ok else 'no'} |")
    lines.append(f"\nauto's pick is the fastest or within 10% of it in {good} of {total} cells.")
    return "\n".join(lines) + "\n"


def _rate_bits(rate: str) -> float:
    from ferro_backend.launch.netns import rate_bits

    return rate_bits(rate)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _secs(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--layouts", nargs="+", default=["2x1", "2x2", "4x1", "4x2"])
    ap.add_argument("--link-rate", default="1gbit")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    ap.add_argument("--out", type=Path, default=None,
                    help="default: a new results/<version>/<machine>/emulated-<date>")
    ap.add_argument("--retable", action="store_true",
                    help="only the table again, from OUT/results.json (e.g. after a model change)")
    args = ap.parse_args()
    if args.out is None:
        args.out = tables.run_dir("emulated")
    if args.worker is not None:
        return worker(args.worker, args.reps, args.sizes, args.algos)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.retable:
        results = json.loads((args.out / "results.json").read_text())
    else:
        results = {}
        for layout in args.layouts:
            nodes, per_node = map(int, layout.split("x"))
            results[layout] = run_layout(nodes, per_node, args.link_rate, args.reps,
                                         args.sizes, args.out, args.algos)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    sys.path.insert(0, str(Path(__file__).parent))
    md = table(results, args.link_rate)
    (args.out / "results.md").write_text(md)
    print(md)
    plot(results, args.link_rate, args.out / "model_vs_measured.png")


def plot(results: dict[str, dict], rate: str, path: Path) -> None:
    """Measured (points, min-max bars) and modelled (lines) time per algorithm against size,
    one panel per layout, with the link's bound dashed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("emulated: matplotlib not installed, no plot", file=sys.stderr)
        return
    from ferro_collective import costmodel as cm

    bits = _rate_bits(rate)
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.8), squeeze=False)
    for ax, (layout, res) in zip(axes[0], results.items()):
        n, L = res["world"], res["ranks_per_node"]
        p = model_params(res)
        for i, algo in enumerate(ALGOS):
            cells = sorted((int(k.split("/")[1]), v) for k, v in res["cells"].items()
                           if k.split("/")[0] == algo)
            if not cells:
                continue
            xs = [c[0] for c in cells]
            med = [statistics.median(c[1]) for c in cells]
            lo = [m - min(c[1]) for m, c in zip(med, cells)]
            hi = [max(c[1]) - m for m, c in zip(med, cells)]
            color = f"C{i}"
            ax.errorbar(xs, med, yerr=[lo, hi], fmt="o", color=color, ms=4,
                        label=f"{algo} measured")
            ax.plot(xs, [cm.predict("allreduce", ran(res, algo, x), x, n, p) for x in xs], "-",
                    color=color, lw=1, label=f"{algo} model")
        xs = sorted({int(k.split("/")[1]) for k in res["cells"]})
        N = n // L
        ax.plot(xs, [2 * (N - 1) / N * x * 8 / bits for x in xs], "k--", lw=1,
                label="link bound")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{layout} (nodes x ranks), {rate}")
        ax.set_xlabel("allreduce size (bytes)")
        ax.set_ylabel("seconds")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"emulated: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
