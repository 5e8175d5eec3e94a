"""Planning past one machine: the cost model against the simulated network, and what "auto" picks.

1. For allreduce (ring, recursive doubling, star) and broadcast (tree, star) at 8-256 ranks on a
   25 Gb/s cluster of 16-rank nodes: the model's prediction, the simulated network's virtual
   time (SimulatedBackend(network=...), ranks as threads), the error.
2. The model's time per algorithm vs world size (2-1024) for 4 KiB, 1 MiB and 64 MiB on that
   cluster, auto's pick marked (a PNG).

    python benchmarks/scale_model.py [--out benchmarks/scale]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import ferro_collective as fc
from ferro_backend import SimulatedBackend
from ferro_backend.netsim import Network
from ferro_backend.testing import run_threads
from ferro_collective import costmodel as cm
from ferro_collective.call import choose

NET = Network.cluster(gbit=25, latency_us=5, ranks_per_node=16)
CASES = [("allreduce", a) for a in ("ring", "recursive_doubling", "star")] + \
    [("broadcast", a) for a in ("tree", "star")]


def simulate(n: int, name: str, algorithm: str, nbytes: int) -> float:
    group = SimulatedBackend.create_group(n, network=NET, timeout=600)
    x = np.ones(nbytes // 4, np.float32)

    def run(b):
        if name == "allreduce":
            fc.allreduce(x, b, algorithm=algorithm)
        else:
            fc.broadcast(x, b, 0, algorithm=algorithm)
        return b.clock

    return max(run_threads(run, group, timeout=600))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "scale")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    p = cm.Params.of(NET)
    rows = ["| op | algorithm | ranks | size | model (us) | simulated (us) | error | wall (s) |",
            "|---|---|---|---|---|---|---|---|"]
    for n in (8, 16, 64, 256):
        for nbytes in (4096, 1 << 20):
            for name, algorithm in CASES:
                if n == 256 and nbytes > 4096 and algorithm != "recursive_doubling":
                    continue  # hundreds of MB through 256 threads: minutes for nothing new
                t0 = time.perf_counter()
                sim = simulate(n, name, algorithm, nbytes)
                wall = time.perf_counter() - t0
                model = cm.predict(name, algorithm, nbytes, n, p)
                rows.append(f"| {name} | {algorithm} | {n} | {nbytes} | {model * 1e6:.1f} | "
                            f"{sim * 1e6:.1f} | {100 * (model - sim) / sim:+.2f}% | {wall:.2f} |")
                print(rows[-1], flush=True)
    (args.out / "model_vs_simulated.md").write_text("\n".join(rows) + "\n")

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
        picks = [(n, cm.predict("allreduce", choose("allreduce", None, nbytes, n, backend),
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
