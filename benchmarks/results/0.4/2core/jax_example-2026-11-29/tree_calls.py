"""us per jitted step for the example's calls alone: its gradient leaves and loss allreduced one
call per leaf, or as one pytree (needs e981942's ferro-jax, whose allreduce took pytrees).

    ferrorun --nproc 2 tree_calls.py
"""

import os
import statistics
import time

import ferro_jax as fj
import jax
import jax.numpy as jnp
from jax import lax

backend = fj.init()
SHAPES = [(64, 256), (256,), (256, 256), (256,), (256, 1), (1,), ()]
TREE = [jnp.ones(s, jnp.float32) * (backend.rank + 1) for s in SHAPES]


def per_leaf(t):
    return [fj.allreduce(g, "mean") for g in t]


def as_tree(t):
    return fj.allreduce(t, "mean")


def timed(fn, calls: int = 2000) -> float:
    loop = jax.jit(lambda t: lax.fori_loop(0, calls, lambda i, v: fn(v), t))
    jax.block_until_ready(loop(TREE))
    t0 = time.perf_counter()
    jax.block_until_ready(loop(TREE))
    return (time.perf_counter() - t0) / calls * 1e6


res: dict[str, list[float]] = {"per_leaf": [], "tree": []}
for _ in range(int(os.environ.get("REPS", "5"))):
    for k, f in (("per_leaf", per_leaf), ("tree", as_tree)):
        res[k].append(timed(f))
if backend.rank == 0:
    for k, v in res.items():
        print(k, f"{statistics.median(v):.1f} us ({min(v):.1f}-{max(v):.1f})", flush=True)
