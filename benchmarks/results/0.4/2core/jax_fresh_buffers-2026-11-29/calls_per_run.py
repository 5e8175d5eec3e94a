"""ms per jitted all_gather by the number of calls one execution makes (a fori_loop of K calls,
each output read once so nothing is copied), for 16 and 64 MiB blocks, and the same call
through ferro-collective into a reused numpy array.

    ferrorun --nproc 2 calls_per_run.py
    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295 \
        ferrorun --nproc 2 calls_per_run.py
"""

import time

import ferro_jax as fj
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import ferro_collective as fc

backend = fj.init()
for mib in (16, 64):
    n = (mib << 20) // 4
    x = jnp.ones(n, jnp.float32)
    cells = {}
    for calls in (1, 4, 16):
        loop = jax.jit(lambda x, a, k=calls: lax.fori_loop(
            0, k, lambda i, acc: acc + fj.all_gather(x)[-1], a))
        zero = jnp.zeros((), jnp.float32)
        jax.block_until_ready(loop(x, zero))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(loop(x, zero))
            times.append((time.perf_counter() - t0) / calls * 1e3)
        cells[f"jit, {calls} a run"] = times
    xn, out = np.ones(n, np.float32), np.empty(2 * n, np.float32)
    fc.all_gather(xn, backend, out=out)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(4):
            fc.all_gather(xn, backend, out=out)
        times.append((time.perf_counter() - t0) / 4 * 1e3)
    cells["ferro-collective, out= reused"] = times
    if backend.rank == 0:
        for k, v in cells.items():
            v = sorted(v)
            print(f"{mib} MiB | {k} | {v[2]:.1f} ({v[0]:.1f}-{v[-1]:.1f})", flush=True)
