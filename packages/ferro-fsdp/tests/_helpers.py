"""Shared test helpers: rank runner, a tiny seed-style module, an MLP and its training loop."""

from __future__ import annotations

import numpy as np

from ferro_backend.testing import run_ranks
from ferro_fsdp import DDP, FSDP, Module, Parameter, ShardingStrategy, nn, optim

FS = ShardingStrategy.FULL_SHARD
SGO = ShardingStrategy.SHARD_GRAD_OP
NS = ShardingStrategy.NO_SHARD
HS = ShardingStrategy.HYBRID_SHARD


def run(fn, world, timeout=60.0):
    """``fn(backend)`` on every rank of a simulated group; results by rank."""
    return run_ranks(fn, world, timeout=timeout)


class SeedModule(Module):
    """The seed's TestModule: one 1-d weight; forward(x) = x * sum(weight)."""

    def __init__(self, values, dtype=np.float32):
        super().__init__()
        self.weight = Parameter(np.array(values, dtype=dtype))
        self._x = None

    def forward(self, x):
        self._x = np.asarray(x)
        return self._x * self.weight.data.sum()

    def backward(self, g):
        g = np.asarray(g)
        self.weight.accumulate_grad(np.full(self.weight.data.shape, (g * self._x).sum(),
                                            dtype=self.weight.data.dtype))
        return g * self.weight.data.sum()


# sizes 7*13=91, 13, 13*5=65, 5: none divisible by 2 or 4
DIMS = (7, 13, 5)


def make_mlp(dims=DIMS, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1], dtype=dtype, rng=rng))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_data(n=16, dims=DIMS, seed=1, dtype=np.float64, classes=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dims[0])).astype(dtype)
    if classes:
        y = rng.integers(0, dims[-1], n)
    else:
        y = rng.standard_normal((n, dims[-1])).astype(dtype)
    return x, y


def make_opt(kind, params):
    if kind == "sgd":
        return optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2)
    if kind == "adam":
        return optim.Adam(params, lr=1e-2, weight_decay=1e-3)
    raise ValueError(kind)


def reference_training(opt_kind, steps, x, y, loss_kind="ce", dims=DIMS):
    """One process on the whole batch: the trajectory every distributed run must reproduce."""
    model = make_mlp(dims)
    opt = make_opt(opt_kind, model.parameters())
    loss_fn = nn.CrossEntropyLoss() if loss_kind == "ce" else nn.MSELoss()
    losses = []
    for _ in range(steps):
        losses.append(loss_fn(model(x), y))
        model.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
    return model.state_dict(), losses


def wrap(model, backend, strategy, intra=None):
    if strategy == "ddp":
        return DDP(model, backend)
    return FSDP(model, backend, strategy, intra_node_size=intra)


def train_steps(wrapper, opt, loss_fn, x, y, steps, *, prefetch=False, compute=None):
    """Train a wrapper on this rank's slice (x, y); returns the local losses."""
    losses = []
    for _ in range(steps):
        if prefetch:
            wrapper.prefetch_forward_params()
            if compute is not None:
                compute()
        losses.append(loss_fn(wrapper(x), y))
        wrapper.backward(loss_fn.backward())
        if isinstance(wrapper, FSDP):
            wrapper.sync_gradients()
        opt.step()
        opt.zero_grad()
        if isinstance(wrapper, FSDP):
            wrapper.broadcast_updated_params()
    return losses


def full_params(wrapper):
    if isinstance(wrapper, FSDP):
        return wrapper.full_state_dict()
    return wrapper.module.state_dict()


def assert_close_rel(a, b, rtol):
    a, b = np.asarray(a), np.asarray(b)
    scale = max(np.max(np.abs(b)), 1e-300)
    err = np.max(np.abs(a - b)) / scale if a.size else 0.0
    assert err <= rtol, f"relative error {err:.3e} > {rtol:.1e}"
    return err
