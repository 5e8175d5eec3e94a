"""ZeRO-style data parallelism in JAX: Adam's state sharded over the ranks, through ferro_jax.

The model, data, checkpoints and loss curve are examples/jax_data_parallel.py's; what changes is
the optimizer. Each rank keeps the whole parameters (for its forward and backward passes) but
only 1/world of Adam's moments: its slice of the flattened parameter vector (``FlatLayout``:
ferro-checkpoint's split, padded to equal blocks). Inside the jitted step:

    grads, flattened and padded  -> ferro_jax.reduce_scatter(.., "mean")  (this rank's block
                                    of the mean gradient)
    optax.adam's update on the block (the rank's slice of the parameters, mu and nu)
    the updated block            -> ferro_jax.all_gather  -> unflattened: the new parameters

Adam is element-wise, so each element sees the same arithmetic as in the data-parallel example
(whose allreduce folds the ranks' gradients in the same order as the reduce_scatter): the
parameters come out bit-identical to its (measured; ``--params-out`` of both). The optimizer
state per rank is 1/world of the data-parallel one; the traffic is the same (a reduce_scatter
and an all_gather move what an allreduce moves).

    ferrorun --nproc 2 examples/jax_zero.py --steps 300 --out zero_curve.csv
    ferrorun --nproc 2 examples/jax_zero.py --steps 200 --checkpoint ckpt --save-every 50
    ferrorun --nproc 4 examples/jax_zero.py --steps 300 --checkpoint ckpt --resume

Checkpoints hold each rank's slice of params, adam_mu and adam_nu: the sharded state is saved as
the shards it is, and restored on any world size (ferro-checkpoint reshards each slice to the
new world's layout; one all_gather rebuilds the parameters). They are the same checkpoints as
jax_data_parallel.py's: either example resumes the other's.
"""

from __future__ import annotations

import ferro_jax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from jax_data_parallel import (
    Checkpoints,
    FlatLayout,
    adam_state,
    finish,
    init_params,
    loss_fn,
    make_data,
    model_of,
    parse_args,
    sha256,
    start_run,
    train,
)


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], sync_flag=False)
    backend = ferro_jax.init()
    rank, world = backend.rank, backend.world_size
    params = init_params(jax.random.PRNGKey(0), [args.features, args.hidden, args.hidden, 1])
    flat, unravel = ravel_pytree(params)
    layout = FlatLayout(flat.size, world)
    opt = optax.adam(args.lr)
    state = opt.init(jnp.zeros(layout.block, flat.dtype))  # this rank's block only
    ckpt = (Checkpoints(args.checkpoint, backend, layout, model_of(args)) if args.checkpoint
            else None)
    start, losses, restored = start_run(args, rank, unravel, layout, ckpt)
    if restored is not None:  # this rank's slices of Adam's moments, resharded: kept as they are
        params, blocks, count = restored
        state = adam_state(state, count, blocks["adam_mu"], blocks["adam_nu"])
    xs, ys = make_data(rank, world, args.batch, args.features, start, args.steps)

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grad = ferro_jax.reduce_scatter(layout.to_blocks(ravel_pytree(grads)[0]), "mean")
        loss = ferro_jax.allreduce(loss, "mean")
        mine = layout.to_blocks(ravel_pytree(params)[0]).reshape(world, layout.block)[rank]
        updates, state = opt.update(grad, state, mine)
        mine = optax.apply_updates(mine, updates)  # padding: zero gradient, zero update
        return unravel(layout.from_blocks(ferro_jax.all_gather(mine))), state, loss

    def save(step_now, params, state, losses):
        if ckpt is None or (step_now % args.save_every and step_now != args.steps):
            return
        flat = np.asarray(ravel_pytree(params)[0])
        size = layout.sizes[rank]  # the state is sharded: each rank writes its own block
        ckpt.save(step_now, {"params": flat[layout.rows(rank)],
                             "adam_mu": np.asarray(state[0].mu)[:size],
                             "adam_nu": np.asarray(state[0].nu)[:size]},
                  int(state[0].count), losses, sha256(flat))

    params, state, times = train(step, params, state, xs, ys, start, args.steps, losses, save)
    finish(args, rank, world, params, losses, times, start, True,
           "JAX ZeRO-style (Adam's state sharded) over ferro_jax")


if __name__ == "__main__":
    main()
