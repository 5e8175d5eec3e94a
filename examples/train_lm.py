"""Train a character-level GPT-style language model with ferro-fsdp on Python's own source code.

    ferrorun --nproc 2 examples/train_lm.py --steps 300 --checkpoint-dir ckpt-lm
    ferrorun --nproc 1 examples/train_lm.py --steps 600 --checkpoint-dir ckpt-lm --resume
    python examples/train_lm.py --steps 50 --no-progress        # one process, no ferrorun

Data: the standard library's ``.py`` files of the Python that runs the script
(``sysconfig.get_paths()["stdlib"]``, without site-packages), read in sorted order of their
relative paths and concatenated up to ``--corpus-chars`` characters: every installation has them,
and the selection is deterministic. Every ``1 / --val-fraction``-th file is held out. Tokens
are characters of a fixed vocabulary (tab, newline and printable ASCII, plus one "other" token
for anything else), so a checkpoint does not depend on which text was read.

Model: token + position embeddings, ``--layers`` pre-LN ``nn.TransformerBlock`` (causal
self-attention and a 4x GELU MLP), a final LayerNorm and a linear head; the defaults (256 wide, 4
blocks, context 128) give about 3.2 M parameters, and ``--dim/--layers/--heads/--seq`` make it as
small as a test needs. It trains with ``FSDP(..., wrap=nn.TransformerBlock)`` (one unit per
block: each is gathered just before it runs and freed after; the root unit holds the embeddings,
the final LayerNorm and the head), AdamW (the fused compiled step), a linear warm-up and gradient
clipping. Every rank trains on its own slice of each global batch (``--batch-size`` sequences,
divisible by the number of ranks); which windows of the text make batch ``k`` depends only on
``--seed`` and ``k``, so a resumed run sees the same data as one that never stopped.

Checkpoints (``--checkpoint-dir``, every ``--checkpoint-every`` steps and at the end) are sharded
state dicts with the optimizer state, saved asynchronously by a ferro-checkpoint
``CheckpointManager`` (the last three ``step_<n>/``); ``--resume`` loads the newest committed one
on any number of ranks (resharding) and continues. Under ``ferrorun --max-restarts N`` a restarted
job resumes by itself. Rank 0 shows a progress bar (tqdm) with tokens per second, prints the
held-out loss every ``--eval-every`` steps, writes ``loss_curve.png`` (matplotlib) of every run in
the checkpoint directory, and at the end prints ``--sample-chars`` characters generated from
``--prompt`` (temperature sampling with ``--sample-seed``; ``--temperature 0`` is greedy).

Less on the wire: under FSDP, ``--weights-wire`` and ``--grads-wire`` gather the parameters and
reduce the gradients compressed (bf16, fp16, or blockwise int8/int4 with error feedback); under
``--strategy ddp``, ``--grads-wire bf16|fp16|powersgd`` registers a communication hook
(``ferro_fsdp.comm_hooks``). PowerSGD (``--powersgd-rank``, after ``--powersgd-start`` exact
steps) keeps its error feedback and warm-start Qs in the checkpoints, so a resumed run on the
same number of ranks continues with the bits of an unbroken one.
tqdm and matplotlib are optional (``pip install -r examples/requirements.txt``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from ferro_backend import SettingError, init_from_env, settings
from ferro_checkpoint import CheckpointManager, ShardMetadata, TensorShardSpec
from ferro_collective import ReduceOp, all_gather, allreduce, broadcast
from ferro_fsdp import DDP, FSDP, Module, comm_hooks, nn, optim

STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "ddp"]
WIRES = ["bf16", "fp16", "int8", "int4"]
GRAD_HOOKS = ["bf16", "fp16", "powersgd"]  # DDP's --grads-wire: a communication hook each
# tab, newline, printable ASCII; index len(CHARS) stands for any other character
CHARS = "\t\n" + "".join(chr(c) for c in range(32, 127))
OTHER = len(CHARS)
VOCAB = len(CHARS) + 1
OTHER_CHAR = "\N{REPLACEMENT CHARACTER}"
MODEL_KEYS = ("dim", "layers", "heads", "seq", "dtype")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256, help="embedding width")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=8, help="attention heads (must divide --dim)")
    p.add_argument("--seq", type=int, default=128, help="context length in characters")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--corpus-chars", type=int, default=4_000_000,
                   help="characters of standard-library source to read")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="held out: every round(1/f)-th file (the tail if there are too few)")
    p.add_argument("--strategy", choices=STRATEGIES, default="full_shard")
    p.add_argument("--intra-node-size", type=int, default=None,
                   help="hybrid_shard, --secondary-shard: ranks per node (default: "
                        "LOCAL_WORLD_SIZE under ferrorun, else half the ranks, at least 1)")
    p.add_argument("--secondary-shard", action="store_true",
                   help="full_shard: the backward gathers the parameters inside the node "
                        "from a secondary shard the forward's gather left (ZeRO++'s hpZ)")
    p.add_argument("--weights-wire", choices=WIRES, default=None,
                   help="FSDP: gather the parameters in this wire format (int8: ZeRO++'s)")
    p.add_argument("--grads-wire", choices=WIRES + ["powersgd"], default=None,
                   help="FSDP: reduce the gradients in this wire format (int8/int4: with "
                        "error feedback); DDP: a compressing hook (bf16, fp16, or powersgd: "
                        "low rank with error feedback and warm start, its state checkpointed)")
    p.add_argument("--powersgd-rank", type=int, default=4,
                   help="DDP --grads-wire powersgd: the rank of each gradient's approximation")
    p.add_argument("--powersgd-start", type=int, default=10,
                   help="DDP --grads-wire powersgd: steps averaged exactly before it starts")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP: the largest gradient bucket in MiB (default 25, torch's): smaller "
                        "buckets start their allreduces earlier in the backward, which pays on "
                        "a slow link")
    p.add_argument("--first-bucket-cap-mb", type=float, default=None,
                   help="DDP: the first bucket's cap in MiB (default: --bucket-cap-mb; torch "
                        "uses 1): the head's gradients on the link before the rest are written")
    p.add_argument("--steps", type=int, default=500, help="total steps (a resume continues)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch size (sequences)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="steps between checkpoints (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    p.add_argument("--eval-every", type=int, default=100,
                   help="steps between held-out evaluations (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="global batches of held-out windows per evaluation")
    p.add_argument("--prompt", default="def ", help="start of the generated sample")
    p.add_argument("--sample-chars", type=int, default=300, help="characters to generate (0: none)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--sample-seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dump-params", type=Path, default=None,
                   help="write the final full parameters (rank 0) to this .npz")
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


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse numbers no run can use, one line naming the flag (exit 2), before any backend,
    corpus or model is made."""
    def refuse(message: str) -> None:
        p.exit(2, f"train_lm: {message}\n")

    for flag, low in (("--dim", 1), ("--layers", 1), ("--heads", 1), ("--seq", 1),
                      ("--batch-size", 1), ("--eval-batches", 1), ("--corpus-chars", 1),
                      ("--steps", 0), ("--warmup", 0), ("--checkpoint-every", 0),
                      ("--eval-every", 0), ("--sample-chars", 0), ("--intra-node-size", 1)):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < low:
            refuse(f"{flag} must be >= {low} (got {value})")
    if args.dim % args.heads:
        refuse(f"--heads {args.heads} does not divide --dim {args.dim}")
    if not 0 < args.val_fraction < 1:
        refuse(f"--val-fraction must be between 0 and 1, exclusive (got {args.val_fraction}): "
               "the held-out part evaluates the model")
    if not 0 <= args.dropout < 1:
        refuse(f"--dropout must be in [0, 1) (got {args.dropout})")
    if args.weights_wire is not None and args.strategy == "no_shard":
        refuse("--weights-wire compresses FSDP's all-gather of the parameters and --strategy "
               "no_shard gathers none; --grads-wire compresses its gradients")
    why = unwritable(args.dump_params)
    if why:
        refuse(f"--dump-params: {why}")


# ------------------------------------------------------------------------------ data
def stdlib_sources() -> list[Path]:
    """The standard library's .py files (no site-packages), sorted by relative path."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found = []
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        rel = os.path.relpath(top, root)
        found += [(Path(rel, f).as_posix(), os.path.join(top, f)) for f in files
                  if f.endswith(".py")]
    return [Path(full) for _, full in sorted(found)]


def read_sources(max_chars: int) -> list[str]:
    """The sources' texts, one per file in order, the last cut so they total ``max_chars``."""
    texts, total = [], 0
    for f in stdlib_sources():
        if total >= max_chars:
            break
        text = f.read_text(encoding="utf-8", errors="replace")
        text = (text if text.endswith("\n") else text + "\n")[:max_chars - total]
        texts.append(text)
        total += len(text)
    if not texts:
        raise SystemExit(f"train_lm: no .py files under {sysconfig.get_paths()['stdlib']}")
    return texts


def load_corpus(max_chars: int) -> tuple[str, int]:
    """The first ``max_chars`` characters of the sources, one file after another; (text, files)."""
    texts = read_sources(max_chars)
    return "".join(texts), len(texts)


def split_corpus(texts: list[str], val_fraction: float) -> tuple[str, str]:
    """(training text, held-out text): every ``round(1 / val_fraction)``-th file is held out, so
    both halves mix the library's kinds of code (a tail of the sorted files would be mostly
    ``encodings/`` tables)."""
    every = max(2, round(1.0 / val_fraction)) if val_fraction > 0 else 0
    held = [t for i, t in enumerate(texts) if every and i % every == every - 1]
    train = [t for i, t in enumerate(texts) if not (every and i % every == every - 1)]
    if not held:          # fewer files than `every`: hold out the tail of the text instead
        text = "".join(texts)
        cut = int(len(text) * (1.0 - val_fraction))
        return text[:cut], text[cut:]
    return "".join(train), "".join(held)


_LUT = np.full(128, OTHER, np.int32)
_LUT[[ord(c) for c in CHARS]] = np.arange(len(CHARS), dtype=np.int32)


def encode(text: str) -> np.ndarray:
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    out = np.full(codes.shape, OTHER, np.int32)
    ascii_ = codes < 128
    out[ascii_] = _LUT[codes[ascii_]]
    return out


def decode(tokens) -> str:
    return "".join(CHARS[t] if t < OTHER else OTHER_CHAR for t in np.asarray(tokens).tolist())


def windows(tokens: np.ndarray, starts: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs ``tokens[s:s+seq]`` and next-character targets for every start ``s``."""
    idx = starts[:, None] + np.arange(seq + 1)
    w = tokens[idx]
    return w[:, :-1], w[:, 1:]


def batch_starts(n_tokens: int, seq: int, batch: int, seed: int, step: int) -> np.ndarray:
    """The window starts of global batch ``step``: a function of (seed, step) only."""
    return np.random.default_rng([seed, step]).integers(0, n_tokens - seq - 1, batch)


# ------------------------------------------------------------------------------ model
class GPT(Module):
    """``idx [batch, seq] -> logits [batch, seq, VOCAB]``: embeddings, pre-LN blocks, LayerNorm,
    linear head; ``backward(grad_logits)`` fills every parameter's gradient."""

    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int, *,
                 dropout: float = 0.0, dtype=np.float32, rng=0) -> None:
        super().__init__()
        rng = np.random.default_rng(rng)
        self.wte = nn.Embedding(vocab, dim, dtype=dtype, rng=rng)
        self.wpe = nn.Embedding(seq, dim, dtype=dtype, rng=rng)
        for emb in (self.wte, self.wpe):   # GPT-2's N(0, 0.02) instead of torch's N(0, 1)
            emb.weight.data *= emb.weight.data.dtype.type(0.02)
        self.drop = nn.Dropout(dropout, rng=rng)
        self.h = nn.Sequential(*[nn.TransformerBlock(dim, heads, dropout=dropout, dtype=dtype,
                                                     rng=rng) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim, dtype=dtype)
        self.head = nn.Linear(dim, vocab, bias=False, dtype=dtype, rng=rng)

    def forward(self, idx):
        x = self.drop(self.wte(idx) + self.wpe(np.arange(idx.shape[-1])))
        return self.head(self.ln_f(self.h(x)))

    def backward(self, grad_logits):
        g = self.drop.backward(self.h.backward(self.ln_f.backward(self.head.backward(grad_logits))))
        self.wte.backward(g)
        self.wpe.backward(g.reshape(-1, *g.shape[-2:]).sum(axis=0))  # positions: shared


def build_model(cfg: dict, seed: int, dropout: float = 0.0) -> GPT:
    if cfg["dim"] % cfg["heads"]:
        raise SystemExit(f"train_lm: --heads {cfg['heads']} does not divide --dim {cfg['dim']}")
    return GPT(VOCAB, cfg["seq"], cfg["dim"], cfg["heads"], cfg["layers"], dropout=dropout,
               dtype=np.dtype(cfg["dtype"]), rng=seed)


def lm_loss(model, loss_fn, x: np.ndarray, y: np.ndarray, backward: bool = True) -> float:
    logits = model(x)
    loss = loss_fn(logits.reshape(-1, VOCAB), y.reshape(-1))
    if backward:
        model.backward(loss_fn.backward().reshape(logits.shape))
    return float(loss)


def generate(model: GPT, prompt: str, n: int, seq: int, temperature: float,
             seed: int) -> str:
    """``n`` characters after ``prompt`` (one process, full model, eval mode)."""
    rng = np.random.default_rng(seed)
    tokens = list(encode(prompt)) or [CHARS.index("\n")]
    for _ in range(n):
        ctx = np.asarray(tokens[-seq:], np.int64)[None]
        logits = model(ctx)[0, -1].astype(np.float64)
        if temperature <= 0:
            nxt = int(np.argmax(logits))
        else:
            z = logits / temperature
            p = np.exp(z - z.max())
            nxt = int(rng.choice(VOCAB, p=p / p.sum()))
        tokens.append(nxt)
    return decode(tokens)


# ------------------------------------------------------------------------------ checkpoints
def newest_step(manager: CheckpointManager, backend) -> int | None:
    """The newest committed step as rank 0 sees it, on every rank (one decision for all)."""
    mine = manager.latest_step()
    step = int(broadcast(np.array([-1 if mine is None else mine], np.int64), backend, 0)[0])
    return None if step < 0 else step


def resume_powersgd(powersgd, tensors: dict, extra: dict, rank: int) -> None:
    """Take a restored checkpoint's PowerSGD state out of ``tensors``: into ``powersgd`` (a
    PowerSGDState, or None where this run has no PowerSGD) where both have one. Its error
    feedback is per rank: kept on the world size that saved it, started afresh on another;
    a checkpoint without it (an exact run's) starts PowerSGD afresh, exact steps first."""
    held = any(k.startswith("powersgd.") for k in tensors)
    note = None
    if powersgd is None:
        for k in [k for k in tensors if k.startswith("powersgd.")]:
            del tensors[k]
        if held:
            note = "the checkpoint's PowerSGD state is left unused: this run averages exactly"
    elif not held:
        note = (f"the checkpoint holds no PowerSGD state: PowerSGD starts afresh "
                f"({powersgd.start_powerSGD_iter} exact steps first)")
    elif not powersgd.load_sharded_state_dict(tensors):
        note = (f"the checkpoint was saved by {extra.get('world_size')} ranks: PowerSGD's error "
                "feedback and Qs start afresh on this world size")
    if note and rank == 0:
        print(f"train_lm: {note}", flush=True)


def history_path(args) -> Path:
    return args.checkpoint_dir / "loss_history.json"


def plot_losses(history: list[dict], path: Path) -> None:
    """Training loss of every run (held-out loss as markers), a dashed line at each resume."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in history:
        label = f"run {run['run']}: {run['world_size']} ranks, {run['strategy']}"
        (line,) = ax.plot([s for s, _ in run["losses"]], [v for _, v in run["losses"]],
                          label=label, linewidth=1)
        if run.get("val"):
            ax.plot([s for s, _ in run["val"]], [v for _, v in run["val"]], "o",
                    color=line.get_color(), label=f"run {run['run']}: held-out")
        if run["start_step"] > 0:
            ax.axvline(run["start_step"], color=line.get_color(), linestyle="--", linewidth=1,
                       label=f"run {run['run']} resumes at step {run['start_step']}")
    ax.set_title(f"train_lm: character-level loss, {len(history)} run"
                 f"{'s' * (len(history) != 1)}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats per character)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------ training
def main(argv=None) -> int:
    args = parse_args(argv)
    # the flags first, before the backend: a bad one is one line, not a job that connected
    if args.resume and args.checkpoint_dir is None:
        raise SystemExit("train_lm: --resume needs --checkpoint-dir")
    if args.grads_wire == "powersgd" and args.strategy != "ddp":
        raise SystemExit("train_lm: --grads-wire powersgd is a DDP hook: it needs --strategy ddp")
    for flag, cap in (("--bucket-cap-mb", args.bucket_cap_mb),
                      ("--first-bucket-cap-mb", args.first_bucket_cap_mb)):
        if cap is not None and (args.strategy != "ddp" or not cap > 0):
            raise SystemExit(f"train_lm: {flag} is DDP's bucket size: it needs --strategy ddp "
                             f"and a size > 0 (got {cap} with {args.strategy})")
    if args.powersgd_rank < 1 or args.powersgd_start < 0:
        raise SystemExit(f"train_lm: --powersgd-rank must be >= 1 and --powersgd-start >= 0 "
                         f"(got {args.powersgd_rank} and {args.powersgd_start})")
    try:
        restart = settings.RESTART_COUNT.get()  # how many times ferrorun restarted the job
    except SettingError as exc:
        raise SystemExit(f"train_lm: {exc}") from None
    if args.resume and not restart and not args.checkpoint_dir.is_dir():
        raise SystemExit(f"train_lm: --resume: no checkpoint directory {args.checkpoint_dir}; "
                         "check the path")
    backend = init_from_env()
    rank, world = backend.rank, backend.world_size
    if args.batch_size % world:
        raise SystemExit(f"train_lm: --batch-size {args.batch_size} is not divisible by "
                         f"{world} ranks")
    cfg = {k: getattr(args, k) for k in MODEL_KEYS}

    texts = read_sources(args.corpus_chars)
    n_files = len(texts)
    train_text, held_text = split_corpus(texts, args.val_fraction)
    train, held = encode(train_text), encode(held_text)
    tokens = np.concatenate([train, held])
    if len(train) < args.seq + 2 or len(held) < args.seq + 2:
        part = "training" if len(train) < args.seq + 2 else "held-out"
        raise SystemExit(f"train_lm: the {part} part of the corpus ({len(train)} training, "
                         f"{len(held)} held-out characters of {len(tokens)}, --val-fraction "
                         f"{args.val_fraction}) is too short for --seq {args.seq}; raise "
                         "--corpus-chars" + (" or --val-fraction" if part == "held-out" else ""))
    digest = hashlib.sha256(tokens.tobytes()).hexdigest()[:12]

    model = build_model(cfg, args.seed, args.dropout)
    n_params = model.num_parameters()
    powersgd = None  # DDP --grads-wire powersgd: its state (error feedback, Qs) is checkpointed
    if args.strategy == "ddp":
        caps = {k: v for k, v in (("bucket_cap_mb", args.bucket_cap_mb),
                                  ("first_bucket_cap_mb", args.first_bucket_cap_mb))
                if v is not None}
        wrapper = DDP(model, backend, **caps)
        if args.weights_wire or args.grads_wire not in (None, *GRAD_HOOKS):
            raise SystemExit("train_lm: --strategy ddp takes --grads-wire "
                             + ", ".join(GRAD_HOOKS) + " and no --weights-wire")
        if args.grads_wire == "powersgd":
            powersgd = comm_hooks.PowerSGDState(
                backend, matrix_approximation_rank=args.powersgd_rank,
                start_powerSGD_iter=args.powersgd_start)
            wrapper.register_comm_hook(powersgd, comm_hooks.powerSGD_hook)
        elif args.grads_wire is not None:
            hooks = {"bf16": comm_hooks.bf16_compress_hook,
                     "fp16": comm_hooks.fp16_compress_hook}
            wrapper.register_comm_hook(backend, hooks[args.grads_wire])
    else:
        intra = None
        if args.strategy == "hybrid_shard" or args.secondary_shard:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
            intra, said = ((args.intra_node_size, "--intra-node-size")
                           if args.intra_node_size is not None else
                           (local, "LOCAL_WORLD_SIZE") if local else
                           (max(1, world // 2), "half the ranks (give --intra-node-size)"))
            if world % intra:
                raise SystemExit(f"train_lm: {intra} ranks per node ({said}) do not divide the "
                                 f"{world} ranks")
        if args.secondary_shard and args.strategy != "full_shard":
            raise SystemExit("train_lm: --secondary-shard is for --strategy full_shard")
        wrapper = FSDP(model, backend, args.strategy, wrap=nn.TransformerBlock,
                       intra_node_size=intra, sync_module_states=True,
                       weights_wire=args.weights_wire, grads_wire=args.grads_wire,
                       secondary_shard=args.secondary_shard)
    opt = optim.AdamW(wrapper.module.parameters(), lr=args.lr, betas=(0.9, 0.95),
                      weight_decay=args.weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    if rank == 0:
        units = getattr(wrapper, "units", None)
        print(f"train_lm: {n_params:,} parameters ({args.layers} blocks of width {args.dim}, "
              f"context {args.seq}, vocabulary {VOCAB}), {world} rank{'s' * (world != 1)}, "
              f"{args.strategy}" + (f", units {units}" if units else "")
              + f"; corpus: {len(tokens):,} characters from {n_files} stdlib files "
              f"(sha256 {digest}), {len(held):,} held out", flush=True)

    step = 0
    manager = None
    if args.checkpoint_dir is not None:
        manager = CheckpointManager(args.checkpoint_dir, rank, world, keep_last=3,
                                    backend=backend)
    resuming = (args.resume or restart > 0) and manager is not None
    found = newest_step(manager, backend) if resuming else None
    if found is not None:
        tensors, extra = manager.restore(found)
        saved_cfg = extra.get("model", cfg)
        if saved_cfg != cfg:
            raise SystemExit(f"train_lm: the checkpoint in {args.checkpoint_dir} is of another "
                             f"model {saved_cfg}; this run asks for {cfg}")
        if extra.get("corpus_sha256", digest) != digest and rank == 0:
            print(f"train_lm: resuming a model trained on another corpus (sha256 "
                  f"{extra['corpus_sha256']}, this run's {digest}: another --corpus-chars, "
                  "--val-fraction or Python): its held-out losses are not comparable with "
                  "the saved run's", flush=True)
        resume_powersgd(powersgd, tensors, extra, rank)
        wrapper.load_sharded_state_dict(tensors, opt)
        step = int(extra["step"])
        if rank == 0:
            print(f"resumed from step {step} of {args.checkpoint_dir} on {world} ranks "
                  f"({args.strategy}, saved on {extra.get('world_size')} ranks, restart "
                  f"{restart})", flush=True)
    elif args.resume and not restart:
        raise SystemExit(f"train_lm: --resume: no committed checkpoint in "
                         f"{args.checkpoint_dir}; check the path")
    history: list[dict] = []
    if args.checkpoint_dir is not None:
        if rank == 0 and resuming and history_path(args).exists():
            history = json.loads(history_path(args).read_text())
            history = [r for r in history if r["start_step"] < step]  # runs before this one
        backend.barrier()
    run = {"run": len(history) + 1, "world_size": world, "strategy": args.strategy,
           "start_step": step, "losses": [], "val": []}
    history.append(run)
    per_rank = args.batch_size // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)

    def evaluate() -> float:
        """Mean held-out loss over ``--eval-batches`` fixed global batches (collective)."""
        wrapper.eval()
        total = 0.0
        for k in range(args.eval_batches):
            starts = batch_starts(len(held), args.seq, args.batch_size, args.seed + 7919, k)
            x, y = windows(held, starts[mine], args.seq)
            total += lm_loss(wrapper, loss_fn, x, y, backward=False)
        wrapper.train()
        mean = allreduce(np.array([total / max(args.eval_batches, 1)]), backend, ReduceOp.MEAN)
        return float(mean[0])

    saved: list = [None, None]  # the last step saved and its future: the same on every rank

    def save(step_now: int, blocking: bool = False) -> None:
        tensors, specs = wrapper.sharded_state_dict(opt)
        if powersgd is not None:  # (its error feedback: each rank its own row)
            rows, row_specs = powersgd.sharded_state_dict()
            tensors, specs = {**tensors, **rows}, {**specs, **row_specs}
        meta = ShardMetadata(world, {k: TensorShardSpec(*v) for k, v in specs.items()})
        extra = {"step": step_now, "seed": args.seed, "world_size": world,
                 "strategy": args.strategy, "model": cfg, "corpus_sha256": digest}
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
            print("train_lm: tqdm not installed (pip install tqdm): no progress bar", flush=True)
        if tqdm is not None:
            progress = tqdm(total=args.steps, initial=step, unit="step", file=sys.stdout,
                            dynamic_ncols=True)

    def say(msg: str) -> None:
        if rank == 0:
            (progress.write(msg) if progress is not None else print(msg, flush=True))

    tokens_per_step = args.batch_size * args.seq
    sent0 = getattr(backend, "bytes_sent", 0)   # (counted by the transports that count them)
    t0 = time.perf_counter()
    first_step = step
    val = float("nan")
    while step < args.steps:
        opt.lr = args.lr * min(1.0, (step + 1) / max(args.warmup, 1))
        starts = batch_starts(len(train), args.seq, args.batch_size, args.seed, step)
        x, y = windows(train, starts[mine], args.seq)
        loss = lm_loss(wrapper, loss_fn, x, y)
        if args.strategy != "ddp":
            wrapper.sync_gradients()   # DDP synced inside its backward
        if args.clip > 0:
            wrapper.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad()
        if args.strategy != "ddp":
            wrapper.broadcast_updated_params()
        step += 1
        global_loss = float(allreduce(np.array([loss]), backend, ReduceOp.MEAN)[0])
        run["losses"].append((step, global_loss))
        if progress is not None:
            rate = (step - first_step) * tokens_per_step / (time.perf_counter() - t0)
            progress.set_postfix(loss=f"{global_loss:.3f}", tokens_per_s=f"{rate:.0f}")
            progress.update(1)
        if manager is not None and args.checkpoint_every and step % args.checkpoint_every == 0:
            save(step)
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            val = evaluate()
            run["val"].append((step, val))
            say(f"step {step}: loss {global_loss:.4f}, held-out loss {val:.4f}")
    elapsed = time.perf_counter() - t0
    sent = float(allreduce(np.array([getattr(backend, "bytes_sent", 0) - sent0], np.float64),
                           backend, ReduceOp.MEAN)[0])
    if progress is not None:
        progress.close()
    val = evaluate()
    run["val"].append((step, val))
    if manager is not None:
        if saved[0] != step:
            save(step, blocking=True)
        else:
            saved[1].wait()
    peak = all_gather(np.array([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024],
                               np.int64), backend)
    full = wrapper.full_state_dict() if isinstance(wrapper, FSDP) else \
        {n: p.data for n, p in wrapper.named_parameters()}   # collective under FSDP
    if rank == 0:
        if args.dump_params is not None:
            np.savez(args.dump_params, **full)
        done = step - first_step
        summary = {
            "world_size": world, "strategy": args.strategy, "parameters": int(n_params),
            "model": cfg, "steps": step, "steps_this_run": done,
            "tokens_per_s": done * tokens_per_step / elapsed if done and elapsed else 0.0,
            "peak_memory_per_rank_MiB": [round(int(b) / 2**20, 1) for b in peak],
            "first_loss": run["losses"][0][1] if run["losses"] else None,
            "final_loss": run["losses"][-1][1] if run["losses"] else None,
            "held_out_loss": val, "corpus_chars": int(len(tokens)), "corpus_sha256": digest,
            "steps_per_s": done / elapsed if done and elapsed else 0.0,
            "weights_wire": args.weights_wire, "grads_wire": args.grads_wire,
            "secondary_shard": args.secondary_shard,
            "bytes_sent_per_rank_per_step": sent / done if done else 0.0,
        }
        if isinstance(wrapper, DDP):
            summary["ddp_buckets"] = len(wrapper.buckets)
        if powersgd is not None:
            summary["powersgd"] = {"rank": powersgd.matrix_approximation_rank,
                                   "start": powersgd.start_powerSGD_iter}
        print("summary: " + json.dumps(summary), flush=True)
        print(f"{done} steps in {elapsed:.1f}s ({summary['tokens_per_s']:.0f} tokens/s) on "
              f"{world} ranks, held-out loss {val:.4f} nats/char "
              f"({val / math.log(2):.3f} bits), peak memory per rank "
              f"{summary['peak_memory_per_rank_MiB']} MiB", flush=True)
        if args.sample_chars > 0:
            sampler = build_model(cfg, args.seed)
            sampler.load_state_dict(full)
            sampler.eval()
            how = "greedy" if args.temperature <= 0 else \
                f"temperature {args.temperature}, seed {args.sample_seed}"
            out = generate(sampler, args.prompt, args.sample_chars, args.seq, args.temperature,
                           args.sample_seed)
            print(f"sample ({how}):\n{'-' * 72}\n{out}\n{'-' * 72}", flush=True)
        if args.checkpoint_dir is not None:
            history_path(args).write_text(json.dumps(history))
            (args.checkpoint_dir / "summary.json").write_text(json.dumps(summary))
            try:
                plot_losses(history, args.checkpoint_dir / "loss_curve.png")
                print(f"loss curve: {args.checkpoint_dir / 'loss_curve.png'}", flush=True)
            except ImportError:
                print("matplotlib not installed (pip install matplotlib): no loss curve plot",
                      flush=True)
    backend.barrier()
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
