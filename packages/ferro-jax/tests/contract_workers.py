"""What the ranks of test_contracts.py run (module-level: run_processes imports them)."""

from __future__ import annotations

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

import ferro_jax as fj  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402


def two_devices(backend) -> dict:
    """Jitted A (matrix work, then an allreduce) on CPU device 0, then jitted B (an allreduce)
    on device 1, on every rank: without a runtime token between them B can run first, and the
    ranks pair rank 0's B with rank 1's A."""
    jax.config.update("jax_num_cpu_devices", 2)  # (before jax's backend starts: raises after)
    fj.init(backend)
    rank = backend.rank
    d0, d1 = jax.devices()[:2]

    @jax.jit
    def a(x, m):
        for _ in range(3):
            m = jnp.tanh(m @ m)
        return fj.allreduce(x + m[0, 0] * 0, timeout=20)

    b = jax.jit(lambda y: fj.allreduce(y, timeout=20))
    sums = []
    for _ in range(3):
        m = jax.device_put(jnp.ones((600, 600) if rank == 0 else (2, 2)) * 1e-3, d0)
        x = jax.device_put(jnp.ones(4) * (rank + 1), d0)  # A: 1 + 2 = 3
        y = jax.device_put(jnp.ones(4) * 10 * (rank + 1), d1)  # B: 10 + 20 = 30
        with fj.typed_errors():
            ra = a(x, m)
            rb = b(y)
            sums.append([float(np.asarray(ra)[0]), float(np.asarray(rb)[0])])
    return {"devices": len(jax.devices()), "sums": sums}


def other_float8(backend) -> dict:
    """all_gather on float8_e4m3fn on rank 0, float8_e5m2 elsewhere (the same width), and
    bfloat16 against float16, in and out of jit: a mismatch on every rank."""
    fj.init(backend)
    rank = backend.rank
    pairs = {"float8": (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2),
             "bfloat16": (ml_dtypes.bfloat16, np.float16)}
    out = {}
    for name, (mine, theirs) in pairs.items():
        dtype = mine if rank == 0 else theirs
        for how, call in (("jit", jax.jit(lambda v: fj.all_gather(v, timeout=20))),
                          ("eager", lambda v: fj.all_gather(v, timeout=20))):
            try:
                with fj.typed_errors():
                    got = np.asarray(call(jnp.full(3, 1.5, dtype))).astype(np.float32)
                out[f"{name} {how}"] = got.tolist()
            except Exception as exc:  # (what each rank raised, by name)
                out[f"{name} {how}"] = f"{type(exc).__name__}: {exc}"
    # the same dtype on every rank still moves (the header names it on both)
    same = jax.jit(lambda v: fj.all_gather(v, timeout=20))(
        jnp.full(2, rank + 1.5, ml_dtypes.float8_e5m2))
    out["same"] = np.asarray(same).astype(np.float32).tolist()
    return out
