"""Real processes: FSDP and DDP training over TcpBackend matches one process on the whole batch."""

import pytest
from _helpers import (
    assert_close_rel,
    full_params,
    make_data,
    make_mlp,
    make_opt,
    reference_training,
    train_steps,
    wrap,
)

from ferro_backend.testing import run_processes
from ferro_fsdp import nn

N, STEPS = 16, 6


def train_rank(b, strategy):
    """One rank of the job: train on this rank's slice of the batch, return the full parameters."""
    x, y = make_data(N)
    per = N // b.world_size
    sl = slice(b.rank * per, (b.rank + 1) * per)
    w = wrap(make_mlp(), b, strategy, 2 if strategy == "hybrid_shard" else None)
    opt = make_opt("adam", w.module.parameters())
    train_steps(w, opt, nn.CrossEntropyLoss(), x[sl], y[sl], STEPS,
                prefetch=strategy == "full_shard")
    return full_params(w)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy,world", [("full_shard", 2), ("hybrid_shard", 4), ("ddp", 2)])
def test_training_over_tcp_processes(strategy, world):
    results = run_processes(train_rank, world, strategy, transport="tcp", timeout=120.0)
    x, y = make_data(N)
    ref, _ = reference_training("adam", STEPS, x, y)
    for got in results:
        for name in ref:
            assert_close_rel(got[name], ref[name], 1e-10)
