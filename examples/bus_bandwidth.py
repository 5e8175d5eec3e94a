"""Bus bandwidth of ferro's collectives on this job's ranks, as a table and a plot.

    ferrorun --nproc 2 examples/bus_bandwidth.py --plot busbw.png
    FERRO_TRANSPORT=tcp ferrorun --nproc 2 examples/bus_bandwidth.py     (the sockets only)

Every rank times allreduce, all_gather, reduce_scatter and broadcast of float32 arrays from
``--min-bytes`` to ``--max-bytes`` (a factor of 4 apart) into preallocated outputs (``out=``),
as a user tuning for speed calls them: a barrier, a warm-up call, then calls for about
``--seconds`` per size. A call's time is the slowest rank's mean; bus bandwidth follows
nccl-tests (allreduce moves ``2(n-1)/n`` of the data per rank, all_gather and reduce_scatter
``(n-1)/n``, broadcast all of it), so the figures compare across world sizes and with
nccl-tests' and ``benchmarks/peers.py``'s. Rank 0 prints the table and, with ``--plot``, writes it
as a PNG (matplotlib). ``benchmarks/peers.py`` puts the same figures beside MPI's and gloo's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from ferro_backend import init_from_env
from ferro_collective import ReduceOp, all_gather, allreduce, barrier, broadcast, reduce_scatter

#: bytes each rank moves per byte of the collective's size, for n ranks (nccl-tests)
FACTORS = {"allreduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-bytes", type=int, default=4 << 10)
    p.add_argument("--max-bytes", type=int, default=16 << 20)
    p.add_argument("--seconds", type=float, default=0.1, help="timed per size and collective")
    p.add_argument("--plot", type=Path, default=None, help="write the plot here (rank 0)")
    args = p.parse_args(argv)
    if not 4 <= args.min_bytes <= args.max_bytes:
        p.error(f"need 4 <= --min-bytes ({args.min_bytes}) <= --max-bytes ({args.max_bytes})")
    if not (0 < args.seconds < float("inf")):  # (NaN fails too)
        p.error(f"--seconds must be a finite number > 0 (got {args.seconds})")
    if args.plot is not None:  # told now, not after the measuring
        if args.plot.is_dir():
            p.error(f"--plot: {args.plot} is a directory")
        if not args.plot.parent.is_dir():
            p.error(f"--plot: no directory {args.plot.parent}")
    return args


def sizes(lo: int, hi: int) -> list[int]:
    out = []
    while lo <= hi:
        out.append(lo)
        lo *= 4
    return out


def time_calls(call, backend, seconds: float) -> float:
    """Seconds per call, the slowest rank's mean over a batch sized from a first timed call."""
    call()  # warm-up: plans, pages
    barrier(backend)
    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    k = max(3, min(2000, int(seconds / max(first, 1e-7))))
    k = int(allreduce(np.array([k], np.int64), backend, ReduceOp.MIN)[0])  # the same on every rank
    barrier(backend)
    t0 = time.perf_counter()
    for _ in range(k):
        call()
    mine = (time.perf_counter() - t0) / k
    return float(allreduce(np.array([mine]), backend, ReduceOp.MAX)[0])


def calls_for(backend, count: int) -> dict:
    """One call of each collective on ``count`` float32 items, into outputs made once."""
    n = backend.world_size
    x = np.ones(count, np.float32)
    out, gathered, part = np.empty_like(x), np.empty_like(x), np.empty(count // n, np.float32)
    return {"allreduce": lambda: allreduce(x, backend, out=out),
            "all_gather": lambda: all_gather(x[: count // n], backend, out=gathered),
            "reduce_scatter": lambda: reduce_scatter(x, backend, out=part),
            "broadcast": lambda: broadcast(x, backend, 0, out=x)}


def measure(backend, byte_sizes: list[int], seconds: float) -> dict[str, list[float]]:
    """Bus bandwidth (GB/s) of each collective at each size."""
    n = backend.world_size
    table: dict[str, list[float]] = {op: [] for op in FACTORS}
    for nbytes in byte_sizes:
        count = max(n, nbytes // 4) // n * n  # a whole number of items per rank
        for op, call in calls_for(backend, count).items():
            seconds_per_call = time_calls(call, backend, seconds)
            table[op].append(count * 4 * FACTORS[op](n) / seconds_per_call / 1e9)
    return table


def human(nbytes: int) -> str:
    """``nbytes`` in MiB, KiB or bytes: whole where it is a whole number of them, else to
    one decimal, rounded down (a size under 1 KiB was "0 KiB", 3000 bytes "2 KiB")."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            whole, part = divmod(nbytes, 1 << shift)
            tenths = (part * 10) >> shift  # (rounded down: 1 MiB - 1 byte is not "1024.0 KiB")
            return f"{whole} {unit}" if not part else f"{whole}.{tenths} {unit}"
    return f"{nbytes} B"


def plot(table: dict[str, list[float]], byte_sizes: list[int], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for op, values in table.items():
        ax.plot(byte_sizes, values, marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_xticks(byte_sizes, [human(s) for s in byte_sizes])
    ax.set_xlabel("collective size (float32)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    backend = init_from_env()
    byte_sizes = sizes(args.min_bytes, args.max_bytes)
    table = measure(backend, byte_sizes, args.seconds)
    if backend.rank == 0:
        where = backend.describe().splitlines()[0].split(" (this is")[0]
        print(f"bus bandwidth, GB/s: {backend.world_size} ranks, {where}")
        print("| size | " + " | ".join(table) + " |")
        for i, nbytes in enumerate(byte_sizes):
            print(f"| {human(nbytes)} | " + " | ".join(f"{table[op][i]:.3g}" for op in table)
                  + " |")
        if args.plot is not None:
            plot(table, byte_sizes, f"{backend.world_size} ranks, {where}", args.plot)
            print(f"plot: {args.plot}")
    barrier(backend)
    backend.close()


if __name__ == "__main__":
    main()
