"""ferro-fsdp: one training step of a ~10M-parameter MLP on 4 simulated ranks, prefetch, bytes sent.

Groups (each pairs ferro with a baseline measured in the same run):

* ``train step 10M MLP``: one SGD step (forward, backward, gradient sync, update) on 4 simulated
  ranks (threads, batch 64 split 16 per rank) for each strategy and DDP, against the same step in
  one process on the whole batch with plain numpy (no ferro at all: ``single_process``).
* ``forward with compute before it``: FULL_SHARD forward on 4 ranks after some unrelated compute,
  with ``prefetch_forward_params()`` started before that compute, against the same without
  prefetch (``baseline``).
* ``bytes per step``: the step again through a byte-counting backend; ``extra_info`` holds the
  bytes each rank sent and the theoretical figure (ring collectives: an all-gather or a
  reduce-scatter sends ``(n-1)/n`` of the parameters, an allreduce ``2(n-1)/n``). Printed with
  ``-s``.

Few rounds: each step moves hundreds of MiB between the simulated ranks.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np
import pytest

from ferro_backend import Backend, SimulatedBackend
from ferro_backend.checks import as_send_view
from ferro_fsdp import DDP, FSDP, nn, optim

WORLD = 4
DIMS = (1024, 2048, 2048, 2048)  # 10.5M parameters (float32: 42 MB)
BATCH = 64
DTYPE = np.float32
ROUNDS = 3
STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "ddp"]


def n_params(dims=DIMS) -> int:
    return sum(dims[i] * dims[i + 1] + dims[i + 1] for i in range(len(dims) - 1))


def make_model(seed: int = 0) -> nn.Sequential:
    rng = np.random.default_rng(seed)
    layers: list[Any] = []
    for i in range(len(DIMS) - 1):
        layers.append(nn.Linear(DIMS[i], DIMS[i + 1], dtype=DTYPE, rng=rng))
        if i < len(DIMS) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_batch(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((BATCH, DIMS[0])).astype(DTYPE),
            rng.standard_normal((BATCH, DIMS[-1])).astype(DTYPE))


class CountingBackend(Backend):
    """Forwards to a simulated rank and counts the bytes this rank sends."""

    def __init__(self, inner: Backend) -> None:
        self._inner = inner
        self.timeout = inner.timeout
        self.bytes_sent = 0

    @property
    def rank(self) -> int:
        return self._inner.rank

    @property
    def world_size(self) -> int:
        return self._inner.world_size

    def send(self, data, dst, *, tag=0):
        self.bytes_sent += as_send_view(data).nbytes
        self._inner.send(data, dst, tag=tag)

    def isend(self, data, dst, *, tag=0):
        self.bytes_sent += as_send_view(data).nbytes
        return self._inner.isend(data, dst, tag=tag)

    def recv(self, out, src, *, tag=0, timeout=None):
        self._inner.recv(out, src, tag=tag, timeout=timeout)

    def irecv(self, out, src, *, tag=0):
        return self._inner.irecv(out, src, tag=tag)

    def abort(self, reason):
        self._inner.abort(reason)

    def close(self):
        self._inner.close()


class RankPool:
    """One thread per rank that keeps its wrapper between benchmark rounds; ``run(fn)`` runs
    ``fn(state)`` on every rank at once and returns when all are done."""

    def __init__(self, setup, *, counting: bool = False) -> None:
        group = SimulatedBackend.create_group(WORLD, timeout=300.0)
        self.backends = [CountingBackend(b) for b in group] if counting else group
        self._in = [queue.Queue() for _ in range(WORLD)]
        self._out: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._loop, args=(r, setup), daemon=True)
                         for r in range(WORLD)]
        for t in self._threads:
            t.start()
        self.run(lambda state: None)  # wait for every rank's setup

    def _loop(self, r: int, setup) -> None:
        try:
            state = setup(self.backends[r])
        except BaseException as exc:  # reported on the first run
            state = exc
        while True:
            fn = self._in[r].get()
            if fn is None:
                return
            try:
                if isinstance(state, BaseException):
                    raise state
                self._out.put((r, fn(state), None))
            except BaseException as exc:
                self._out.put((r, None, exc))

    def run(self, fn) -> list[Any]:
        for q in self._in:
            q.put(fn)
        results: list[Any] = [None] * WORLD
        for _ in range(WORLD):
            r, value, exc = self._out.get(timeout=600)
            if exc is not None:
                raise exc
            results[r] = value
        return results

    def close(self) -> None:
        for q in self._in:
            q.put(None)
        for t in self._threads:
            t.join(30)
        for b in self.backends:
            b.close()


class RankState:
    def __init__(self, backend: Backend, strategy: str, **kwargs: Any) -> None:
        x, y = make_batch()
        per = BATCH // WORLD
        self.x = x[backend.rank * per:(backend.rank + 1) * per]
        self.y = y[backend.rank * per:(backend.rank + 1) * per]
        self.backend = backend
        if strategy == "ddp":
            self.wrapper: Any = DDP(make_model(), backend)
        else:
            self.wrapper = FSDP(make_model(), backend, strategy,
                                intra_node_size=2 if strategy == "hybrid_shard" else None, **kwargs)
        self.opt = optim.SGD(self.wrapper.module.parameters(), lr=1e-3)
        self.loss_fn = nn.MSELoss()

    def step(self) -> float:
        w = self.wrapper
        loss = self.loss_fn(w(self.x), self.y)
        w.backward(self.loss_fn.backward())
        if isinstance(w, FSDP):
            w.sync_gradients()
        self.opt.step()
        self.opt.zero_grad()
        if isinstance(w, FSDP):
            w.broadcast_updated_params()
        return loss


def numpy_mlp_step(params: list[np.ndarray], x: np.ndarray, y: np.ndarray, lr: float) -> float:
    """Forward, backward and SGD of the same MLP in plain numpy (W, b pairs; ReLU between)."""
    acts = [x]
    h = x
    n_layers = len(params) // 2
    for i in range(n_layers):
        h = h @ params[2 * i].T + params[2 * i + 1]
        if i < n_layers - 1:
            h = np.maximum(h, 0)
        acts.append(h)
    diff = h - y
    loss = float(np.mean(diff * diff))
    g = diff * (2.0 / diff.size)
    for i in reversed(range(n_layers)):
        if i < n_layers - 1:
            g = g * (acts[i + 1] > 0)
        w = params[2 * i]
        gw = g.T @ acts[i]
        gb = g.sum(axis=0)
        g = g @ w
        w -= lr * gw
        params[2 * i + 1] -= lr * gb
    return loss


@pytest.mark.parametrize("impl", ["single_process", *STRATEGIES])
def bench_train_step(benchmark, impl):
    benchmark.group = f"train step {n_params() / 1e6:.1f}M-param MLP, {WORLD} ranks"
    benchmark.extra_info["params"] = n_params()
    if impl == "single_process":
        benchmark.extra_info["role"] = "baseline"
        params = [np.array(p.data, copy=True) for p in make_model().parameters()]
        x, y = make_batch()
        losses = []
        benchmark.pedantic(lambda: losses.append(numpy_mlp_step(params, x, y, 1e-3)),
                           rounds=ROUNDS, warmup_rounds=1)
        assert np.isfinite(losses).all()
        return
    pool = RankPool(lambda b: RankState(b, impl))
    try:
        out = []
        benchmark.pedantic(lambda: out.append(pool.run(RankState.step)), rounds=ROUNDS,
                           warmup_rounds=1)
        assert np.isfinite(out).all()
    finally:
        pool.close()


def busy_compute(size: int = 768, reps: int = 6) -> None:
    """Work that does not touch the model (numpy matmuls release the GIL like real compute)."""
    a = np.ones((size, size), DTYPE)
    for _ in range(reps):
        a = a @ a
        a *= 1.0 / size


@pytest.mark.parametrize("impl", ["baseline", "prefetch"])
def bench_forward_with_prefetch(benchmark, impl):
    benchmark.group = f"FULL_SHARD forward after compute, {WORLD} ranks"

    def forward(state: RankState) -> None:
        if impl == "prefetch":
            state.wrapper.prefetch_forward_params()
        busy_compute()
        state.wrapper(state.x)

    if impl == "baseline":
        benchmark.extra_info["role"] = "baseline"
    pool = RankPool(lambda b: RankState(b, "full_shard"))
    try:
        benchmark.pedantic(lambda: pool.run(forward), rounds=ROUNDS + 2, warmup_rounds=1)
    finally:
        pool.close()


def theoretical_bytes(strategy: str, reshard: bool, nbytes: int) -> float:
    n = WORLD
    ring = (n - 1) / n
    if strategy == "full_shard":
        return (3 if reshard else 2) * ring * nbytes
    if strategy == "shard_grad_op":
        return 2 * ring * nbytes
    if strategy in ("no_shard", "ddp"):
        return 2 * ring * nbytes
    intra, nodes = 2, n // 2
    return 3 * (intra - 1) / intra * nbytes + 2 * (nodes - 1) / nodes * nbytes / intra


BYTES_CASES = [("full_shard", True), ("full_shard", False), ("shard_grad_op", True),
               ("no_shard", True), ("hybrid_shard", True), ("ddp", True)]


@pytest.mark.parametrize("strategy,reshard", BYTES_CASES,
                         ids=[f"{s}{'' if r else '-keep-params'}" for s, r in BYTES_CASES])
def bench_bytes_per_step(benchmark, strategy, reshard):
    benchmark.group = "bytes per step (ferro step, counting backend)"
    kwargs = {} if strategy == "ddp" or reshard else {"reshard_after_forward": False}
    pool = RankPool(lambda b: RankState(b, strategy, **kwargs), counting=True)
    try:
        pool.run(RankState.step)  # warm-up; DDP's construction broadcast is not a step
        before = [b.bytes_sent for b in pool.backends]
        benchmark.pedantic(lambda: pool.run(RankState.step), rounds=1, warmup_rounds=0)
        sent = [b.bytes_sent - s for b, s in zip(pool.backends, before)]
    finally:
        pool.close()
    nbytes = n_params() * np.dtype(DTYPE).itemsize
    theory = theoretical_bytes(strategy, reshard, nbytes)
    per_rank = float(np.mean(sent))
    benchmark.extra_info.update({"bytes_per_rank": per_rank, "theoretical": theory,
                                 "ratio_to_theory": per_rank / theory, "param_bytes": nbytes,
                                 "role": "ferro"})
    print(f"\nbytes per step {strategy}{'' if reshard else ' (reshard_after_forward=False)'}: "
          f"{per_rank / 2**20:.1f} MiB per rank (max {max(sent) / 2**20:.1f}), theoretical "
          f"{theory / 2**20:.1f} MiB = {theory / nbytes:.3f} x params, measured/theory "
          f"{per_rank / theory:.3f}")
    assert per_rank <= 1.25 * theory

