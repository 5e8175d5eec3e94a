"""Data-parallel training of a small MLP in JAX with optax, gradients averaged by ferro_jax.

Every rank holds the whole model and trains on its own shard of each batch; inside the jitted
step, ``ferro_jax.allreduce(grads, "mean")`` averages the gradients across the ranks (one FFI
call per parameter array, on the engine's door under ferrorun on one host), so every rank
applies the same update and the replicas stay bit-identical (checked at the end).

    ferrorun --nproc 2 examples/jax_data_parallel.py --steps 300
    ferrorun --nproc 2 examples/jax_data_parallel.py --no-sync --steps 300   # the yardstick

Writes the loss curve (``--out``, default ``jax_loss_curve.csv``, and a PNG beside it where
matplotlib is installed) and prints the step time after warm-up (mean, median and 10th
percentile: on a shared machine the last one shows the step without other processes' delays,
which a synchronised step feels on every rank). ``--no-sync`` trains every rank alone (no
allreduce): the step time the synchronised one is compared with. The jitted step carries no
runtime token (ferro_jax's calls are ordered inside it), so JAX dispatches it on its fast path.
Needs jax, optax and the ferro-jax distribution (``pip install ./packages/ferro-backend
./packages/ferro-collective ./packages/ferro-jax optax``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import ferro_jax
import jax
import jax.numpy as jnp
import numpy as np
import optax


def init_params(key, sizes: list[int]) -> list[dict]:
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (fan_in, fan_out)) * (2 / fan_in) ** 0.5,
                       "b": jnp.zeros(fan_out)})
    return params


def forward(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return jnp.mean((forward(params, x) - y) ** 2)


def make_data(rank: int, world: int, batch: int, features: int, steps: int):
    """A synthetic regression task (the same teacher on every rank), each rank its own rows."""
    teacher = np.random.default_rng(0).standard_normal((features, 1)) / features ** 0.5
    rng = np.random.default_rng(1 + rank)
    x = rng.standard_normal((steps, batch // world, features)).astype(np.float32)
    y = np.tanh(x @ teacher).astype(np.float32) + 0.01 * rng.standard_normal(
        (steps, batch // world, 1)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256, help="global batch (split over ranks)")
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--no-sync", action="store_true", help="no allreduce (the yardstick)")
    ap.add_argument("--out", default="jax_loss_curve.csv")
    args = ap.parse_args()

    backend = ferro_jax.init()  # ferrorun/torchrun/mpirun/srun; alone: one rank
    rank, world = backend.rank, backend.world_size
    params = init_params(jax.random.PRNGKey(0), [args.features, args.hidden, args.hidden, 1])
    opt = optax.adam(args.lr)
    state = opt.init(params)
    xs, ys = make_data(rank, world, args.batch, args.features, args.steps)

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        if not args.no_sync:  # the mean gradient over the ranks, inside the jitted step
            grads = jax.tree.map(lambda g: ferro_jax.allreduce(g, "mean"), grads)
            loss = ferro_jax.allreduce(loss, "mean")
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses, times = [], []
    for i in range(args.steps):
        start = time.perf_counter()
        params, state, loss = step(params, state, xs[i], ys[i])
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - start)
    warm = times[min(10, len(times) - 1):]
    if not args.no_sync:  # the replicas agree bit for bit
        flat = jnp.concatenate([p.ravel() for p in jax.tree.leaves(params)])
        same = bool(jnp.array_equal(ferro_jax.broadcast(flat, 0), flat))
    else:
        same = None
    print(f"rank {rank} of {world}: loss {losses[0]:.4f} at step 1, {losses[-1]:.4f} at step "
          f"{len(losses)}; step {np.mean(warm) * 1e3:.3f} ms (median "
          f"{np.median(warm) * 1e3:.3f}, 10th percentile {np.percentile(warm, 10) * 1e3:.3f}); "
          f"replicas identical: {same}", flush=True)
    if rank == 0:
        out = Path(args.out)
        out.write_text("step,loss\n" + "".join(f"{i + 1},{v:.6f}\n" for i, v in
                                               enumerate(losses)))
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.semilogy(np.arange(1, len(losses) + 1), losses)
        ax.set_xlabel("step")
        ax.set_ylabel("mean loss over the ranks")
        ax.set_title(f"JAX data parallel over ferro_jax, {world} ranks")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=100)


if __name__ == "__main__":
    main()
