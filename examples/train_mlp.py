"""Train an MLP classifier with ferro-fsdp: checkpoint, stop, resume on another number of ranks.

    ferrorun --nproc 4 examples/train_mlp.py --epochs 8 --checkpoint-dir ckpt
    ferrorun --nproc 2 examples/train_mlp.py --epochs 20 --checkpoint-dir ckpt --resume

Data: the handwritten digits scikit-learn ships offline (``load_digits``, 1797 8x8 images, 10
classes; 80/20 train/held-out split; read from scikit-learn's file without importing it), or
``--dataset synthetic --params N`` for a model of about N parameters on generated data. Every rank
trains on its own slice of each global batch (the batch size must be divisible by the number of
ranks), so a run gives the same parameters whatever the number of ranks, up to floating-point
summation order (exactly, in float64, for the tests). Checkpoints are sharded state dicts saved
asynchronously with the data position; ``--resume`` loads the newest committed step (a
ferro-checkpoint ``CheckpointManager`` keeps ``step_<n>/`` directories, the last three) on any
number of ranks (resharding) and continues: same data order, same loss curve. Under ``ferrorun
--max-restarts N`` a restarted job resumes by itself (``FERRO_RESTART_COUNT`` > 0), so a run
killed at any step ends with the same parameters, bit for bit, as one that never failed
(``--fail-at-step`` injects such a failure). Rank 0 shows a progress bar, prints held-out accuracy
each epoch and a summary at the end, and writes the loss curve of every run in the checkpoint
directory to ``loss_curve.png``. With ``--strategy ddp``, ``--comm-hook fp16|bf16|powersgd``
averages the gradients compressed (ferro_fsdp.comm_hooks); PowerSGD's state (error feedback,
warm-start Qs) goes into the checkpoints with the model, so a resumed run continues exactly.

Beyond the ferro packages it needs scikit-learn (``--dataset digits``), tqdm (the progress bar)
and matplotlib (the plot): ``pip install -r examples/requirements.txt``. Each is imported only
where it is used, so ``--help`` and ``--dataset synthetic --no-progress`` work without them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import signal
import sys
import time
from pathlib import Path

import numpy as np

from ferro_backend import SettingError, init_from_env, settings
from ferro_checkpoint import CheckpointManager, ShardMetadata, TensorShardSpec
from ferro_collective import ReduceOp, all_gather, allreduce, broadcast
from ferro_fsdp import DDP, FSDP, comm_hooks, nn, optim

STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "ddp"]
COMM_HOOKS = ["allreduce", "fp16", "bf16", "powersgd"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", choices=["digits", "synthetic"], default="digits")
    p.add_argument("--params", type=int, default=1_000_000,
                   help="synthetic: approximate number of model parameters")
    p.add_argument("--samples", type=int, default=4096, help="synthetic: number of samples")
    p.add_argument("--strategy", choices=STRATEGIES, default="full_shard")
    p.add_argument("--intra-node-size", type=int, default=None,
                   help="hybrid_shard: ranks per node (default: half the ranks, at least 1)")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--lr", type=float, default=None, help="default 2e-3 (adam), 0.05 (sgd)")
    p.add_argument("--epochs", type=int, default=20, help="total epochs (a resume continues)")
    p.add_argument("--steps", type=int, default=None, help="total steps (overrides --epochs)")
    p.add_argument("--batch-size", type=int, default=96, help="global batch size")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--comm-hook", choices=COMM_HOOKS, default="allreduce",
                   help="DDP: how each gradient bucket is averaged (ferro_fsdp.comm_hooks; "
                        "fp16/bf16 travel compressed, powersgd low rank with error feedback, "
                        "its state saved with the checkpoints)")
    p.add_argument("--powersgd-rank", type=int, default=1)
    p.add_argument("--powersgd-start", type=int, default=10,
                   help="steps averaged exactly before PowerSGD starts")
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="steps between checkpoints (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    p.add_argument("--min-accuracy", type=float, default=None,
                   help="exit with status 3 if the final held-out accuracy is lower")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true",
                   help="no loss_curve.png (matplotlib costs rank 0 about 2 s a run)")
    p.add_argument("--dump-params", type=Path, default=None,
                   help="write the final full parameters (rank 0) to this .npz")
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="fault injection, to test restarts: on the first attempt "
                        "(FERRO_RESTART_COUNT=0) rank --fail-rank SIGKILLs itself after this step")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--step-file", type=Path, default=None, metavar="DIR",
                   help="write each completed step to DIR/<pid> (tools/soak.py ties its faults "
                        "to the job's progress through it)")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def unwritable(path: Path | None) -> str | None:
    """Why the output file ``path`` could not be written at the end of the run, or None: a
    flag's bad path is told before training, not after it."""
    if path is None:
        return None
    if path.is_dir():
        return f"{path} is a directory"
    if not path.parent.is_dir():
        return f"no directory {path.parent}"
    if not os.access(path.parent, os.W_OK):
        return f"{path.parent} is not writable"
    return None


def unusable_directory(path: Path | None) -> str | None:
    """Why files could not be written in the existing directory ``path`` (``--step-file``),
    or None."""
    if path is None:
        return None
    if not path.is_dir():
        return f"{path} is not a directory" if path.exists() else f"no directory {path}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable"
    return None


def unreadable(path: Path | None) -> str | None:
    """Why the input file ``path`` could not be read, or None."""
    if path is None:
        return None
    if not path.exists():
        return f"no file {path}"
    if path.is_dir():
        return f"{path} is a directory"
    if not os.access(path, os.R_OK):
        return f"{path} is not readable"
    return None


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse numbers no run can use, one line naming the flag (exit 2), before any backend,
    data or model is made."""
    def refuse(message: str) -> None:
        p.exit(2, f"train_mlp: {message}\n")

    for flag, low in (("--batch-size", 1), ("--hidden", 1), ("--params", 1), ("--samples", 2),
                      ("--epochs", 0), ("--steps", 0), ("--checkpoint-every", 0),
                      ("--powersgd-rank", 1), ("--powersgd-start", 0), ("--intra-node-size", 1),
                      ("--fail-at-step", 1), ("--fail-rank", 0)):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < low:
            refuse(f"{flag} must be >= {low} (got {value})")
    if args.lr is not None and not (args.lr >= 0 and math.isfinite(args.lr)):
        refuse(f"--lr must be a finite number >= 0 (got {args.lr})")
    if args.min_accuracy is not None and math.isnan(args.min_accuracy):
        refuse("--min-accuracy must be a number (got nan)")
    if args.checkpoint_dir is not None and args.checkpoint_dir.exists() and \
            not args.checkpoint_dir.is_dir():
        refuse(f"--checkpoint-dir: {args.checkpoint_dir} is not a directory")
    why = unusable_directory(args.step_file)
    if why:
        refuse(f"--step-file: {why}")
    train = int(args.samples * 0.8)  # load_data holds out the other fifth
    if args.dataset == "synthetic" and train < args.batch_size:
        refuse(f"--samples {args.samples} leaves {train} training samples, fewer than one "
               f"--batch-size {args.batch_size}")
    why = unwritable(args.dump_params)
    if why:
        refuse(f"--dump-params: {why}")


# ------------------------------------------------------------------------------ data
class StepFile:
    """``--step-file DIR``: this process's last completed step in DIR/<pid>, rewritten in place
    (a fixed width: a reader sees a whole number) after every step."""

    def __init__(self, directory: Path | None) -> None:
        self.fd = None if directory is None else os.open(
            directory / str(os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def __call__(self, step: int) -> None:
        if self.fd is not None:
            os.pwrite(self.fd, b"%012d" % step, 0)


def load_data(args, prog: str = "train_mlp"
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """The train and held-out arrays and the number of classes; ``prog``: the script whose
    message a missing scikit-learn ends with (train_elastic has no ``--dataset``)."""
    dtype = np.dtype(args.dtype)
    if args.dataset == "digits":
        x, y = load_digits(prog)
        x = x / 16.0
        classes = 10
    else:
        rng = np.random.default_rng(args.seed + 1)
        features, classes = 256, 10
        x = rng.standard_normal((args.samples, features))
        w = rng.standard_normal((features, classes))
        y = np.argmax(x @ w + 0.5 * rng.standard_normal((args.samples, classes)), axis=1)
    order = np.random.default_rng(args.seed).permutation(len(x))
    cut = int(len(x) * 0.8)
    tr, te = order[:cut], order[cut:]
    mean, std = x[tr].mean(0), x[tr].std(0) + 1e-6
    x = (x - mean) / std
    return x[tr].astype(dtype), y[tr], x[te].astype(dtype), y[te], classes


def load_digits(prog: str = "train_mlp") -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (``load_digits(return_X_y=True)``: float64 pixels, int64 labels),
    read from the file scikit-learn ships without importing it: importing scikit-learn costs
    every rank about 3 s here, a run of a few steps 1 s. Falls back to ``load_digits`` where
    the file is not where this scikit-learn keeps it."""
    try:
        spec = importlib.util.find_spec("sklearn")
    except ImportError:
        spec = None
    if spec is None or spec.origin is None:
        # (only train_mlp has another data set to offer)
        raise SystemExit(
            f"{prog}: " + ("--dataset digits needs" if prog == "train_mlp" else
                           "the digits data set it trains on needs")
            + " scikit-learn: pip install scikit-learn (or pip install -r "
            "examples/requirements.txt)" + (", or use --dataset synthetic"
                                           if prog == "train_mlp" else ""))
    data = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if data.is_file():
        table = np.loadtxt(data, delimiter=",")
        return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sklearn_digits

    return sklearn_digits(return_X_y=True)


def build_model(args, features: int, classes: int) -> nn.Sequential:
    hidden = args.hidden
    if args.dataset == "synthetic":
        # two hidden layers of width h: params ~ features*h + h*h + h*classes
        a, b = 1.0, features + classes
        hidden = max(8, int((-b + math.sqrt(b * b + 4 * a * args.params)) / (2 * a)))
        return nn.Sequential(
            nn.Linear(features, hidden, dtype=args.dtype, rng=args.seed),
            nn.ReLU(),
            nn.Linear(hidden, hidden, dtype=args.dtype, rng=args.seed + 1),
            nn.ReLU(),
            nn.Linear(hidden, classes, dtype=args.dtype, rng=args.seed + 2))
    return nn.Sequential(nn.Linear(features, hidden, dtype=args.dtype, rng=args.seed), nn.ReLU(),
                         nn.Linear(hidden, classes, dtype=args.dtype, rng=args.seed + 1))


# ------------------------------------------------------------------------------ checkpoints
def newest_step(manager: CheckpointManager, backend) -> int | None:
    """The newest committed step as rank 0 sees it, on every rank (one decision for all)."""
    mine = manager.latest_step()
    step = int(broadcast(np.array([-1 if mine is None else mine], np.int64), backend, 0)[0])
    return None if step < 0 else step


def resume(manager: CheckpointManager, step: int, wrapper, opt, powersgd=None) -> int:
    """Load committed step ``step`` (resharded to this world size); its step number. With
    ``powersgd`` (a PowerSGDState), its state too (its error feedback is per rank: kept on the
    same world size, started afresh on another)."""
    tensors, extra = manager.restore(step)
    if powersgd is not None and not powersgd.load_sharded_state_dict(tensors) and \
            manager.rank == 0:
        print(f"PowerSGD: the checkpoint was saved by {extra['world_size']} ranks: its error "
              "feedback and Qs start afresh on this world size", flush=True)
    try:
        wrapper.load_sharded_state_dict(tensors, opt)
    except ValueError as exc:  # (on every rank) a checkpoint of another model, say --hidden
        raise SystemExit(f"resume: the checkpoint of step {step} does not fit this model: "
                         f"{exc}") from None
    return int(extra["step"])


def comm_hook(args, wrapper, backend):
    """``--comm-hook``'s hook registered on the DDP wrapper; the PowerSGD state (or None)."""
    if args.comm_hook == "allreduce":
        return None
    if args.strategy != "ddp":
        raise SystemExit(f"train_mlp: --comm-hook {args.comm_hook} needs --strategy ddp")
    if args.comm_hook != "powersgd":
        hook = {"fp16": comm_hooks.fp16_compress_hook, "bf16": comm_hooks.bf16_compress_hook}
        wrapper.register_comm_hook(backend, hook[args.comm_hook])
        return None
    state = comm_hooks.PowerSGDState(backend, matrix_approximation_rank=args.powersgd_rank,
                                     start_powerSGD_iter=args.powersgd_start)
    wrapper.register_comm_hook(state, comm_hooks.powerSGD_hook)
    return state


def history_path(args) -> Path:
    return args.checkpoint_dir / "loss_history.json"


def run_start(run: dict) -> int:
    """The step a run started from (0 for a fresh run, the checkpoint's step for a resume)."""
    if "start_step" in run:
        return int(run["start_step"])
    return int(run["losses"][0][0]) - 1 if run["losses"] else 0


def plot_losses(history: list[dict], path: Path) -> None:
    """The loss curve of every run, with a dashed vertical line where each resumed run starts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in history:
        steps = [s for s, _ in run["losses"]]
        (line,) = ax.plot(steps, [v for _, v in run["losses"]],
                          label=f"run {run['run']}: {run['world_size']} ranks, {run['strategy']}")
        start = run_start(run)
        if run["run"] > 1 or start > 0:  # a resume (or a restart) continues from a checkpoint
            ax.axvline(start, color=line.get_color(), linestyle="--", linewidth=1,
                       label=f"run {run['run']} resumes at step {start}")
    resumes = len(history) - 1
    ax.set_title(f"train_mlp: training loss of {len(history)} run{'s' * (len(history) != 1)}"
                 + (f" ({resumes} resume{'s' * (resumes != 1)}, dashed)" if resumes else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------ training
def main(argv=None) -> int:
    args = parse_args(argv)
    backend = init_from_env()
    rank, world = backend.rank, backend.world_size
    if args.batch_size % world:
        raise SystemExit(f"train_mlp: --batch-size {args.batch_size} is not divisible by "
                         f"{world} ranks")
    if args.resume and args.checkpoint_dir is None:
        raise SystemExit("train_mlp: --resume needs --checkpoint-dir")
    # under `ferrorun --max-restarts`, a restarted job resumes by itself from its newest
    # committed checkpoint (or starts over if it failed before the first one)
    try:
        restart = settings.RESTART_COUNT.get()
    except SettingError as exc:
        raise SystemExit(f"train_mlp: {exc}") from None
    if args.resume and not restart and not args.checkpoint_dir.is_dir():
        raise SystemExit(f"train_mlp: --resume: no checkpoint directory {args.checkpoint_dir}; "
                         "check the path")
    x_tr, y_tr, x_te, y_te, classes = load_data(args)
    model = build_model(args, x_tr.shape[1], classes)
    n_params = sum(p.data.size for p in model.parameters())
    if args.strategy == "ddp":
        wrapper = DDP(model, backend)
    else:
        intra = None
        if args.strategy == "hybrid_shard":
            intra, said = ((args.intra_node_size, "--intra-node-size")
                           if args.intra_node_size is not None else
                           (max(1, world // 2), "half the ranks (give --intra-node-size)"))
            if world % intra:
                raise SystemExit(f"train_mlp: {intra} ranks per node ({said}) do not divide the "
                                 f"{world} ranks")
        wrapper = FSDP(model, backend, args.strategy, intra_node_size=intra,
                       sync_module_states=True)
    powersgd = comm_hook(args, wrapper, backend)
    lr = args.lr if args.lr is not None else (2e-3 if args.optimizer == "adam" else 0.05)
    params = wrapper.module.parameters()
    opt = optim.Adam(params, lr=lr) if args.optimizer == "adam" else \
        optim.SGD(params, lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    steps_per_epoch = len(x_tr) // args.batch_size
    if not steps_per_epoch:
        raise SystemExit(f"train_mlp: --batch-size {args.batch_size} is more than the "
                         f"{len(x_tr)} training samples of --dataset {args.dataset}")
    total = args.steps if args.steps is not None else args.epochs * steps_per_epoch
    step = 0
    manager = None
    if args.checkpoint_dir is not None:
        manager = CheckpointManager(args.checkpoint_dir, rank, world, keep_last=3,
                                    backend=backend)
    resuming = (args.resume or restart > 0) and manager is not None
    found = newest_step(manager, backend) if resuming else None
    if found is not None:
        step = resume(manager, found, wrapper, opt, powersgd)
        if rank == 0:
            print(f"resumed from step {step} of {args.checkpoint_dir} on {world} ranks "
                  f"({args.strategy}, restart {restart})", flush=True)
    elif args.resume and not restart:
        raise SystemExit(f"train_mlp: --resume: no committed checkpoint in "
                         f"{args.checkpoint_dir}; check the path")
    history: list[dict] = []
    if args.checkpoint_dir is not None:
        if rank == 0:
            args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            if resuming and history_path(args).exists():
                history = json.loads(history_path(args).read_text())
        backend.barrier()
    run = {"run": len(history) + 1, "world_size": world, "strategy": args.strategy,
           "start_step": step, "losses": []}
    history.append(run)
    per_rank = args.batch_size // world

    held_out_loss = float("nan")

    def evaluate() -> float:
        """The held-out accuracy (each rank scores its share of the held-out set); the mean
        held-out cross-entropy goes to ``held_out_loss``."""
        nonlocal held_out_loss
        wrapper.eval()
        lo = rank * len(x_te) // world
        hi = (rank + 1) * len(x_te) // world
        out = wrapper(x_te[lo:hi])
        correct = int((np.argmax(out, axis=1) == y_te[lo:hi]).sum())
        total_loss = float(nn.CrossEntropyLoss()(out, y_te[lo:hi])) * (hi - lo) if hi > lo else 0.0
        wrapper.train()
        sums = allreduce(np.array([correct, total_loss], np.float64), backend)
        held_out_loss = float(sums[1]) / len(x_te)
        return float(sums[0]) / len(x_te)

    saved: list = [None, None]  # the last step saved and its future: the same on every rank

    def save(step_now: int, blocking: bool = False) -> None:
        """Step ``step_now`` in ``root/step_<n>/`` (asynchronous unless ``blocking``): the
        shards, the optimizer state, and where the data order stands (the order of an epoch
        is a function of the seed, so the step is the whole data position)."""
        tensors, specs = wrapper.sharded_state_dict(opt)
        if powersgd is not None:  # (its error feedback: each rank its own row)
            rows, row_specs = powersgd.sharded_state_dict()
            tensors, specs = {**tensors, **rows}, {**specs, **row_specs}
        meta = ShardMetadata(world, {k: TensorShardSpec(*v) for k, v in specs.items()})
        epoch, k = divmod(step_now, steps_per_epoch)
        extra = {"step": step_now, "epoch": epoch, "batch_in_epoch": k, "seed": args.seed,
                 "world_size": world, "strategy": args.strategy}
        saved[:] = [step_now, manager.save(step_now, tensors, meta, extra=extra,
                                           blocking=blocking)]
        if blocking:
            saved[1].wait()

    progress = None
    if rank == 0 and not args.no_progress:
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
            print("train_mlp: tqdm not installed (pip install tqdm): no progress bar",
                  flush=True)
        if tqdm is not None:
            progress = tqdm(total=total, initial=step, unit="step", file=sys.stdout,
                            dynamic_ncols=True)
    sent0 = getattr(backend, "bytes_sent", 0)
    t0 = time.perf_counter()
    first_step = step
    accuracy = float("nan")
    step_file = StepFile(args.step_file)
    while step < total:
        epoch, k = divmod(step, steps_per_epoch)
        order = np.random.default_rng(args.seed * 1000 + epoch).permutation(len(x_tr))
        idx = order[k * args.batch_size:(k + 1) * args.batch_size][rank * per_rank:
                                                                     (rank + 1) * per_rank]
        out = wrapper(x_tr[idx])
        loss = loss_fn(out, y_tr[idx])
        wrapper.backward(loss_fn.backward())
        if args.strategy != "ddp":
            wrapper.sync_gradients()
        opt.step()
        opt.zero_grad()
        if args.strategy != "ddp":
            wrapper.broadcast_updated_params()
        step += 1
        step_file(step)
        if step == args.fail_at_step and restart == 0 and rank == args.fail_rank:
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection (see --fail-at-step)
        global_loss = float(allreduce(np.array([loss]), backend, ReduceOp.MEAN)[0])
        run["losses"].append((step, global_loss))
        if progress is not None:
            elapsed = time.perf_counter() - t0
            progress.set_postfix(loss=f"{global_loss:.4f}",
                                 samples_per_s=f"{(step - first_step) * args.batch_size / elapsed:.0f}")
            progress.update(1)
        if args.checkpoint_dir is not None and args.checkpoint_every and \
                step % args.checkpoint_every == 0:
            save(step)
        if step % steps_per_epoch == 0 or step == total:
            accuracy = evaluate()
            if rank == 0:
                msg = f"epoch {step // steps_per_epoch} step {step}: loss {global_loss:.4f}, " \
                      f"held-out accuracy {accuracy:.4f}"
                (progress.write(msg) if progress is not None else print(msg, flush=True))
    elapsed = time.perf_counter() - t0
    if progress is not None:
        progress.close()
    if step == first_step:
        accuracy = evaluate()
    if manager is not None:
        # decided from what this rank did (the same on every rank), never from the directory,
        # which other ranks' saves may be changing
        if saved[0] != step:
            save(step, blocking=True)
        else:
            saved[1].wait()
    done = max(step - first_step, 1)
    sent = float(allreduce(np.array([getattr(backend, "bytes_sent", 0) - sent0], np.float64),
                           backend, ReduceOp.MEAN)[0])
    peak = all_gather(np.array([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024],
                               np.int64), backend)
    if args.dump_params is not None:
        full = wrapper.full_state_dict() if isinstance(wrapper, FSDP) else \
            {n: p.data for n, p in wrapper.named_parameters()}
        if rank == 0:
            np.savez(args.dump_params, **full)
    if rank == 0:
        summary = {
            "world_size": world, "strategy": args.strategy, "optimizer": args.optimizer,
            "parameters": int(n_params), "steps": step, "steps_this_run": step - first_step,
            "steps_per_s": (step - first_step) / elapsed if elapsed else 0.0,
            "bytes_sent_per_rank_per_step": sent / done,
            "peak_memory_per_rank_MiB": [round(int(b) / 2**20, 1) for b in peak],
            "final_loss": run["losses"][-1][1] if run["losses"] else None,
            "held_out_accuracy": accuracy,
            "held_out_loss": held_out_loss,
        }
        print("summary: " + json.dumps(summary), flush=True)
        print(f"{summary['steps_this_run']} steps in {elapsed:.1f}s "
              f"({summary['steps_per_s']:.1f} steps/s) on {world} ranks, "
              f"{summary['bytes_sent_per_rank_per_step'] / 1024:.1f} KiB sent per rank per step, "
              f"peak memory per rank {summary['peak_memory_per_rank_MiB']} MiB, "
              f"held-out accuracy {accuracy:.4f}", flush=True)
        if args.checkpoint_dir is not None:
            history_path(args).write_text(json.dumps(history))
            (args.checkpoint_dir / "summary.json").write_text(json.dumps(summary))
        if args.checkpoint_dir is not None and not args.no_plot:
            try:
                plot_losses(history, args.checkpoint_dir / "loss_curve.png")
                print(f"loss curve: {args.checkpoint_dir / 'loss_curve.png'}", flush=True)
            except ImportError:
                print("matplotlib not installed (pip install matplotlib): no loss curve plot",
                      flush=True)
    backend.barrier()
    backend.close()
    if args.min_accuracy is not None and accuracy < args.min_accuracy:
        if rank == 0:
            print(f"held-out accuracy {accuracy:.4f} is below --min-accuracy "
                  f"{args.min_accuracy}", flush=True)
        return 3
    if args.min_accuracy is not None and rank == 0:
        print(f"held-out accuracy {accuracy:.4f} >= --min-accuracy {args.min_accuracy}: met",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
