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

from ferro_fsdp import DDP, FSDP, Module, Parameter, nn

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


@pytest.mark.parametrize("kind", ["ddp", "full_shard", "shard_grad_op", "no_shard"])
def test_nan_gradients_come_out_nan_and_numpy_numbers_are_max_norms(kind):
    # NaN gradients: the norm was NaN but the gradients were left as they were (`scale < 1`
    # is False for NaN); torch's clip_grad_norm_ makes them NaN. np.int64(1) and
    # np.float32(0.5) were refused as "not a number > 0"
    x, y = make_data(8)

    def body(b):
        w = wrap(make_mlp(), b, kind)
        loss_fn = nn.CrossEntropyLoss()
        norms = []
        for max_norm in (np.int64(1), 1, np.float32(0.1), float("inf")):
            w.module.zero_grad()
            loss_fn(w(x[4 * b.rank:4 * b.rank + 4]), y[4 * b.rank:4 * b.rank + 4])
            w.backward(loss_fn.backward())
            if isinstance(w, FSDP):
                w.sync_gradients()
            norms.append(w.clip_grad_norm_(max_norm))
            norms.append([p.grad.copy() for p in w.module.parameters()])
        first = next(p for p in w.module.parameters())
        first.grad.reshape(-1)[0] = np.nan
        nan_norm = w.clip_grad_norm_(1.0)
        with pytest.raises(ValueError, match="max_norm np.True_"):
            w.clip_grad_norm_(np.bool_(True))
        return norms, nan_norm, [p.grad for p in w.module.parameters()]

    for norms, nan_norm, grads in run(body, 2):
        assert math.isnan(nan_norm)
        assert all(np.isnan(g).all() for g in grads)
        (n1, g1), (n2, g2), (n3, g3), (n4, g4) = zip(norms[::2], norms[1::2])
        assert n1 == n2 == n3 == n4 > 0.1  # the same gradient each time (no step between)
        for a, c in zip(g1, g2):
            np.testing.assert_array_equal(a, c)  # np.int64(1) clips as 1 does
        assert not all(np.array_equal(a, c) for a, c in zip(g3, g4))  # np.float32(0.1) clips
        assert math.sqrt(sum(float(np.vdot(g, g)) for g in g3)) <= 0.1 * (1 + 1e-5)


def test_ddp_bucket_caps_take_numpy_numbers_and_refuse_non_finite():
    def body(b):
        DDP(make_mlp(), b, bucket_cap_mb=np.float32(1.0), first_bucket_cap_mb=np.int64(1))
        for bad in (float("inf"), float("nan"), np.bool_(True), "1"):
            with pytest.raises(ValueError, match="bucket_cap_mb"):
                DDP(make_mlp(), b, bucket_cap_mb=bad)
        return True

    assert run(body, 2) == [True, True]


class _Half(Module):
    """One float16 weight of 100 elements whose gradient is 30 everywhere: norm 300, whose
    squared sum (90000) is past float16's largest value."""

    def __init__(self):
        super().__init__()
        self.w = Parameter(np.zeros(100, np.float16))

    def forward(self, x):
        return x

    def backward(self, g):
        self.w.accumulate_grad(np.full(100, 30.0, np.float16))
        return g


@pytest.mark.parametrize("kind", ["ddp", "full_shard", "no_shard"])
def test_float16_gradients_sum_their_squares_without_overflow(kind):
    # the squared sum was np.vdot in float16: inf past a norm of 256, and every gradient was
    # scaled by max_norm / inf = 0. torch's clip_grad_norm_ returns 300 and scales by 1/300
    def body(b):
        w = wrap(_Half(), b, kind)
        w(np.zeros(1))
        w.backward(np.zeros(1))
        if isinstance(w, FSDP):
            w.sync_gradients()
        norm = w.clip_grad_norm_(1.0)
        return norm, w.module.w.grad.copy()

    for norm, grad in run(body, 2):
        assert norm == pytest.approx(300.0, rel=1e-6)
        assert grad.dtype == np.float16
        np.testing.assert_array_equal(grad, np.float16(30.0) * np.float16(1.0 / (300.0 + 1e-6)))
