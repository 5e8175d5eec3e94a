"""Data-parallel training of a small MLP in JAX with optax, gradients averaged by ferro_jax.

Every rank holds the whole model and trains on its own rows of each global batch; inside the
jitted step, ``ferro_jax.allreduce(grads, "mean")`` averages the gradients across the ranks (one
FFI call per parameter array, on the engine's door under ferrorun on one host), so every rank
applies the same update and the replicas stay bit-identical (checked at the end).

    ferrorun --nproc 2 examples/jax_data_parallel.py --steps 300
    ferrorun --nproc 2 examples/jax_data_parallel.py --no-sync --steps 300   # the yardstick
    ferrorun --nproc 2 examples/jax_data_parallel.py --steps 200 --checkpoint ckpt --save-every 50
    ferrorun --nproc 4 examples/jax_data_parallel.py --steps 300 --checkpoint ckpt --resume

Writes the loss curve (``--out``, default ``jax_loss_curve.csv``, and a PNG beside it where
matplotlib is installed) and prints the step time after warm-up (mean, median and 10th
percentile: on a shared machine the last one shows the step without other processes' delays,
which a synchronised step feels on every rank), and on one host the engine's link between
the ranks' cores as the job formed and at its end (``ShmBackend.engine.link``: this host's copies
from core to core run at 1.5-27 GB/s by its state, which moves the synchronised step's time).
``--no-sync`` trains every rank alone (no
allreduce): the step time the synchronised one is compared with. The jitted step carries no
runtime token (ferro_jax's calls are ordered inside it), so JAX dispatches it on its fast path.

Checkpoints (``--checkpoint DIR``, ferro-checkpoint's ``CheckpointManager``: ``DIR/step_<n>/``,
the newest three kept) hold the parameters and Adam's state as flat vectors (``params``,
``adam_mu``, ``adam_nu``, in ``jax.flatten_util.ravel_pytree``'s order), each split over the
ranks in ferro-checkpoint's own rule (:class:`FlatLayout`): the state is replicated, and each
rank writes only its slice of it, so no byte is written twice. ``--resume`` restores the newest
committed step on any number of ranks (ferro-checkpoint reshards the slices to the new world;
one ``ferro_jax.all_gather`` rebuilds the whole state) and continues at the next step; the
parameters' SHA-256 saved with the step is checked against the rebuilt ones. The data of a step
is a function of the step alone (each rank takes its rows of the global batch), so a resumed run
sees the batches it would have seen. ``examples/jax_zero.py`` (Adam's state sharded, ZeRO
style) writes the same checkpoints: either resumes the other's.

Needs jax, optax and the ferro-jax distribution (``pip install ./packages/ferro-backend
./packages/ferro-collective ./packages/ferro-jax optax``; ferro-checkpoint for ``--checkpoint``).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time
from pathlib import Path

import ferro_jax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from ferro_backend.partition import split_sizes


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


def make_data(rank: int, world: int, batch: int, features: int, start: int, stop: int):
    """Steps ``start..stop-1`` of a synthetic regression task (the same teacher for every step),
    this rank's rows of each global batch: a step's batch depends on its number alone, so the
    ranks of any world size (and a resumed run) see the same global batches."""
    if batch % world:
        raise SystemExit(f"--batch {batch} is not a multiple of the {world} ranks")
    teacher = np.random.default_rng(0).standard_normal((features, 1)) / features ** 0.5
    rows = slice(rank * batch // world, (rank + 1) * batch // world)
    xs, ys = [], []
    for step in range(start, stop):
        rng = np.random.default_rng((1, step))
        x = rng.standard_normal((batch, features)).astype(np.float32)
        y = np.tanh(x @ teacher).astype(np.float32) + 0.01 * rng.standard_normal(
            (batch, 1)).astype(np.float32)
        xs.append(x[rows])
        ys.append(y[rows])
    shape = (0, batch // world)
    return (jnp.asarray(np.stack(xs) if xs else np.zeros((*shape, features), np.float32)),
            jnp.asarray(np.stack(ys) if ys else np.zeros((*shape, 1), np.float32)))


class FlatLayout:
    """The flat parameter vector (``n`` elements) split over ``world`` ranks as ferro-checkpoint
    splits a tensor (``split_sizes``: the first ``n % world`` ranks get one element more), each
    rank's slice padded to the largest (``block``): the equal blocks reduce_scatter and
    all_gather move. A checkpoint saved by this layout restores on another world size in the
    new world's layout: ferro-checkpoint's reshard gives each rank exactly its new slice."""

    def __init__(self, n: int, world: int):
        if n < world:
            raise ValueError(f"{n} parameters cannot be split over {world} ranks")
        self.n, self.world = n, world
        self.sizes = split_sizes(n, world)
        self.block = self.sizes[0]
        self.full = n % world or world  # the ranks whose slice has no padding

    def rows(self, rank: int) -> slice:
        start = sum(self.sizes[:rank])
        return slice(start, start + self.sizes[rank])

    def to_blocks(self, flat):
        """(n,) -> (world * block,): every rank's slice, padded with zeros."""
        if self.full == self.world:
            return flat
        head = flat[:self.full * self.block].reshape(self.full, self.block)
        tail = flat[self.full * self.block:].reshape(self.world - self.full, self.block - 1)
        return jnp.concatenate([head, jnp.pad(tail, ((0, 0), (0, 1)))]).ravel()

    def from_blocks(self, blocks):
        """(world * block,) -> (n,): the padding dropped."""
        if self.full == self.world:
            return blocks
        b = blocks.reshape(self.world, self.block)
        return jnp.concatenate([b[:self.full].ravel(), b[self.full:, :-1].ravel()])

    def pad(self, rows: np.ndarray) -> jnp.ndarray:
        """This rank's slice, padded to a block."""
        return jnp.asarray(np.pad(rows, (0, self.block - rows.size)))

    def gather(self, block) -> jnp.ndarray:
        """Every rank's block of a vector -> the whole vector (one all_gather, outside jit)."""
        return self.from_blocks(ferro_jax.all_gather(jnp.asarray(block)))


def sha256(flat) -> str:
    return hashlib.sha256(np.asarray(flat).tobytes()).hexdigest()


def adam_state(state, count, mu, nu):
    """optax.adam's state (``scale_by_adam``'s, then the learning rate's) with these values."""
    return (state[0]._replace(count=jnp.asarray(count, jnp.int32), mu=mu, nu=nu), *state[1:])


class Checkpoints:
    """``--checkpoint DIR``: ferro-checkpoint's CheckpointManager, one per rank, saving
    collectively (``backend=``: one id, one commit) and blocking, between two steps, so its
    messages never run beside a jitted step's calls on the same backend."""

    NAMES = ("params", "adam_mu", "adam_nu")

    def __init__(self, root: str, backend, layout: FlatLayout, model: dict):
        from ferro_checkpoint import CheckpointManager, ShardMetadata, TensorShardSpec

        self.rank, self.world, self.layout = backend.rank, backend.world_size, layout
        self.root, self.model = root, model
        self.manager = CheckpointManager(root, self.rank, self.world, keep_last=3,
                                         backend=backend)
        spec = TensorShardSpec((layout.n,), 0, layout.sizes)
        self.spec = ShardMetadata(self.world, {name: spec for name in self.NAMES})

    def save(self, step: int, rows: dict, count: int, losses: list, params_sha256: str) -> None:
        """Step ``step``: this rank's rows of params, adam_mu and adam_nu (each
        ``layout.sizes[rank]`` elements); Adam's step count, the loss history and the
        parameters' SHA-256 in ``extra``."""
        extra = {"step": step, "adam_count": count, "losses": losses, "world_size": self.world,
                 "params_sha256": params_sha256, "model": self.model}
        self.manager.save(step, {k: np.asarray(v) for k, v in rows.items()}, self.spec,
                          extra=extra).wait()

    def restore(self):
        """The newest committed step as rank 0 sees it (one decision for every rank): its step,
        this rank's padded blocks of params, adam_mu and adam_nu (resharded to this world),
        Adam's count, the losses so far and the saved SHA-256; None if nothing was saved."""
        mine = self.manager.latest_step()
        step = int(ferro_jax.broadcast(jnp.asarray(-1 if mine is None else mine, jnp.int32)))
        if step < 0:
            return None
        tensors, extra = self.manager.restore(step)
        saved = extra.get("model", self.model)  # (checkpoints of older runs: not recorded)
        if saved != self.model:
            raise SystemExit(f"--resume: the checkpoint in {self.root} is of another model "
                             f"{saved}; this run asks for {self.model}")
        blocks = {k: self.layout.pad(tensors[k]) for k in self.NAMES}
        return step, blocks, extra


def parse_args(description: str, sync_flag: bool = True):
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=int, default=300, help="train until this step")
    ap.add_argument("--batch", type=int, default=256, help="global batch (split over ranks)")
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    if sync_flag:
        ap.add_argument("--no-sync", action="store_true", help="no allreduce (the yardstick)")
    ap.add_argument("--out", default="jax_loss_curve.csv")
    ap.add_argument("--checkpoint", metavar="DIR", help="save checkpoints in DIR "
                    "(ferro-checkpoint: DIR/step_<n>/, the newest three kept)")
    ap.add_argument("--save-every", type=int, default=100,
                    help="steps between checkpoints (and one at the last step)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint in --checkpoint, on any world size")
    ap.add_argument("--params-out", metavar="FILE.npy",
                    help="rank 0 writes the final parameters (flat, float32) here")
    args = ap.parse_args()
    for flag, low in (("--steps", 0), ("--batch", 1), ("--features", 1), ("--hidden", 1),
                      ("--save-every", 1)):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < low:
            ap.error(f"{flag} must be >= {low} (got {value})")
    if not math.isfinite(args.lr):
        ap.error(f"--lr must be a finite number (got {args.lr})")
    if args.resume and not args.checkpoint:
        ap.error("--resume needs --checkpoint DIR")
    if getattr(args, "no_sync", False) and args.checkpoint:
        ap.error("--no-sync trains replicas that differ: nothing to checkpoint")
    return args


def model_of(args) -> dict:
    """The model's shape, saved with each checkpoint: a resume of another model is refused."""
    return {"features": args.features, "hidden": args.hidden}


def start_run(args, rank: int, unravel, layout: FlatLayout, ckpt: Checkpoints | None):
    """``(0, [], None)`` for a fresh run; on ``--resume`` the saved step, the losses so far and
    the restored state (the parameters rebuilt by one all_gather and checked bit for bit
    against the saved SHA-256)."""
    if ckpt is None or not args.resume:
        return 0, [], None
    found = ckpt.restore()
    if found is None:
        raise SystemExit(f"--resume: no committed checkpoint in {args.checkpoint}")
    step, blocks, extra = found
    flat = layout.gather(blocks["params"])
    same = sha256(flat) == extra["params_sha256"]
    print(f"rank {rank}: resumed step {step} (saved on {extra['world_size']} ranks) on "
          f"{layout.world} ranks; parameters bit-identical to the saved ones: {same}", flush=True)
    if not same:
        raise SystemExit("the restored parameters are not the saved ones")
    return step, list(extra["losses"]), (unravel(flat), blocks, extra["adam_count"])


def train(step_fn, params, state, xs, ys, start: int, stop: int, losses: list, save):
    """Steps ``start+1..stop``, each loss appended to ``losses``; ``save(step, params, state,
    losses)`` after each step. Returns the parameters, the state and this run's step times."""
    times = []
    for i in range(start, stop):
        t0 = time.perf_counter()
        params, state, loss = step_fn(params, state, xs[i - start], ys[i - start])
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - t0)
        save(i + 1, params, state, losses)
    return params, state, times


def finish(args, rank: int, world: int, params, losses: list, times: list, first: int,
           check: bool, title: str) -> None:
    """Print the summary (step times after 10 warm-up steps), check the replicas agree bit
    for bit, and on rank 0 write the loss curve (CSV, and a PNG with matplotlib) and
    ``--params-out``."""
    flat = ravel_pytree(params)[0]
    same = bool(jnp.array_equal(ferro_jax.broadcast(flat, 0), flat)) if check else None
    done = f"{losses[0]:.4f} at step 1, {losses[-1]:.4f} at step {len(losses)}" if losses \
        else "no step yet"
    warm = times[min(10, len(times) - 1):]
    timing = (f"step {np.mean(warm) * 1e3:.3f} ms (median {np.median(warm) * 1e3:.3f}, 10th "
              f"percentile {np.percentile(warm, 10) * 1e3:.3f})") if times else "no step run"
    print(f"rank {rank} of {world}: loss {done} ({len(times)} steps from step {first}); "
          f"{timing}; replicas identical: {same}", flush=True)
    if rank != 0:
        return
    if args.params_out:
        np.save(args.params_out, np.asarray(flat))
    out = Path(args.out)
    out.write_text("step,loss\n" + "".join(f"{i + 1},{v:.6f}\n" for i, v in enumerate(losses)))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.semilogy(np.arange(1, len(losses) + 1), losses)
    if first:
        ax.axvline(first, color="gray", linestyle=":", label=f"resumed at step {first}")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("mean loss over the ranks")
    ax.set_title(f"{title}, {world} ranks")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    backend = ferro_jax.init()  # ferrorun/torchrun/mpirun/srun; alone: one rank
    rank, world = backend.rank, backend.world_size
    formed = getattr(getattr(backend, "engine", None), "link", None)  # (the join's probe)
    params = init_params(jax.random.PRNGKey(0), [args.features, args.hidden, args.hidden, 1])
    flat, unravel = ravel_pytree(params)
    layout = FlatLayout(flat.size, world)
    opt = optax.adam(args.lr)
    state = opt.init(params)
    ckpt = (Checkpoints(args.checkpoint, backend, layout, model_of(args)) if args.checkpoint
            else None)
    start, losses, restored = start_run(args, rank, unravel, layout, ckpt)
    if restored is not None:  # every rank's slices of Adam's moments, gathered
        params, blocks, count = restored
        state = adam_state(state, count, unravel(layout.gather(blocks["adam_mu"])),
                           unravel(layout.gather(blocks["adam_nu"])))
    xs, ys = make_data(rank, world, args.batch, args.features, start, args.steps)

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        if not args.no_sync:  # the mean gradient over the ranks, inside the jitted step
            grads = jax.tree.map(lambda g: ferro_jax.allreduce(g, "mean"), grads)
            loss = ferro_jax.allreduce(loss, "mean")
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def save(step_now, params, state, losses):
        if ckpt is None or (step_now % args.save_every and step_now != args.steps):
            return
        flat = np.asarray(ravel_pytree(params)[0])
        rows = layout.rows(rank)  # the state is replicated: each rank writes its slice
        ckpt.save(step_now, {"params": flat[rows],
                             "adam_mu": np.asarray(ravel_pytree(state[0].mu)[0])[rows],
                             "adam_nu": np.asarray(ravel_pytree(state[0].nu)[0])[rows]},
                  int(state[0].count), losses, sha256(flat))

    params, state, times = train(step, params, state, xs, ys, start, args.steps, losses, save)
    finish(args, rank, world, params, losses, times, start, not args.no_sync,
           "JAX data parallel over ferro_jax")
    said = link_states(backend, formed)
    if rank == 0 and said:
        print(said, flush=True)


def link_states(backend, formed) -> str:
    """The same-host engine's link between the ranks' cores as the job formed (``formed``: the
    engine's link then) and probed again now (collective: every rank calls it), in words, with
    how many probes ran between (the engine re-probes by itself while calls run); "" where there
    is none (TCP, one rank, more ranks than cores). This host's state moves a step's time (its
    copies from core to core run at 1.5-27 GB/s), so a step time is read with it."""
    if formed is None:
        return ""
    now = backend.engine.probe_link()
    return (f"link: as the job formed, {formed.describe()}; at its end, {now.describe()} "
            f"(probe {now.probe} of the job)")


if __name__ == "__main__":
    main()
