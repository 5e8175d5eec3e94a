"""Elastic data parallel training: lose a rank, go on without restarting anyone, take a
replacement in.

    ferrorun --nproc 2:3 --max-restarts 1 examples/train_elastic.py --steps 120
    ferrorun --nproc 2:3 examples/train_elastic.py --steps 120 --kill 1@40   # inject a failure

Under ``ferrorun --nproc MIN:MAX`` every rank joins the job's membership
(``ferro_backend.elastic.join``); the model (train_mlp's digits MLP, DDP, Adam) and the
optimizer state are the state every member holds (``ferro_collective.elastic.ElasticState``).
When a rank dies, the survivors' collectives fail, they agree on the new membership and go on
from the last step they completed, from memory; the replacement ferrorun starts for it
(``--max-restarts``) is taken in at a step boundary and receives the state from its peers. Each
global batch is split over the ranks there are (uneven splits are weighted exactly), so the
run equals one that had the same ranks at the same steps. Rank 0 prints each membership change
and writes the loss curve, with a vertical line at each change (``--plot``), and the history
as JSON (``--history``).

Without ``FERRO_ELASTIC`` (plain ``ferrorun --nproc N``) the same script trains on a fixed world:
``--load-state`` / ``--save-state`` carry the state between such runs (the tests build the
reference run of an elastic one this way).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
from train_mlp import build_model, load_data
from train_mlp import parse_args as mlp_args

from ferro_backend import elastic, init_from_env
from ferro_collective import ReduceOp, allreduce
from ferro_collective.elastic import RECOVERABLE, ElasticState
from ferro_fsdp import DDP, nn, optim


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120, help="total steps")
    p.add_argument("--start", type=int, default=0, help="first step (with --load-state)")
    p.add_argument("--batch-size", type=int, default=96, help="global batch size")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--kill", default=None, metavar="MEMBER@STEP",
                   help="fault injection: the process of member MEMBER SIGKILLs itself after "
                        "completing step STEP (first membership only)")
    p.add_argument("--history", type=Path, default=None, help="write losses and changes (JSON)")
    p.add_argument("--plot", type=Path, default=None, help="write the loss curve (PNG)")
    p.add_argument("--save-state", type=Path, default=None, help="rank 0 saves the final state")
    p.add_argument("--load-state", type=Path, default=None, help="start from a saved state")
    return p.parse_args(argv)


def capture(model, opt) -> dict:
    return {"params": [p.data for p in model.parameters()], "optim": opt.state_dict()}


def restore(model, opt, state: dict) -> None:
    for p, value in zip(model.parameters(), state["params"]):
        p.data[...] = value
    opt.load_state_dict(state["optim"])


def plot(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps, losses = zip(*history["losses"]) if history["losses"] else ((), ())
    ax.plot(steps, losses, label="training loss (global batch)")
    for c in history["changes"]:
        ax.axvline(c["step"], color="tab:red", linestyle="--", linewidth=1)
        ax.annotate(f"{c['world_size']} ranks", (c["step"], max(losses or [1])), rotation=90,
                    fontsize=8, va="top")
    ax.set_title(f"train_elastic: {len(history['changes'])} membership change(s)")
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    mlp = mlp_args(["--dtype", args.dtype, "--seed", str(args.seed)])
    x_tr, y_tr, _, _, classes = load_data(mlp)
    model = build_model(mlp, x_tr.shape[1], classes)
    opt = optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    if args.load_state is not None:
        with np.load(args.load_state, allow_pickle=True) as saved:
            restore(model, opt, saved["state"].item())
    if os.environ.get("FERRO_ELASTIC"):
        try:
            job = elastic.join()
        except elastic.JobFinishedError as exc:  # a replacement that came too late
            print(exc, flush=True)
            return 0
        state = ElasticState(job, lambda: capture(model, opt), lambda s: restore(model, opt, s),
                             step=args.start)
        state.sync()   # a fresh job: rank 0's state; a replacement: its peers'
    else:
        job, state = None, None
    backend = job.backend if job is not None else init_from_env()
    wrapper = DDP(model, backend, broadcast_parameters=False)
    kill = tuple(int(v) for v in args.kill.split("@")) if args.kill else None
    steps_per_epoch = len(x_tr) // args.batch_size
    history = {"losses": [], "changes": []}
    step = state.step if state is not None else args.start
    while step < args.steps:
        rank, world = backend.rank, backend.world_size
        epoch, k = divmod(step, steps_per_epoch)
        order = np.random.default_rng(args.seed * 1000 + epoch).permutation(len(x_tr))
        batch = order[k * args.batch_size:(k + 1) * args.batch_size]
        lo, hi = rank * len(batch) // world, (rank + 1) * len(batch) // world
        try:
            loss = loss_fn(wrapper(x_tr[batch[lo:hi]]), y_tr[batch[lo:hi]])
            # DDP averages over ranks: weight this rank's mean by its share of the batch
            grad = loss_fn.backward()
            share = (hi - lo) * world / len(batch)
            wrapper.backward(grad if share == 1.0 else grad * grad.dtype.type(share))
            # every collective of the step comes before the optimizer step: a failure leaves
            # this rank's state at the step it has committed
            global_loss = float(allreduce(np.array([loss * share]), backend, ReduceOp.MEAN)[0])
            opt.step()
            opt.zero_grad()
            if kill is not None and job is not None and job.generation == 0 and \
                    job.member_id == kill[0] and step + 1 == kill[1]:
                os.kill(os.getpid(), signal.SIGKILL)   # fault injection (--kill)
            changed = state.commit(step + 1) if state is not None else False
            step += 1
            history["losses"].append((step, global_loss))
        except RECOVERABLE as exc:
            if state is None:
                raise
            state.recover(exc)
            step, changed = state.step, True
        if changed:
            backend = job.backend
            wrapper.rebind(backend)
            change = dict(state.changes[-1])
            history["changes"].append(change)
            if backend.rank == 0:
                print(f"membership change at step {change['step']}: {change['world_size']} "
                      f"ranks, generation {change['generation']} ({change['reason']}; "
                      f"{change['seconds'] * 1e3:.0f} ms)", flush=True)
    if backend.rank == 0:
        last = history["losses"][-1][1] if history["losses"] else float("nan")
        print(f"done: {step} steps on {backend.world_size} ranks, loss {last:.4f}", flush=True)
        if args.history is not None:
            args.history.write_text(json.dumps(history))
        if args.plot is not None:
            plot(history, args.plot)
        if args.save_state is not None:
            np.savez(args.save_state, state=np.array(capture(model, opt), dtype=object))
    if job is not None:
        job.close()
    else:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
