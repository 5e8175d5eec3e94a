"""Layers and losses: gradients checked against central finite differences, float32 and float64."""

import numpy as np
import pytest

from ferro_fsdp import Module, nn


def numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


def check_module(module: Module, x, loss_fn, target, tol=1e-6):
    """Analytic grads of loss(module(x)) wrt x and every parameter vs finite differences."""
    x = x.copy()

    def loss():
        return loss_fn(module(x), target)

    loss()
    module.zero_grad()
    gx = module.backward(loss_fn.backward())
    np.testing.assert_allclose(gx, numeric_grad(loss, x), rtol=tol, atol=tol)
    for name, p in module.named_parameters():
        np.testing.assert_allclose(p.grad, numeric_grad(loss, p.data), rtol=tol, atol=tol,
                                   err_msg=name)


def mlp(dtype=np.float64, bias=True):
    return nn.Sequential(nn.Linear(4, 6, bias=bias, dtype=dtype, rng=0), nn.ReLU(),
                         nn.Linear(6, 3, bias=bias, dtype=dtype, rng=1))


@pytest.mark.parametrize("bias", [True, False])
def test_mlp_with_cross_entropy_gradients(bias):
    rng = np.random.default_rng(0)
    check_module(mlp(bias=bias), rng.standard_normal((5, 4)), nn.CrossEntropyLoss(),
                 rng.integers(0, 3, 5))


def test_mlp_with_mse_gradients():
    rng = np.random.default_rng(1)
    check_module(mlp(), rng.standard_normal((5, 4)), nn.MSELoss(), rng.standard_normal((5, 3)))


def test_linear_on_3d_input_and_sum_reduction():
    rng = np.random.default_rng(2)
    check_module(nn.Linear(4, 3, dtype=np.float64, rng=3), rng.standard_normal((2, 5, 4)),
                 nn.MSELoss(reduction="sum"), rng.standard_normal((2, 5, 3)))


def test_cross_entropy_with_probabilities():
    rng = np.random.default_rng(3)
    t = rng.random((5, 3))
    t /= t.sum(axis=1, keepdims=True)
    check_module(mlp(), rng.standard_normal((5, 4)), nn.CrossEntropyLoss(), t)


def test_cross_entropy_values():
    z = np.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    t = np.array([2, 0])
    expected = np.mean([-np.log(np.exp(3) / np.exp([1, 2, 3]).sum()), np.log(3.0)])
    assert nn.CrossEntropyLoss()(z, t) == pytest.approx(expected, rel=1e-12)
    # large logits stay finite
    assert np.isfinite(nn.CrossEntropyLoss()(np.array([[1000.0, -1000.0]]), np.array([1])))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dtype_is_preserved(dtype):
    model = mlp(dtype)
    x = np.ones((2, 4), dtype)
    out = model(x)
    assert out.dtype == dtype
    loss_fn = nn.CrossEntropyLoss()
    loss = loss_fn(out, np.array([0, 1]))
    assert isinstance(loss, float)
    g = loss_fn.backward()
    assert g.dtype == dtype
    gx = model.backward(g)
    assert gx.dtype == dtype
    assert all(p.grad.dtype == dtype for p in model.parameters())
    mse = nn.MSELoss()
    mse(out, np.zeros_like(out))
    assert mse.backward().dtype == dtype


def test_float32_gradients_roughly():
    rng = np.random.default_rng(4)
    m32 = mlp(np.float32)
    m64 = mlp(np.float64)
    x = rng.standard_normal((5, 4))
    t = rng.integers(0, 3, 5)
    for m, xx in ((m32, x.astype(np.float32)), (m64, x)):
        f = nn.CrossEntropyLoss()
        f(m(xx), t)
        m.backward(f.backward())
    for p32, p64 in zip(m32.parameters(), m64.parameters()):
        np.testing.assert_allclose(p32.grad, p64.grad, rtol=1e-4, atol=1e-6)


def test_gradients_accumulate_until_zero_grad():
    m = nn.Linear(2, 2, dtype=np.float64, rng=0)
    x = np.ones((1, 2))
    m(x)
    m.backward(np.ones((1, 2)))
    first = m.weight.grad.copy()
    m(x)
    m.backward(np.ones((1, 2)))
    np.testing.assert_allclose(m.weight.grad, 2 * first)


def test_relu_gradient_at_zero_is_zero():
    r = nn.ReLU()
    np.testing.assert_array_equal(r(np.array([-1.0, 0.0, 2.0])), [0.0, 0.0, 2.0])
    np.testing.assert_array_equal(r.backward(np.ones(3)), [0.0, 0.0, 1.0])


def test_errors():
    relu = nn.ReLU()
    relu(np.ones(3))
    with pytest.raises(ValueError, match=r"ReLU.backward: grad_output of shape \(2, 3\)"):
        relu.backward(np.ones((2, 3)))  # it was broadcast against the input
    with pytest.raises(ValueError):
        nn.Linear(0, 2)
    with pytest.raises(TypeError):
        nn.Linear(2, 2, dtype=np.int32)
    lin = nn.Linear(3, 2)
    with pytest.raises(RuntimeError, match="before forward"):
        lin.backward(np.ones((1, 2)))
    with pytest.raises(ValueError, match="last dimension 3"):
        lin(np.ones((1, 4)))
    with pytest.raises(RuntimeError):
        nn.ReLU().backward(np.ones(1))
    with pytest.raises(RuntimeError):
        nn.MSELoss().backward()
    with pytest.raises(ValueError, match="shape"):
        nn.MSELoss()(np.ones(2), np.ones(3))
    with pytest.raises(ValueError, match="out of range"):
        nn.CrossEntropyLoss()(np.ones((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="reduction"):
        nn.MSELoss(reduction="none")


def test_sequential_container():
    s = mlp()
    assert len(s) == 3
    assert isinstance(s[1], nn.ReLU)
    assert [type(m).__name__ for m in s] == ["Linear", "ReLU", "Linear"]
    assert [n for n, _ in s.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert nn.Linear(4, 6, rng=0).weight.dtype == np.float32  # torch's default dtype


# ----------------------------------------------------------------------------- NaN propagation
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_keeps_nan_like_np_maximum(dtype):
    x = np.array([np.nan, -1.0, 0.0, 2.0, -np.inf, np.inf], dtype=dtype)
    y = nn.ReLU()(x)
    np.testing.assert_array_equal(y, np.maximum(x, 0))  # NaN compares equal to NaN here
    assert np.isnan(y[0]) and y.dtype == dtype


def test_relu_backward_at_nan_input_passes_the_gradient_like_torch():
    r = nn.ReLU()
    r(np.array([np.nan, -1.0, 0.0, 2.0]))
    np.testing.assert_array_equal(r.backward(np.array([5.0, 5.0, 5.0, 5.0])), [5.0, 0.0, 0.0, 5.0])
    # a NaN upstream gradient stays NaN where the gradient passes
    g = r.backward(np.array([np.nan, np.nan, np.nan, np.nan]))
    assert np.isnan(g[[0, 3]]).all() and (g[[1, 2]] == 0).all()


def test_nan_in_a_network_reaches_the_loss():
    model = nn.Sequential(nn.Linear(3, 4, rng=0), nn.ReLU(), nn.Linear(4, 2, rng=1))
    x = np.ones((2, 3), np.float32)
    x[0, 1] = np.nan
    out = model(x)
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
    assert np.isnan(nn.MSELoss()(out, np.zeros_like(out)))
    assert np.isnan(nn.CrossEntropyLoss()(out, np.array([0, 1])))


@pytest.mark.parametrize("target", [np.array([0, 1]), np.array([[1.0, 0.0], [0.0, 1.0]])])
def test_cross_entropy_keeps_nan_logits(target):
    z = np.array([[np.nan, 1.0], [0.5, -0.5]])
    loss_fn = nn.CrossEntropyLoss()
    assert np.isnan(loss_fn(z, target))
    g = loss_fn.backward()
    assert np.isnan(g[0]).all() and np.isfinite(g[1]).all()


def test_mse_keeps_nan():
    loss_fn = nn.MSELoss()
    assert np.isnan(loss_fn(np.array([np.nan, 1.0]), np.array([0.0, 1.0])))
    assert np.isnan(loss_fn.backward()[0])
    assert np.isnan(loss_fn(np.array([0.0, 1.0]), np.array([np.nan, 1.0])))


def test_linear_without_input_grad_skips_it_and_keeps_the_parameter_grads():
    from ferro_fsdp import nn as fnn

    x = np.random.default_rng(0).standard_normal((4, 3))
    a = fnn.Linear(3, 2, rng=1, dtype=np.float64)
    b = fnn.Linear(3, 2, rng=1, dtype=np.float64, input_grad=False)
    g = np.ones((4, 2))
    a(x), b(x)
    assert a.backward(g) is not None and b.backward(g) is None
    np.testing.assert_array_equal(a.weight.grad, b.weight.grad)
    np.testing.assert_array_equal(a.bias.grad, b.bias.grad)
    first = fnn.Sequential(fnn.Linear(3, 4, rng=2, input_grad=False), fnn.ReLU(),
                           fnn.Linear(4, 2, rng=3))
    first(x.astype(np.float32))
    assert first.backward(np.ones((4, 2), np.float32)) is None
    bad = fnn.Sequential(fnn.ReLU(), fnn.Linear(3, 2, rng=4, input_grad=False))
    bad(x.astype(np.float32))
    with pytest.raises(ValueError, match="ReLU comes before a layer with input_grad=False"):
        bad.backward(np.ones((4, 2), np.float32))
