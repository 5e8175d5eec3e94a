"""SGD and Adam against torch's update rules, written out independently."""

import numpy as np
import pytest

from ferro_fsdp import Parameter, optim


def run_opt(make, grads, p0):
    p = Parameter(np.array(p0, dtype=np.float64))
    opt = make([p])
    out = []
    for g in grads:
        p.grad = np.array(g, dtype=np.float64)
        opt.step()
        out.append(p.data.copy())
    return out, opt, p


def sgd_reference(p, grads, lr, momentum=0.0, wd=0.0, dampening=0.0, nesterov=False):
    p = np.array(p, dtype=np.float64)
    buf = None
    out = []
    for g in grads:
        d = np.asarray(g) + wd * p
        if momentum:
            buf = d.copy() if buf is None else momentum * buf + (1 - dampening) * d
            d = d + momentum * buf if nesterov else buf
        p = p - lr * d
        out.append(p)
    return out


def adam_reference(p, grads, lr, b1, b2, eps, wd):
    p = np.array(p, dtype=np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    out = []
    for t, g in enumerate(grads, start=1):
        d = np.asarray(g) + wd * p
        m = b1 * m + (1 - b1) * d
        v = b2 * v + (1 - b2) * d * d
        mhat = m / (1 - b1 ** t)
        vhat = v / (1 - b2 ** t)
        p = p - lr * mhat / (np.sqrt(vhat) + eps)
        out.append(p)
    return out


GRADS = np.random.default_rng(0).standard_normal((6, 5))
P0 = np.random.default_rng(1).standard_normal(5)


@pytest.mark.parametrize("kw", [{}, {"momentum": 0.9}, {"momentum": 0.9, "weight_decay": 0.1},
                                {"momentum": 0.5, "dampening": 0.3},
                                {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}])
def test_sgd_matches_torch_rule(kw):
    out, _, _ = run_opt(lambda ps: optim.SGD(ps, lr=0.1, **kw), GRADS, P0)
    ref = sgd_reference(P0, GRADS, 0.1, kw.get("momentum", 0.0), kw.get("weight_decay", 0.0),
                        kw.get("dampening", 0.0), kw.get("nesterov", False))
    for a, b in zip(out, ref):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_adam_matches_torch_rule(wd):
    out, opt, p = run_opt(lambda ps: optim.Adam(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6,
                                                weight_decay=wd), GRADS, P0)
    ref = adam_reference(P0, GRADS, 0.01, 0.8, 0.99, 1e-6, wd)
    for a, b in zip(out, ref):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    assert opt.state[p]["step"] == len(GRADS)


@pytest.mark.parametrize("make", [optim.Adam, optim.AdamW])
def test_adam_takes_a_complex_parameter_as_torch_does_two_real_ones(make):
    # torch.optim views a complex parameter as real pairs; d * d of a complex d was wrong
    rng = np.random.default_rng(2)
    p0 = rng.standard_normal(3) + 1j * rng.standard_normal(3)
    grads = rng.standard_normal((4, 3)) + 1j * rng.standard_normal((4, 3))
    p = Parameter(p0.copy())
    opt = make([p], lr=0.05, weight_decay=0.1)
    pairs = Parameter(np.stack([p0.real, p0.imag], axis=-1))
    twin = make([pairs], lr=0.05, weight_decay=0.1)
    for g in grads:
        p.grad = g.copy()
        pairs.grad = np.stack([g.real, g.imag], axis=-1)
        opt.step()
        twin.step()
    np.testing.assert_allclose(p.data.real, pairs.data[:, 0], rtol=1e-13)
    np.testing.assert_allclose(p.data.imag, pairs.data[:, 1], rtol=1e-13)


@pytest.mark.parametrize("make, kw", [(optim.Adam, {"lr": np.nan}), (optim.Adam, {"eps": np.nan}),
                                      (optim.AdamW, {"weight_decay": np.nan}),
                                      (optim.SGD, {"lr": np.nan}),
                                      (optim.SGD, {"lr": 0.1, "momentum": np.nan})], ids=str)
def test_a_nan_hyperparameter_is_refused(make, kw):
    with pytest.raises(ValueError, match="nan"):
        make([Parameter(np.ones(2))], **kw)


def test_adam_with_a_constant_gradient_moves_lr_per_step():
    # m_hat = g and v_hat = g^2 exactly, so each step moves lr * g / (|g| + eps)
    out, _, _ = run_opt(lambda ps: optim.Adam(ps, lr=0.1, eps=0.0), [np.full(3, 2.5)] * 4, np.zeros(3))
    np.testing.assert_allclose(out[-1], -0.4 * np.ones(3), rtol=1e-12)


def test_updates_in_place_and_skips_missing_grads():
    buf = np.zeros(6)
    a = Parameter(buf[:3])
    b = Parameter(np.ones(2))
    opt = optim.SGD([a, b], lr=1.0)
    a.grad = np.ones(3)
    opt.step()
    np.testing.assert_array_equal(buf[:3], -1.0)  # the view was updated, not replaced
    np.testing.assert_array_equal(b.data, 1.0)  # no grad: skipped
    assert b not in opt.state or not opt.state[b]


def test_zero_grad_lr_groups_and_errors():
    a, b = Parameter(np.ones(2)), Parameter(np.ones(2))
    opt = optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    a.grad = np.ones(2)
    b.grad = np.ones(2)
    opt.step()
    np.testing.assert_allclose(a.data, 0.9)
    np.testing.assert_allclose(b.data, 0.5)
    opt.zero_grad()
    assert a.grad is None
    opt.zero_grad(set_to_none=False)  # torch: a None gradient stays None, others become zeros
    assert a.grad is None
    a.grad = np.ones(2)
    opt.zero_grad(set_to_none=False)
    np.testing.assert_array_equal(a.grad, 0.0)
    opt.lr = 1.0
    assert opt.lr == 1.0 and opt.param_groups[1]["lr"] == 1.0
    with pytest.raises(ValueError):
        optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match="twice"):
        optim.SGD([a, a], lr=0.1)
    with pytest.raises(TypeError):
        optim.SGD([np.ones(2)], lr=0.1)
    with pytest.raises(ValueError):
        optim.SGD([a], lr=0.1, nesterov=True)
    with pytest.raises(ValueError):
        optim.Adam([a], betas=(1.0, 0.9))
    a.grad = np.ones(3)
    with pytest.raises(ValueError, match="shape"):
        optim.SGD([a], lr=0.1).step()
    frozen = Parameter(np.ones(2))
    frozen.data.flags.writeable = False
    frozen.grad = np.ones(2)
    with pytest.raises(ValueError, match="read-only"):
        optim.SGD([frozen], lr=0.1).step()


def test_state_dict_round_trip_continues_identically():
    def make(ps):
        return optim.Adam(ps, lr=0.01)

    out, opt, p = run_opt(make, GRADS[:3], P0)
    sd = opt.state_dict()
    assert sd["state"][0]["step"] == 3 and sd["param_groups"][0]["params"] == [0]
    q = Parameter(p.data.copy())
    opt2 = make([q])
    opt2.load_state_dict(sd)
    for g in GRADS[3:]:
        p.grad = g.copy()
        q.grad = g.copy()
        opt.step()
        opt2.step()
    np.testing.assert_array_equal(p.data, q.data)
    with pytest.raises(ValueError, match="groups"):
        make([Parameter(np.ones(1)), Parameter(np.ones(1))]).load_state_dict(sd)


@pytest.mark.parametrize("make,key", [
    (lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9), "momentum_buffer"),
    (lambda ps: optim.Adam(ps, lr=0.01), "exp_avg"),
    (lambda ps: optim.AdamW(ps, lr=0.01), "exp_avg_sq")])
def test_a_state_the_step_cannot_take_is_refused_and_nothing_changes(make, key):
    """A state array of another size (another world's shard) would have the compiled step
    read and write past its end (a crash); an incomplete Adam state would lose its moments."""
    p = Parameter(np.ones(4096, np.float32))
    opt = make([p])
    p.grad = np.ones_like(p.data)
    opt.step()
    sd = opt.state_dict()
    before = opt.state_dict()
    short = {**sd, "state": {0: {**sd["state"][0], key: np.zeros(64, np.float32)}}}
    with pytest.raises(ValueError, match=rf"parameter 0's '{key}' has shape \(64,\), its "
                                         r"parameter \(4096,\)"):
        opt.load_state_dict(short)
    after = opt.state_dict()
    assert all(np.array_equal(after["state"][0][k], v) for k, v in before["state"][0].items())
    if isinstance(opt, optim.Adam):
        for gone in ("step", "exp_avg_sq"):
            partial = {**sd, "state": {0: {k: v for k, v in sd["state"][0].items() if k != gone}}}
            with pytest.raises(ValueError, match=rf"parameter 0's state lacks \['{gone}'\]"):
                opt.load_state_dict(partial)
    opt.load_state_dict({**sd, "state": {0: {}}})  # nothing yet: as a parameter never stepped


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dtype_is_kept(dtype):
    p = Parameter(np.ones(3, dtype))
    for opt in (optim.SGD([p], lr=0.1, momentum=0.9), optim.Adam([p])):
        p.grad = np.ones(3, dtype)
        opt.step()
        assert p.data.dtype == dtype
        assert all(v.dtype == dtype for v in opt.state[p].values() if isinstance(v, np.ndarray))


# ------------------------------------------------------------------------------ AdamW vs torch
def torch_trajectory(make_torch, p0, grads):
    import torch

    p = torch.nn.Parameter(torch.from_numpy(np.array(p0, copy=True)))
    opt = make_torch([p])
    out = []
    for g in grads:
        p.grad = torch.from_numpy(np.array(g, copy=True))
        opt.step()
        out.append(p.detach().numpy().copy())
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.0}, {"weight_decay": 0.3, "lr": 0.05},
                                {"betas": (0.8, 0.95), "eps": 1e-4, "weight_decay": 0.1}])
@pytest.mark.timeout(300)  # 10-20 s on a loaded CI lane (torch's import): past 120 s is a hang
def test_adamw_matches_torch(kw, dtype):
    import torch

    grads = GRADS.astype(dtype)
    p0 = P0.astype(dtype)
    p = Parameter(p0.copy())
    opt = optim.AdamW([p], **kw)
    ours = []
    for g in grads:
        p.grad = g.copy()
        opt.step()
        ours.append(p.data.copy())
    ref = torch_trajectory(lambda ps: torch.optim.AdamW(ps, **kw), p0, grads)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-14}
    for a, b in zip(ours, ref):
        assert a.dtype == dtype
        np.testing.assert_allclose(a, b, **tol)
    assert opt.state[p]["step"] == len(GRADS)


def test_adamw_defaults_differ_from_adam_only_in_the_decay():
    p, q = Parameter(P0.copy()), Parameter(P0.copy())
    adamw = optim.AdamW([p])
    assert adamw.defaults == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
    adam = optim.Adam([q], weight_decay=0.0)
    adamw.param_groups[0]["weight_decay"] = 0.0   # no decay: the same update bit for bit
    for g in GRADS:
        p.grad, q.grad = g.copy(), g.copy()
        adamw.step()
        adam.step()
    np.testing.assert_array_equal(p.data, q.data)
    assert isinstance(adamw, optim.Adam) and adamw.array_state_keys == ("exp_avg", "exp_avg_sq")
    with pytest.raises(ValueError, match="AdamW: invalid"):
        optim.AdamW([p], weight_decay=-1.0)


def test_adamw_param_groups_state_dict_and_zero_grad():
    import torch

    a, b = Parameter(P0.copy()), Parameter(P0[:3].copy())
    groups = [{"params": [a]}, {"params": [b], "lr": 0.1, "weight_decay": 0.5}]
    opt = optim.AdamW(groups, lr=0.01)
    ta = torch.nn.Parameter(torch.from_numpy(P0.copy()))
    tb = torch.nn.Parameter(torch.from_numpy(P0[:3].copy()))
    topt = torch.optim.AdamW([{"params": [ta]}, {"params": [tb], "lr": 0.1, "weight_decay": 0.5}],
                             lr=0.01)
    for g in GRADS[:3]:
        a.grad, b.grad = g.copy(), g[:3].copy()
        ta.grad, tb.grad = torch.from_numpy(g.copy()), torch.from_numpy(g[:3].copy())
        opt.step()
        topt.step()
        opt.zero_grad()
        assert a.grad is None and b.grad is None
    sd = opt.state_dict()
    a2, b2 = Parameter(a.data.copy()), Parameter(b.data.copy())
    opt2 = optim.AdamW([{"params": [a2]}, {"params": [b2]}], lr=0.01)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[1]["weight_decay"] == 0.5 and opt2.state[a2]["step"] == 3
    for g in GRADS[3:]:
        for p, t in ((a2, ta), (b2, tb)):
            p.grad = g[:p.size].copy()
            t.grad = torch.from_numpy(g[:p.size].copy())
        opt2.step()
        topt.step()
    np.testing.assert_allclose(a2.data, ta.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(b2.data, tb.detach().numpy(), rtol=1e-12, atol=1e-14)
