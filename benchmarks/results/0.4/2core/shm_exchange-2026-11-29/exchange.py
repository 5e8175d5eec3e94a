"""us per call on ShmBackend's point-to-point messages, 2 ranks: an exchange (each rank posts a
receive from the other, sends to it, waits) and a ping-pong (rank 0 sends then receives, rank 1
the reverse), 4 KiB and 1 MiB; then ferro_jax.sendrecv inside a jitted fori_loop (the exchange
through ferro-jax's Python path).

    ferrorun --nproc 2 exchange.py
"""

import time

import ferro_jax as fj
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

b = fj.init()
me, peer = b.rank, 1 - b.rank
for nbytes in (4096, 1 << 20):
    x = np.ones(nbytes // 4, np.float32)
    y = np.empty_like(x)
    calls = 2000 if nbytes == 4096 else 200
    cells = {}
    for mode in ("exchange", "ping-pong"):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(calls):
                if mode == "exchange":
                    r = b.irecv(y, peer)
                    b.send(x, peer)
                    r.wait(10)
                elif me == 0:
                    b.send(x, peer)
                    b.recv(y, peer)
                else:
                    b.recv(y, peer)
                    b.send(x, peer)
            times.append((time.perf_counter() - t0) / calls * 1e6)
        cells[mode] = times
    v = jnp.asarray(x)
    loop = jax.jit(lambda v, k=calls: lax.fori_loop(0, k, lambda i, a: fj.sendrecv(a, peer, peer), v))
    jax.block_until_ready(loop(v))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(v))
        times.append((time.perf_counter() - t0) / calls * 1e6)
    cells["ferro_jax.sendrecv in jit"] = times
    if me == 0:
        for k, t in cells.items():
            t = sorted(t)
            print(f"{nbytes >> 10} KiB | {k} | {t[1]:.1f} ({t[0]:.1f}-{t[2]:.1f})", flush=True)
