"""Training steps side by side: ferro DDP / FSDP against torch DDP / FSDP2, same run, 2 and 4 ranks.

float32 MLPs (9.6 k, 1.9 M and 8.4 M parameters), batch 128 per rank, forward + backward +
gradient sync + SGD momentum step. ferro runs under ``ferrorun`` (same-host engine); torch over
gloo with ``gradient_as_bucket_view=True`` (DDP) and ``fully_shard`` per Linear plus the root
(FSDP2). BLAS/OpenMP are capped to one thread per rank on both sides. "compute only" is the same
step on one rank's batch without any communication; "ferro-barrier" every rank computing that
step at once with one barrier a step and no gradient sync (the floor the ranks sharing the
host set for DDP: a DDP step is it plus the bucket allreduces). Figures: ms per step, the slowest rank's
median over the timed steps; each configuration is run ``--repeat`` times and the table gives
the median of those and their spread (min-max).

    python benchmarks/bench_train.py [--repeat 3] [--worlds 2,4] [--out RUN_DIR/results.md]

(RUN_DIR: a run directory of the results layout, ``tables.run_dir("bench_train")``.)

(``nox -s bench_train`` runs it with torch installed.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = {"9.6 k": (64, 128, 10), "1.9 M": (784, 1024, 1024, 10),
         "8.4 M": (1024, 2048, 2048, 1024, 10)}
BATCH = 128
WARMUP = 3
KINDS = ["ferro-compute", "torch-compute", "ferro-barrier", "ferro-ddp", "torch-ddp",
         "ferro-fsdp", "torch-fsdp2"]


def _steps(dims: tuple[int, ...]) -> int:
    params = sum(a * b + b for a, b in zip(dims, dims[1:]))
    return 60 if params < 1e5 else 15


# ---------------------------------------------------------------------------------- workers
def _ferro_worker(kind: str, dims: tuple[int, ...]) -> list[float]:
    import numpy as np

    from ferro_backend import init_from_env
    from ferro_collective import barrier
    from ferro_fsdp import DDP, FSDP, nn, optim

    backend = init_from_env()
    rng = np.random.default_rng(0)
    layers = []
    for i in range(len(dims) - 1):
        # the first layer's input is the data: no gradient for it (torch's autograd skips it too)
        layers.append(nn.Linear(dims[i], dims[i + 1], rng=rng, input_grad=i > 0))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    if kind == "ferro-ddp":
        model = DDP(model, backend)
    elif kind == "ferro-fsdp":
        model = FSDP(model, backend, "full_shard", wrap=nn.Linear)
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    data = np.random.default_rng(1 + backend.rank)
    x = data.standard_normal((BATCH, dims[0])).astype(np.float32)
    y = data.integers(0, dims[-1], BATCH)
    times = []
    for s in range(WARMUP + _steps(dims)):
        t0 = time.perf_counter()
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        if kind == "ferro-fsdp":
            model.sync_gradients()
        elif kind == "ferro-barrier" and backend.world_size > 1:
            barrier(backend)  # where DDP would sync: the ranks meet, nothing moves
        opt.step()
        opt.zero_grad()
        if s >= WARMUP:
            times.append(time.perf_counter() - t0)
    if backend.world_size > 1:
        barrier(backend)
    return times


def _torch_worker(kind: str, dims: tuple[int, ...]) -> list[float]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    distributed = kind != "torch-compute"
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    layers = []
    for i in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    if kind == "torch-ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    elif kind == "torch-fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(BATCH, dims[0], generator=g)
    y = torch.randint(0, dims[-1], (BATCH,), generator=g)
    times = []
    for s in range(WARMUP + _steps(dims)):
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s >= WARMUP:
            times.append(time.perf_counter() - t0)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return times


def worker(kind: str, dims: tuple[int, ...], out: Path) -> None:
    times = (_torch_worker if kind.startswith("torch") else _ferro_worker)(kind, dims)
    rank = os.environ.get("RANK", "0")
    (out / f"{kind}.{rank}.json").write_text(json.dumps(times))


# ----------------------------------------------------------------------------------- driver
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env_ranks(cmd: list[str], env: dict, world: int, what: str) -> None:
    """``world`` processes of ``cmd`` with torchrun's variables (env:// on a free port), as
    torch's own launcher would start them; SystemExit naming ``what`` if a rank fails."""
    port = _free_port()
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "WORLD_SIZE": str(world),
                                        "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                                        "MASTER_PORT": str(port)})
             for r in range(world)]
    for p in procs:
        if p.wait(timeout=600):
            raise SystemExit(f"{what}: a rank failed")


def run_one(kind: str, dims: tuple[int, ...], world: int, tmp: Path) -> float:
    """ms per step: the slowest rank's median."""
    for old in tmp.glob(f"{kind}.*.json"):
        old.unlink()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    me = [sys.executable, __file__, "--worker", kind, "--dims", ",".join(map(str, dims)),
          "--tmp", str(tmp)]
    world = 1 if kind.endswith("compute") else world
    if kind.startswith("ferro") and world > 1:
        cmd = [sys.executable, "-m", "ferro_backend.launch", "--nproc", str(world), *me[1:]]
        subprocess.run(cmd, env=env, check=True, timeout=600)
    else:
        launch_env_ranks(me, env, world, f"{kind} {dims}")
    medians = [statistics.median(json.loads(f.read_text())) for f in tmp.glob(f"{kind}.*.json")]
    if len(medians) != world:
        raise SystemExit(f"{kind} {dims}: {len(medians)} of {world} ranks reported")
    return 1e3 * max(medians)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--dims", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, tuple(int(d) for d in args.dims.split(",")), args.tmp)
        return
    import tempfile

    kinds = args.kinds.split(",")
    results: dict[str, dict[str, list[float]]] = {}
    worlds = [int(w) for w in args.worlds.split(",")]
    with tempfile.TemporaryDirectory(prefix="ferro-train-bench-") as tmp:
        for _ in range(args.repeat):  # repeats outermost: drift hits every column alike
            for world in worlds:
                for size in args.sizes.split(","):
                    for kind in kinds:
                        if kind.endswith("compute") and world != worlds[0]:
                            continue  # one rank: the same for every world
                        ms = run_one(kind, SIZES[size], world, Path(tmp))
                        key = f"{world} ranks, {size}"
                        results.setdefault(key, {}).setdefault(kind, []).append(ms)
                        print(f"{key:>16} {kind:<14} {ms:9.2f} ms/step", flush=True)
    for world in worlds[1:]:  # compute-only columns: measured once
        for size in args.sizes.split(","):
            for kind in kinds:
                if kind.endswith("compute"):
                    results[f"{world} ranks, {size}"][kind] = \
                        results[f"{worlds[0]} ranks, {size}"][kind]
    lines = ["| ranks, params | " + " | ".join(kinds) + " | ferro DDP / torch DDP | ferro FSDP / "
             "torch FSDP2 | ferro barrier-only / compute | ferro DDP / compute | ferro FSDP / "
             "compute |",
             "|---" * (len(kinds) + 6) + "|"]
    for size, row in results.items():
        cells = []
        for kind in kinds:
            v = row[kind]
            cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})")
        speed = []
        for mine, theirs in (("ferro-ddp", "torch-ddp"), ("ferro-fsdp", "torch-fsdp2")):
            if mine in row and theirs in row:  # > 1: ferro is faster
                speed.append(f"{statistics.median(row[theirs]) / statistics.median(row[mine]):.2f}x")
            else:
                speed.append("-")
        for mine in ("ferro-barrier", "ferro-ddp", "ferro-fsdp"):  # issue 27's: over compute
            if mine in row and "ferro-compute" in row:
                over = [m / statistics.median(row["ferro-compute"]) for m in row[mine]]
                speed.append(f"{statistics.median(over):.3f}x ({min(over):.3f}-{max(over):.3f})")
            else:
                speed.append("-")
        lines.append(f"| {size} | " + " | ".join(cells) + " | " + " | ".join(speed) + " |")
    table = "\n".join(lines)
    print("\nms per step (slowest rank's median; median of repeats, min-max); ratio = torch "
          "time / ferro time (> 1: ferro faster)\n" + table)
    if args.out:
        args.out.write_text(table + "\n")
        (args.out.with_suffix(".json")).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
