"""Real processes: FSDP and DDP training over TcpBackend matches one process on the whole batch."""

import os

import numpy as np
import pytest
from _helpers import assert_close_rel, make_data, reference_training

from ferro_backend.testing import run_job

BODY = """
sys.path.insert(0, {tests!r})
from _helpers import full_params, make_data, make_mlp, make_opt, train_steps, wrap
from ferro_fsdp import nn

world = b.world_size
x, y = make_data(16)
per = 16 // world
sl = slice(b.rank * per, (b.rank + 1) * per)
strategy = sys.argv[1]
w = wrap(make_mlp(), b, strategy, 2 if strategy == "hybrid_shard" else None)
opt = make_opt("adam", w.module.parameters())
train_steps(w, opt, nn.CrossEntropyLoss(), x[sl], y[sl], 6, prefetch=strategy == "full_shard")
np.savez(sys.argv[2] + f"/rank{{b.rank}}.npz", **full_params(w))
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy,world", [("full_shard", 2), ("hybrid_shard", 4), ("ddp", 2)])
def test_training_over_tcp_processes(tmp_path, strategy, world):
    body = BODY.format(tests=os.path.dirname(os.path.abspath(__file__)))
    run_job(body, world, timeout=60.0, args=[strategy, tmp_path])
    x, y = make_data(16)
    ref, _ = reference_training("adam", 6, x, y)
    for r in range(world):
        got = np.load(tmp_path / f"rank{r}.npz")
        for name in ref:
            assert_close_rel(got[name], ref[name], 1e-10)
