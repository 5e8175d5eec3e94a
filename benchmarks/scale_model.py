"""Planning past one machine: the cost model against the simulated network, and what "auto" picks.

1. For allreduce (ring, recursive doubling, star) and broadcast (tree, star) at 8-256 ranks on a
   25 Gb/s cluster of 16-rank nodes, and the hierarchical allreduce, broadcast, reduce_scatter
   and all_gather (node stages over the intra-node links, cross stages over the network:
   ``SimulatedBackend.create_group(..., hierarchical=True)``) at 32-256 ranks: the model's
   prediction, the simulated network's virtual time (ranks as threads), the error, and whether
   auto runs the hierarchical stages there (``costmodel.choose_hierarchical``).
2. The model's time per algorithm (hierarchical included) vs world size (2-1024) for 4 KiB,
   1 MiB and 64 MiB on that cluster, auto's pick marked (a PNG).

    python benchmarks/scale_model.py [--out benchmarks/scale] [--quick]

``--quick``: 8-64 ranks only, no PNG (about 10 s).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from unittest import mock

import numpy as np
import tables

import ferro_collective as fc
from ferro_backend import SimulatedBackend
from ferro_backend.netsim import Network
from ferro_backend.testing import run_threads
from ferro_collective import costmodel as cm
from ferro_collective.plan import choose
from ferro_collective.records import BY_NAME

NET = Network.cluster(gbit=25, latency_us=5, ranks_per_node=16)
CASES = [("allreduce", a) for a in ("ring", "recursive_doubling", "star")] + \
    [("broadcast", a) for a in ("tree", "star")] + \
    [(name, "hierarchical") for name in ("allreduce", "broadcast", "reduce_scatter", "all_gather")]


def simulate(n: int, name: str, algorithm: str, nbytes: int) -> float:
    staged = algorithm == "hierarchical"
    group = SimulatedBackend.create_group(n, network=NET, timeout=600, hierarchical=staged)
    x = np.ones(nbytes // 4, np.float32)
    algorithm = None if staged else algorithm

    def run(b):
        if name == "allreduce":
            fc.allreduce(x, b, algorithm=algorithm)
        elif name == "reduce_scatter":
            fc.reduce_scatter(x, b, algorithm=algorithm)
        elif name == "all_gather":
            fc.all_gather(x, b, algorithm=algorithm)
        else:
            fc.broadcast(x, b, 0, algorithm=algorithm)
        return b.clock

    with mock.patch.object(cm, "choose_hierarchical", lambda *a, **k: staged):
        return max(run_threads(run, group, timeout=600))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="default: a new results/<version>/<machine>/scale_model-<date>")
    ap.add_argument("--quick", action="store_true", help="8-64 ranks, no PNG")
    args = ap.parse_args()
    if args.out is None:
        args.out = tables.run_dir("scale_model")
    args.out.mkdir(parents=True, exist_ok=True)
    p = cm.Params.of(NET)
    rows = ["| op | algorithm | ranks | size | model (us) | simulated (us) | error | "
            "auto staged | wall (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for n in (8, 16, 32, 64) if args.quick else (8, 16, 32, 64, 256):
        for nbytes in (4096, 1 << 20):
            for name, algorithm in CASES:
                hier = algorithm == "hierarchical"
                if hier and n // NET.ranks_per_node < 2 or not hier and n == 32:
                    continue  # no hierarchy on one node; 32 ranks for the hierarchical rows
                if n == 256 and nbytes > 4096 and algorithm != "recursive_doubling":
                    continue  # hundreds of MB through 256 threads: minutes for nothing new
                if hier and name == "all_gather" and nbytes > 4096 and n > 32:
                    continue  # all_gather's 1 MiB blocks: a 64 MiB result per rank
                t0 = time.perf_counter()
                sim = simulate(n, name, algorithm, nbytes)
                wall = time.perf_counter() - t0
                model = cm.predict(name, algorithm, nbytes, n, p)
                staged = cm.choose_hierarchical(name, nbytes, n, p) if hier else ""
                rows.append(f"| {name} | {algorithm} | {n} | {nbytes} | {model * 1e6:.1f} | "
                            f"{sim * 1e6:.1f} | {100 * (model - sim) / sim:+.2f}% | {staged} | "
                            f"{wall:.2f} |")
                print(rows[-1], flush=True)
    (args.out / "model_vs_simulated.md").write_text("\n".join(rows) + "\n")
    if args.quick:
        print(f"wrote {args.out}/model_vs_simulated.md")
        return

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    backend = type("B", (), {"network": NET})()
    for ax, nbytes, label in zip(axes, (4096, 1 << 20, 64 << 20), ("4 KiB", "1 MiB", "64 MiB")):
        for algorithm in cm.ALGORITHMS_MODELLED["allreduce"]:
            ax.plot(worlds, [cm.predict("allreduce", algorithm, nbytes, n, p) * 1e3
                             for n in worlds], marker=".", label=algorithm)
        several = [n for n in worlds if n // NET.ranks_per_node >= 2]
        ax.plot(several, [cm.predict("allreduce", "hierarchical", nbytes, n, p) * 1e3
                          for n in several], marker=".", label="hierarchical")
        picks = [(n, cm.predict("allreduce", "hierarchical" if cm.choose_hierarchical(
            "allreduce", nbytes, n, p) else choose(BY_NAME["allreduce"], None, nbytes, n, backend),
            nbytes, n, p) * 1e3) for n in worlds]
        ax.scatter(*zip(*picks), s=120, facecolors="none", edgecolors="k", label="auto's pick")
        ax.set(xscale="log", yscale="log", xlabel="ranks", ylabel="ms (model)",
               title=f"allreduce {label}, 25 Gb/s, 16 ranks/node")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "allreduce_vs_world.png", dpi=110)
    print(f"wrote {args.out}/model_vs_simulated.md and allreduce_vs_world.png")


if __name__ == "__main__":
    main()
