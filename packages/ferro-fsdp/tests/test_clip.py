"""clip_grad_norm_ on FSDP (every strategy) and DDP equals clipping the whole gradient of a
one-process run: the same norms, the same trajectory."""

import math

import numpy as np
import pytest
from _helpers import (
    assert_close_rel,
    full_params,
    make_data,
    make_mlp,
    make_opt,
    run,
    wrap,
)

from ferro_fsdp import FSDP, nn

STEPS, MAX_NORM = 4, 0.05


def reference(x, y):
    model = make_mlp()
    opt = make_opt("sgd", model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    norms = []
    for _ in range(STEPS):
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        grads = [p.grad for p in model.parameters()]
        norm = math.sqrt(sum(float(np.vdot(g, g)) for g in grads))
        norms.append(norm)
        scale = MAX_NORM / (norm + 1e-6)
        if scale < 1:
            for g in grads:
                g *= scale
        opt.step()
        opt.zero_grad()
    return model.state_dict(), norms


@pytest.mark.parametrize("strategy,world,intra", [
    ("full_shard", 2, None), ("full_shard", 4, None), ("shard_grad_op", 2, None),
    ("no_shard", 2, None), ("hybrid_shard", 4, 2), ("ddp", 2, None), ("ddp", 3, None)])
def test_clip_grad_norm_matches_one_process(strategy, world, intra):
    n = 12
    x, y = make_data(n)
    ref_params, ref_norms = reference(x, y)

    def body(b):
        per = n // world
        sl = slice(b.rank * per, (b.rank + 1) * per)
        w = wrap(make_mlp(), b, strategy, intra)
        opt = make_opt("sgd", w.module.parameters())
        loss_fn = nn.CrossEntropyLoss()
        norms = []
        for _ in range(STEPS):
            loss_fn(w(x[sl]), y[sl])
            w.backward(loss_fn.backward())
            if isinstance(w, FSDP):
                w.sync_gradients()
            norms.append(w.clip_grad_norm_(MAX_NORM))
            opt.step()
            opt.zero_grad()
            if isinstance(w, FSDP):
                w.broadcast_updated_params()
        return norms, full_params(w)

    results = run(body, world)
    for norms, params in results:
        assert norms == results[0][0]  # every rank: the same norm, bit for bit
        np.testing.assert_allclose(norms, ref_norms, rtol=1e-10)
        for name in ref_params:
            assert_close_rel(params[name], ref_params[name], 1e-10)
    assert min(ref_norms) > MAX_NORM  # the clip really happened


def test_bad_max_norm_is_refused():
    def body(b):
        w = wrap(make_mlp(), b, "full_shard")
        with pytest.raises(ValueError, match="max_norm -1"):
            w.clip_grad_norm_(-1)
        return True

    assert run(body, 2) == [True, True]
