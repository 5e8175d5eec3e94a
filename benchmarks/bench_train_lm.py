"""Language-model training throughput: ferro FSDP / DDP against torch FSDP2 / DDP, 2 ranks.

The model and data of ``examples/train_lm.py``: a character-level GPT (token + position
embeddings, pre-LN blocks of causal self-attention and a 4x GELU MLP, final LayerNorm, linear
head; by default its 3.2 M-parameter configuration: width 256, 4 blocks, 8 heads, context 128)
on windows of the standard library's source. torch runs the same architecture written with
torch modules (``TorchBlock`` below: the same pre-LN block, ``scaled_dot_product_attention``
with a causal mask, exact GELU; not ``nn.TransformerEncoderLayer``, whose block differs), the
same parameter shapes, the same batches. One step: forward, cross entropy, backward, gradient
sync, clip to norm 1, AdamW step (ferro: its fused compiled step; torch: its default CPU step),
zero_grad. ferro: ``FSDP(full_shard, wrap=nn.TransformerBlock)`` and ``DDP`` under ``ferrorun``
(same-host transport); torch: ``fully_shard`` per block plus the root (FSDP2) and
``DistributedDataParallel(gradient_as_bucket_view=True)`` over gloo, and torch's FSDP2 over ferro's
transports (``torch-fsdp2-ferro``: ferro-torch's backend "ferro"). BLAS/OpenMP: one thread per
rank on both sides. Launches are interleaved (repeat outermost, kinds innermost) so drift on a
shared machine hits every column alike.

Figures: tokens/s = global tokens per step / the slowest rank's median step time; each kind is
launched ``--repeat`` times and the table gives the median of the launches and their spread
(min-max); peak RSS is the largest rank's ``ru_maxrss`` (median over launches).

    python benchmarks/bench_train_lm.py [--repeat 3] [--out RUN_DIR/results.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_train import launch_env_ranks  # this directory: torch's ranks started as torchrun does

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["ferro-fsdp", "torch-fsdp2", "ferro-ddp", "torch-ddp", "torch-fsdp2-ferro"]
PAIRS = [("ferro-fsdp", "torch-fsdp2"), ("ferro-ddp", "torch-ddp")]
TARGET = 1.3   # issue 31: ferro FSDP >= 1.3x torch FSDP2 tokens/s


def _lm():
    """examples/train_lm.py as a module (its corpus, windows and model)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_lm", ROOT / "examples" / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_batches(lm, cfg: dict, world: int, path: Path) -> None:
    """Every global batch of a launch, drawn as train_lm draws them, into ``path`` (.npy of
    shape [steps, world * batch, seq + 1]): workers read it, so torch's never import ferro."""
    import numpy as np

    train_text, _ = lm.split_corpus(lm.read_sources(cfg["corpus_chars"]), 0.1)
    tokens = lm.encode(train_text)
    steps, per, seq = cfg["warmup"] + cfg["steps"], cfg["batch"] * world, cfg["seq"]
    starts = [lm.batch_starts(len(tokens), seq, per, 0, s) for s in range(steps)]
    np.save(path, np.stack([tokens[st[:, None] + np.arange(seq + 1)] for st in starts]))


def _batches(cfg: dict, rank: int, path: Path):
    """This rank's (inputs, targets) of every step."""
    import numpy as np

    per = cfg["batch"]
    mine = np.load(path)[:, rank * per:(rank + 1) * per].astype(np.int64)
    return [(w[:, :-1], w[:, 1:]) for w in mine]


# ---------------------------------------------------------------------------------- workers
def _ferro_worker(kind: str, cfg: dict) -> tuple[list[float], int]:
    import numpy as np

    from ferro_backend import init_from_env
    from ferro_collective import barrier
    from ferro_fsdp import DDP, FSDP, nn, optim

    lm = _lm()
    backend = init_from_env()
    model = lm.GPT(lm.VOCAB, cfg["seq"], cfg["dim"], cfg["heads"], cfg["layers"], rng=0)
    if kind == "ferro-ddp":
        model = DDP(model, backend)
    else:
        model = FSDP(model, backend, "full_shard", wrap=nn.TransformerBlock)
    opt = optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loss_fn = nn.CrossEntropyLoss()
    batches = _batches(cfg, backend.rank, Path(cfg["data"]))
    barrier(backend)
    times = []
    for s, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        logits = model(x)
        loss_fn(logits.reshape(-1, lm.VOCAB), y.reshape(-1))
        model.backward(loss_fn.backward().reshape(logits.shape))
        if kind == "ferro-fsdp":
            model.sync_gradients()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if s >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    barrier(backend)
    assert np.isfinite(times).all()
    return times, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _torch_model(cfg: dict):
    import torch
    from torch import nn as tnn
    from torch.nn import functional as F

    class TorchAttention(tnn.Module):
        def __init__(self, dim, heads):
            super().__init__()
            self.heads = heads
            self.qkv = tnn.Linear(dim, 3 * dim)
            self.proj = tnn.Linear(dim, dim)

        def forward(self, x):
            b, t, e = x.shape
            q, k, v = (z.reshape(b, t, self.heads, e // self.heads).transpose(1, 2)
                       for z in self.qkv(x).split(e, dim=-1))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(o.transpose(1, 2).reshape(b, t, e))

    class TorchBlock(tnn.Module):
        """ferro's nn.TransformerBlock: h = x + attn(ln1(x)), y = h + mlp(ln2(h))."""

        def __init__(self, dim, heads):
            super().__init__()
            self.ln1 = tnn.LayerNorm(dim)
            self.attn = TorchAttention(dim, heads)
            self.ln2 = tnn.LayerNorm(dim)
            self.mlp = tnn.Sequential(tnn.Linear(dim, 4 * dim), tnn.GELU(),
                                      tnn.Linear(4 * dim, dim))

        def forward(self, x):
            h = x + self.attn(self.ln1(x))
            return h + self.mlp(self.ln2(h))

    class TorchGPT(tnn.Module):
        def __init__(self, vocab, seq, dim, heads, layers):
            super().__init__()
            self.wte = tnn.Embedding(vocab, dim)
            self.wpe = tnn.Embedding(seq, dim)
            self.h = tnn.Sequential(*[TorchBlock(dim, heads) for _ in range(layers)])
            self.ln_f = tnn.LayerNorm(dim)
            self.head = tnn.Linear(dim, vocab, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[-1]))
            return self.head(self.ln_f(self.h(x)))

    return TorchGPT


def _torch_worker(kind: str, cfg: dict) -> tuple[list[float], int]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if kind.endswith("-ferro"):  # torch's own FSDP2 over ferro's transports (ferro-torch)
        import ferro_torch  # noqa: F401 - registers the backend "ferro"

        dist.init_process_group("ferro")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = cfg["vocab"]
    model = _torch_model(cfg)(vocab, cfg["seq"], cfg["dim"], cfg["heads"], cfg["layers"])
    if kind.startswith("torch-ddp"):
        model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    batches = [(torch.from_numpy(x), torch.from_numpy(y))
               for x, y in _batches(cfg, rank, Path(cfg["data"]))]
    dist.barrier()
    times = []
    for s, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        logits = model(x)
        loss = loss_fn(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    return times, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(kind: str, cfg: dict, out: Path) -> None:
    times, rss = (_torch_worker if kind.startswith("torch") else _ferro_worker)(kind, cfg)
    rank = os.environ.get("RANK", "0")
    (out / f"{kind}.{rank}.json").write_text(json.dumps({"times": times, "rss": rss}))


# ----------------------------------------------------------------------------------- driver
def run_one(kind: str, cfg: dict, world: int, tmp: Path) -> dict:
    """One launch: tokens/s (slowest rank's median step), step ms, peak RSS of the largest rank."""
    for old in tmp.glob(f"{kind}.*.json"):
        old.unlink()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    me = [sys.executable, __file__, "--worker", kind, "--cfg", json.dumps(cfg), "--tmp", str(tmp)]
    if kind.startswith("ferro"):
        cmd = [sys.executable, "-m", "ferro_backend.launch", "--nproc", str(world), *me[1:]]
        subprocess.run(cmd, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL)
    else:
        launch_env_ranks(me, env, world, kind)
    ranks = [json.loads(f.read_text()) for f in tmp.glob(f"{kind}.*.json")]
    if len(ranks) != world:
        raise SystemExit(f"{kind}: {len(ranks)} of {world} ranks reported")
    step_s = max(statistics.median(r["times"]) for r in ranks)
    return {"tokens_per_s": cfg["batch"] * world * cfg["seq"] / step_s, "step_ms": 1e3 * step_s,
            "rss_mib": max(r["rss"] for r in ranks) / 2**20}


def _cell(values: list[float], fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-" \
           f"{fmt.format(max(values))})"


def table(results: dict, cfg: dict, world: int, n_params: int, wall: float,
          load: tuple[float, float]) -> str:
    med = {k: statistics.median(v["tokens_per_s"]) for k, v in results.items()}
    lines = [f"{world} ranks (processes), one BLAS/OpenMP thread each, "
             f"{platform.machine()} with {os.cpu_count()} cores (shared); model: "
             f"{n_params / 1e6:.2f} M parameters (width {cfg['dim']}, {cfg['layers']} blocks, "
             f"{cfg['heads']} heads, context {cfg['seq']}), {cfg['batch']} sequences per rank "
             f"({cfg['batch'] * cfg['seq']} tokens), {cfg['steps']} timed steps after "
             f"{cfg['warmup']} warm-up, {len(next(iter(results.values()))['tokens_per_s'])} "
             f"interleaved launches per kind ({wall / 60:.1f} min in all; 1-minute load average "
             f"{load[0]:.1f} before, {load[1]:.1f} after).", "",
             "| kind | tokens/s: median (min-max) | step ms: median (min-max) | "
             "peak RSS per rank, MiB: median (min-max) |", "|---|---|---|---|"]
    for kind, v in results.items():
        lines.append(f"| {kind} | {_cell(v['tokens_per_s'])} | {_cell(v['step_ms'])} | "
                     f"{_cell(v['rss_mib'])} |")
    lines += ["", "| ferro / torch (tokens/s, medians) | ratio | range over launch pairs |",
              "|---|---|---|"]
    for mine, theirs in PAIRS:
        if mine in med and theirs in med:
            pairs = [a / b for a, b in zip(results[mine]["tokens_per_s"],
                                           results[theirs]["tokens_per_s"])]
            lines.append(f"| {mine} / {theirs} | {med[mine] / med[theirs]:.2f}x | "
                         f"{min(pairs):.2f}x-{max(pairs):.2f}x |")
    if "ferro-fsdp" in med and "torch-fsdp2" in med:
        ratio = med["ferro-fsdp"] / med["torch-fsdp2"]
        lines += ["", f"Target (issue 31): ferro FSDP >= {TARGET}x torch FSDP2 tokens/s: "
                      f"{'met' if ratio >= TARGET else 'NOT met'} ({ratio:.2f}x)."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per launch")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--corpus-chars", type=int, default=1_000_000)
    ap.add_argument("--out", type=Path, default=None, help="Markdown table (and .json beside)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cfg", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, json.loads(args.cfg), args.tmp)
        return
    cfg = {"dim": args.dim, "layers": args.layers, "heads": args.heads, "seq": args.seq,
           "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
           "corpus_chars": args.corpus_chars}
    lm = _lm()
    n_params = lm.GPT(lm.VOCAB, cfg["seq"], cfg["dim"], cfg["heads"], cfg["layers"]) \
        .num_parameters()
    kinds = args.kinds.split(",")
    results: dict[str, dict[str, list[float]]] = {k: {"tokens_per_s": [], "step_ms": [],
                                                      "rss_mib": []} for k in kinds}
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ferro-lm-bench-") as tmp:
        cfg["data"], cfg["vocab"] = str(Path(tmp) / "batches.npy"), lm.VOCAB
        write_batches(lm, cfg, args.world, Path(cfg["data"]))
        for rep in range(args.repeat):   # repeats outermost: drift hits every kind alike
            for kind in kinds:
                r = run_one(kind, cfg, args.world, Path(tmp))
                for key, value in r.items():
                    results[kind][key].append(value)
                print(f"launch {rep + 1}/{args.repeat} {kind:<12} {r['tokens_per_s']:8.0f} "
                      f"tokens/s {r['step_ms']:8.1f} ms/step {r['rss_mib']:7.1f} MiB",
                      flush=True)
    text = table(results, cfg, args.world, n_params, time.perf_counter() - t0,
                 (load0, os.getloadavg()[0]))
    print("\n" + text)
    if args.out:
        args.out.write_text("# Language-model training throughput (benchmarks/bench_train_lm.py)"
                            "\n\n" + text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"config": cfg,
                                                             "results": results}, indent=1))


if __name__ == "__main__":
    main()
