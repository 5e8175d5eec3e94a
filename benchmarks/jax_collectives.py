"""ferro_jax inside jax.jit against JAX's own multi-process CPU collectives (gloo), and the
per-call cost of a ferro_jax call inside jit against the engine's door called from C.

    ferrorun --nproc 2 benchmarks/jax_collectives.py [--repeats 3] [--max-mib 64] [--no-gloo]

Every rank runs, in one process: ferro_jax.allreduce / all_gather / reduce_scatter on float32
arrays of 4 KiB .. --max-mib MiB inside a jitted ``fori_loop`` (one dispatch, many calls: the
time of the calls, not of JAX's dispatch), and the same sizes through ``jax.distributed`` +
``shard_map`` with ``psum`` / ``all_gather`` / ``psum_scatter`` across the processes (gloo),
interleaved, ``--repeats`` times; rank 0 prints the medians (us per call), min-max, and the
ratio gloo / ferro (> 1: ferro faster). Then the 4 KiB allreduce as one door call from C in a
loop (``ferro_jax_c_allreduce``, the handlers' library) against the same call inside jit, and
one jitted call with a ferro_jax call in it against the same jitted function without it: the
time to dispatch it (the call returns; JAX dispatches asynchronously) and the time per call of
2000 calls in a row, run included. ``jax.distributed.initialize`` runs before ``ferro_jax.init``
here, so XLA's threads exist before ferro binds the rank to its core: ferro_jax pins the XLA
threads that run its handlers to the rank's core (without that, a 64 KiB allreduce took about
600 us instead of 10-40: the two ranks' spinning waits on one core). ``FERRO_JAX_RUNTIME_TOKENS=1``
measures the earlier dispatch (a runtime token per computation: JAX's Python path). Not a
pytest-benchmark file (jax is not in the bench sessions).
"""

from __future__ import annotations

import argparse
import os
import time

import ferro_jax as fj
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def timed_loop(fn, x, calls: int) -> float:
    loop = jax.jit(lambda x: lax.fori_loop(0, calls, lambda i, v: fn(v), x))
    loop(x).block_until_ready()
    start = time.perf_counter()
    loop(x).block_until_ready()
    return (time.perf_counter() - start) / calls


def ferro_cells(size: int, n: int, calls: int) -> dict[str, float]:
    x = jnp.ones(size // 4, jnp.float32)
    return {
        "allreduce": timed_loop(lambda v: fj.allreduce(v) * 0.5, x, calls),
        "all_gather": timed_loop(lambda v: fj.all_gather(v)[: v.shape[0]], x, calls),
        "reduce_scatter": timed_loop(lambda v: jnp.tile(fj.reduce_scatter(v), n) * 0.5, x,
                                     calls),
    }


def gloo_cells(size: int, n: int, calls: int, mesh) -> dict[str, float]:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    try:
        from jax import shard_map
    except ImportError:  # pragma: no cover - older jax
        from jax.experimental.shard_map import shard_map
    count = size // 4
    spec = NamedSharding(mesh, P("x"))
    local = np.ones(count, np.float32)
    x = jax.make_array_from_process_local_data(spec, local)

    def run(body) -> float:
        f = jax.jit(shard_map(lambda v: lax.fori_loop(0, calls, lambda i, a: body(a), v),
                              mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
        f(x).block_until_ready()
        start = time.perf_counter()
        f(x).block_until_ready()
        return (time.perf_counter() - start) / calls

    return {
        "allreduce": run(lambda a: lax.psum(a, "x") * 0.5),
        "all_gather": run(lambda a: lax.all_gather(a, "x", tiled=True)[: a.shape[0]]),
        "reduce_scatter": run(lambda a: jnp.tile(lax.psum_scatter(a, "x", tiled=True), n)
                              * 0.5),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--no-gloo", action="store_true")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mesh = None
    if not args.no_gloo:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        port = int(os.environ["MASTER_PORT"]) + 7
        jax.distributed.initialize(f"127.0.0.1:{port}", world, rank)
        mesh = jax.make_mesh((world,), ("x",))
    backend = fj.init()
    sizes = [4 << 10]
    while sizes[-1] < args.max_mib << 20:
        sizes.append(sizes[-1] * 4)
    table: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.repeats):  # interleaved: ferro then gloo, every size, each repeat
        for size in sizes:
            calls = max(5, min(2000, (64 << 20) // size // 4))
            cells = {"ferro": ferro_cells(size, world, calls)}
            if mesh is not None:
                cells["gloo"] = gloo_cells(size, world, calls, mesh)
            for who, got in cells.items():
                for op, t in got.items():
                    table.setdefault((who, op, size), []).append(t)
    if rank == 0:
        print(f"{world} processes, float32, us per call (median of {args.repeats}; "
              "min-max), inside a jitted fori_loop")
        print(f"{'op':>15} {'size':>9} {'ferro_jax':>22} {'jax gloo':>22} {'gloo/ferro':>10}")
        for op in ("allreduce", "all_gather", "reduce_scatter"):
            for size in sizes:
                f = np.array(table[("ferro", op, size)]) * 1e6
                g = np.array(table.get(("gloo", op, size), [np.nan])) * 1e6
                print(f"{op:>15} {size >> 10:>7}Ki {np.median(f):9.1f} ({f.min():.1f}-"
                      f"{f.max():.1f}) {np.median(g):9.1f} ({g.min():.1f}-{g.max():.1f}) "
                      f"{np.median(g) / np.median(f):10.2f}")
    overhead(backend, rank)


def overhead(backend, rank: int) -> None:
    """The 4 KiB allreduce: the door from C against the same call inside jit; and a jitted
    call's dispatch with and without a ferro_jax call in it."""
    from ferro_jax import _lib

    lib, slot = _lib.library(), fj.comm().slot
    if slot is None:
        return
    x = np.ones(1024, np.float32)
    y = np.empty_like(x)
    reps = 20000
    c_times, jit_times = [], []
    for _ in range(3):
        lib.ferro_jax_c_allreduce(slot, x.ctypes.data, y.ctypes.data, 1024, 0, 0, 200)
        start = time.perf_counter()
        rc = lib.ferro_jax_c_allreduce(slot, x.ctypes.data, y.ctypes.data, 1024, 0, 0, reps)
        c_times.append((time.perf_counter() - start) / reps)
        assert rc == 0, rc
        jit_times.append(timed_loop(lambda v: fj.allreduce(v) * 0.5, jnp.asarray(x), reps))
    xs = jnp.ones(16, jnp.float32)
    with_call = jax.jit(lambda v: fj.allreduce(v) * 2)
    without = jax.jit(lambda v: v * 2)
    d = {}
    for _ in range(3):  # interleaved: dispatch only (returns), and 2000 in a row, run included
        for name, f in (("with", with_call), ("without", without)):
            f(xs).block_until_ready()
            fj.barrier()
            runs = []
            for _ in range(20):
                start = time.perf_counter()
                out = f(xs)
                runs.append(time.perf_counter() - start)
                out.block_until_ready()
            d.setdefault((name, "dispatch"), []).append(np.median(runs))
            start = time.perf_counter()
            for _ in range(2000):
                out = f(xs)
            out.block_until_ready()
            d.setdefault((name, "row"), []).append((time.perf_counter() - start) / 2000)
    if rank == 0:
        c, j = np.median(c_times) * 1e6, np.median(jit_times) * 1e6
        print(f"4 KiB allreduce: door from C {c:.2f} us, inside jit {j:.2f} us "
              f"(+{j - c:.2f} us; runs {', '.join(f'{t * 1e6:.2f}' for t in jit_times)} vs "
              f"{', '.join(f'{t * 1e6:.2f}' for t in c_times)})")
        from ferro_jax import _dispatch

        how = "no runtime token" if _dispatch.ACTIVE else "runtime tokens"

        def cell(key):
            v = np.array(d[key]) * 1e6
            return f"{np.median(v):.1f} ({v.min():.1f}-{v.max():.1f})"

        print(f"one jitted call ({how}), us: dispatch {cell(('with', 'dispatch'))} with a "
              f"ferro_jax allreduce in it, {cell(('without', 'dispatch'))} without; "
              f"2000 in a row, run included: {cell(('with', 'row'))} with, "
              f"{cell(('without', 'row'))} without")


if __name__ == "__main__":
    main()
