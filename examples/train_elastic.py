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

``--strategy full_shard`` (or ``shard_grad_op``) with ``--checkpoint-dir`` trains FSDP: a lost
rank's shard lives only with it, so every member rebuilds its wrapper for the new world and
loads the newest committed checkpoint (resharded), in the same process; a newcomer is taken in
after a save at the agreed boundary, so it costs no step.

Without ``FERRO_ELASTIC`` (plain ``ferrorun --nproc N``) the same script trains on a fixed world:
``--load-state`` / ``--save-state`` (DDP) or ``--resume`` (FSDP) carry the state between such
runs (the tests build the reference run of an elastic one this way).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
from train_mlp import (
    StepFile,
    build_model,
    load_data,
    newest_step,
    resume,
    unreadable,
    unusable_directory,
    unwritable,
)
from train_mlp import parse_args as mlp_args

from ferro_backend import elastic, init_from_env, settings
from ferro_checkpoint import CheckpointManager, ShardMetadata, TensorShardSpec
from ferro_collective import ReduceOp, allreduce
from ferro_collective.elastic import RECOVERABLE, ElasticState
from ferro_fsdp import DDP, FSDP, nn, optim


def member_at_step(text: str) -> tuple[int, int]:
    """``--kill MEMBER@STEP``: two whole numbers >= 0 (an argparse type)."""
    member, at, step = text.partition("@")
    if not (at and member.strip().isdigit() and step.strip().isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not MEMBER@STEP (two whole numbers >= 0, "
                                         "e.g. 1@40)")
    return int(member), int(step)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120, help="total steps")
    p.add_argument("--start", type=int, default=0, help="first step (with --load-state)")
    p.add_argument("--batch-size", type=int, default=96, help="global batch size")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--kill", type=member_at_step, default=None, metavar="MEMBER@STEP",
                   help="fault injection: the process of member MEMBER SIGKILLs itself after "
                        "completing step STEP (first membership only)")
    p.add_argument("--step-file", type=Path, default=None, metavar="DIR",
                   help="write each completed step to DIR/<pid> (for tools/soak.py)")
    p.add_argument("--history", type=Path, default=None, help="write losses and changes (JSON)")
    p.add_argument("--plot", type=Path, default=None, help="write the loss curve (PNG)")
    p.add_argument("--save-state", type=Path, default=None, help="rank 0 saves the final state")
    p.add_argument("--load-state", type=Path, default=None, help="start from a saved state")
    p.add_argument("--strategy", choices=["ddp", "full_shard", "shard_grad_op"], default="ddp",
                   help="ddp: survivors continue from memory; a sharded strategy reloads the "
                        "newest checkpoint (a lost rank's shard lives only there)")
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true",
                   help="fixed-size runs: continue from the newest checkpoint")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse numbers no run can use, one line naming the flag (exit 2), before any backend,
    data or model is made."""
    def refuse(message: str) -> None:
        p.exit(2, f"train_elastic: {message}\n")

    for flag, low in (("--batch-size", 1), ("--steps", 0), ("--start", 0),
                      ("--checkpoint-every", 0)):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < low:
            refuse(f"{flag} must be >= {low} (got {value})")
    if args.resume and args.checkpoint_dir is None:
        refuse("--resume needs --checkpoint-dir")
    for flag, why in (("--history", unwritable(args.history)),
                      ("--plot", unwritable(args.plot)),
                      ("--save-state", unwritable(args.save_state)),
                      ("--load-state", unreadable(args.load_state)),
                      ("--step-file", unusable_directory(args.step_file))):
        if why:
            refuse(f"{flag}: {why}")
    if args.checkpoint_dir is not None and args.checkpoint_dir.exists() and \
            not args.checkpoint_dir.is_dir():
        refuse(f"--checkpoint-dir: {args.checkpoint_dir} is not a directory")


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


class Trainer:
    """The model, its wrapper and optimizer for one backend. DDP keeps them across generations
    (rebound to the new backend, the state copied from the most advanced member); a sharded
    strategy builds them again and loads the newest committed checkpoint, resharded."""

    def __init__(self, args, mlp, features: int, classes: int) -> None:
        self.args, self.mlp, self.shape = args, mlp, (features, classes)
        self.model = build_model(mlp, features, classes)
        self.opt = optim.Adam(self.model.parameters(), lr=args.lr)
        self.manager = self.wrapper = None

    @property
    def sharded(self) -> bool:
        return self.args.strategy != "ddp"

    def wrap(self, backend) -> None:
        if self.sharded:
            self.model = build_model(self.mlp, *self.shape)   # fresh: FSDP shards it
            self.wrapper = FSDP(self.model, backend, self.args.strategy, sync_module_states=True)
            self.opt = optim.Adam(self.wrapper.module.parameters(), lr=self.args.lr)
        else:   # the model and optimizer stay (their state is what the members copy)
            self.wrapper = DDP(self.model, backend, broadcast_parameters=False)
        self.bind_manager(backend)

    def bind_manager(self, backend) -> None:
        if self.args.checkpoint_dir is not None:
            self.manager = CheckpointManager(self.args.checkpoint_dir, backend.rank,
                                             backend.world_size, backend=backend)

    def rebind(self, backend, fallback: int) -> int:
        """Continue on ``backend``; the step to continue from (``fallback`` for DDP)."""
        if not self.sharded:
            self.wrapper.rebind(backend)
            self.bind_manager(backend)   # the checkpoints' ranks are the new generation's
            return fallback
        self.wrap(backend)
        return self.resume(backend)

    def resume(self, backend) -> int:
        """Load the newest committed checkpoint (as rank 0 sees it); its step, 0 if none."""
        step = newest_step(self.manager, backend) if self.manager is not None else None
        return 0 if step is None else resume(self.manager, step, self.wrapper, self.opt)

    def save(self, step: int, backend) -> None:
        tensors, specs = self.wrapper.sharded_state_dict(self.opt)
        meta = ShardMetadata(backend.world_size, {k: TensorShardSpec(*v)
                                                  for k, v in specs.items()})
        self.manager.save(step, tensors, meta, extra={"step": step}, blocking=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.strategy != "ddp" and args.checkpoint_dir is None:
        raise SystemExit(f"train_elastic: --strategy {args.strategy} needs --checkpoint-dir "
                         "(a lost rank's shard comes back from the last checkpoint)")
    mlp = mlp_args(["--dtype", args.dtype, "--seed", str(args.seed)])
    x_tr, y_tr, _, _, classes = load_data(mlp, prog="train_elastic")
    loss_fn = nn.CrossEntropyLoss()
    if settings.ELASTIC.get():
        try:
            job = elastic.join()
        except elastic.JobFinishedError as exc:  # a replacement that came too late
            print(exc, flush=True)
            return 0
        backend = job.backend
    else:
        job, backend = None, init_from_env()
    t = Trainer(args, mlp, x_tr.shape[1], classes)
    if args.load_state is not None:
        with np.load(args.load_state, allow_pickle=True) as saved:
            restore(t.model, t.opt, saved["state"].item())
    state = None
    if job is not None:
        sharded = t.sharded
        state = ElasticState(
            job, lambda: {} if sharded else capture(t.model, t.opt),
            lambda s: None if sharded else restore(t.model, t.opt, s), step=args.start,
            # a sharded job saves before taking a newcomer in: no step is lost
            before_join=(lambda b: t.save(state.step, b)) if sharded else None)
        state.sync()   # a fresh job: rank 0's state; a replacement: its peers'
        backend = job.backend  # (a new one if a member was lost during the sync)
    t.wrap(backend)    # after the sync: the members of a new generation wrap in this order
    if state is not None and t.sharded and job.history[-1]["reason"] != "start":
        state.step = t.resume(backend)   # a replacement: the checkpoint the others load
    step = state.step if state is not None else args.start
    if args.resume:
        step = t.resume(backend)
    kill = args.kill
    steps_per_epoch = len(x_tr) // args.batch_size
    if not steps_per_epoch:
        raise SystemExit(f"train_elastic: --batch-size {args.batch_size} is more than the "
                         f"{len(x_tr)} training samples")
    history = {"losses": [], "changes": []}
    step_file = StepFile(args.step_file)
    while step < args.steps:
        rank, world = backend.rank, backend.world_size
        epoch, k = divmod(step, steps_per_epoch)
        order = np.random.default_rng(args.seed * 1000 + epoch).permutation(len(x_tr))
        batch = order[k * args.batch_size:(k + 1) * args.batch_size]
        lo, hi = rank * len(batch) // world, (rank + 1) * len(batch) // world
        try:
            loss = loss_fn(t.wrapper(x_tr[batch[lo:hi]]), y_tr[batch[lo:hi]])
            # the wrappers average over ranks: weight this rank's mean by its share
            grad = loss_fn.backward()
            share = (hi - lo) * world / len(batch)
            t.wrapper.backward(grad if share == 1.0 else grad * grad.dtype.type(share))
            if t.sharded:
                t.wrapper.sync_gradients()
            # every collective of the step comes before the optimizer step: a failure leaves
            # this rank's state at the step it has committed (DDP continues from it)
            global_loss = float(allreduce(np.array([loss * share]), backend, ReduceOp.MEAN)[0])
            t.opt.step()
            t.opt.zero_grad()
            if t.sharded:
                t.wrapper.broadcast_updated_params()
            if kill is not None and job is not None and job.generation == 0 and \
                    job.member_id == kill[0] and step + 1 == kill[1]:
                os.kill(os.getpid(), signal.SIGKILL)   # fault injection (--kill)
            changed = state.commit(step + 1) if state is not None else False
            step += 1
            step_file(step)
            history["losses"].append((step, global_loss))
            if not changed and t.manager is not None and args.checkpoint_every and \
                    step % args.checkpoint_every == 0:
                t.save(step, backend)
        except RECOVERABLE as exc:
            if state is None:
                raise
            state.recover(exc)
            step, changed = state.step, True
        if changed:
            backend = job.backend
            step = state.step = t.rebind(backend, state.step)
            change = dict(state.changes[-1], step=step)
            history["changes"].append(change)
            if backend.rank == 0:
                print(f"membership change at step {change['step']}: {change['world_size']} "
                      f"ranks, generation {change['generation']} ({change['reason']}; "
                      f"{change['seconds'] * 1e3:.0f} ms)", flush=True)
    if t.manager is not None and step not in (t.manager.latest_step(), None):
        t.save(step, backend)   # where a following run (--resume) continues
    if backend.rank == 0:
        last = history["losses"][-1][1] if history["losses"] else float("nan")
        print(f"done: {step} steps on {backend.world_size} ranks, loss {last:.4f}", flush=True)
        if args.history is not None:
            args.history.write_text(json.dumps(history))
        if args.plot is not None:
            plot(history, args.plot)
    if args.save_state is not None:
        full = t.wrapper.full_state_dict() if t.sharded else None   # collective
        if backend.rank == 0:
            params = [full[n] for n in sorted(full)] if t.sharded else None
            np.savez(args.save_state, state=np.array(
                {"params": params, "optim": {"state": {}}} if t.sharded
                else capture(t.model, t.opt), dtype=object))
    if job is not None:
        job.close()
    else:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
