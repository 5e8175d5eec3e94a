"""The fused compiled optimizer step (ferro_fsdp._optim_step) against the numpy step it replaces
(the same optimizer with ``fused=False``), on one flat parameter of 64 Ki elements (in cache)
and of 4 Mi elements; and the compiled GELU (ferro_fsdp._gelu: vectorized, without the GIL),
exact and tanh-approximated, forward and backward, against the best numpy formulations.

Both produce the same bits (tests/test_optim_step.py); the compiled step reads and writes each
array once, where the numpy step makes a pass (and often a temporary) per operation. Each group
pairs ``numpy`` (the baseline) with ``ferro`` for one optimizer, dtype and size.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ferro_fsdp import Parameter, _gelu, optim

CONFIGS = {
    "sgd_momentum_wd": lambda ps, fused: optim.SGD(ps, lr=0.01, momentum=0.9, weight_decay=1e-4,
                                                   fused=fused),
    "adam": lambda ps, fused: optim.Adam(ps, lr=1e-3, fused=fused),
    "adamw": lambda ps, fused: optim.AdamW(ps, lr=1e-3, fused=fused),
}


def _label(n: int) -> str:
    return f"{n >> 20}Mi" if n >= 1 << 20 else f"{n >> 10}Ki"


@pytest.mark.parametrize("size", [1 << 16, 1 << 22], ids=_label)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("impl", ["numpy", "ferro"])
def bench_optimizer_step(benchmark, config, dtype, size, impl):
    benchmark.group = f"{config} step {dtype} {_label(size)} elements"
    benchmark.extra_info["role"] = "baseline" if impl == "numpy" else "ferro"
    rng = np.random.default_rng(0)
    p = Parameter(rng.standard_normal(size).astype(dtype))
    p.grad = rng.standard_normal(size).astype(dtype) * 1e-3
    opt = CONFIGS[config]([p], impl == "ferro")
    arrays = 2 + len(optim.SGD.array_state_keys if config.startswith("sgd")
                     else optim.Adam.array_state_keys)
    benchmark.extra_info["bytes"] = size * np.dtype(dtype).itemsize * arrays
    opt.step()                                   # create the state outside the timing
    benchmark(opt.step)
    # check after timing: the other implementation, from the same start, gives the same bits
    q = Parameter(rng.standard_normal(64).astype(dtype))
    r = Parameter(q.data.copy())
    a, b = CONFIGS[config]([q], True), CONFIGS[config]([r], False)
    for _ in range(3):
        q.grad = r.grad = rng.standard_normal(64).astype(dtype)
        a.step()
        b.step()
    np.testing.assert_array_equal(q.data, r.data)


# ------------------------------------------------------------------------------ GELU (_gelu)
_SQRT1_2 = 1.0 / np.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / np.sqrt(2.0 * np.pi)
_ERF = np.vectorize(math.erf, otypes=[np.float64])   # numpy has no erf: one call per element


def _gelu_erf_numpy(x):
    """Exact GELU in numpy: ``x * Phi(x)`` with a per-element ``math.erf``, rounded once."""
    cdf = 0.5 * (1.0 + _ERF(x.astype(np.float64) * _SQRT1_2))
    return (x * cdf).astype(x.dtype), cdf.astype(x.dtype)


_K, _C = math.sqrt(2.0 / math.pi), 0.044715   # Python floats: float32 stays float32


def _gelu_tanh_numpy(x):
    """torch's tanh approximation, all in numpy ufuncs (no erf needed); ``x * x * x``, not
    ``x ** 3`` (a pow call per element: 7-10x slower here)."""
    return 0.5 * x * (1.0 + np.tanh(_K * (x + _C * (x * x * x))))


def _gelu_tanh_backward_numpy(g, x):
    t = np.tanh(_K * (x + _C * (x * x * x)))
    return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * (_K * (1.0 + 3 * _C * (x * x))))


def _gelu_ferro(x, out, cdf):
    _gelu.gelu_forward(x, out, cdf)
    return out


@pytest.mark.parametrize("size", [1 << 16, 1 << 20], ids=_label)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("against", ["numpy_vectorize_erf", "numpy_tanh_approx"])
@pytest.mark.parametrize("impl", ["reference", "ferro"])
def bench_gelu_forward(benchmark, against, dtype, size, impl):
    """Exact GELU forward, compiled (_gelu.gelu_forward) against the exact numpy reference
    (vectorized math.erf), and against numpy's tanh approximation (cheaper math, not the same
    function): each group pairs one reference (the baseline) with ferro."""
    benchmark.group = f"gelu forward {dtype} {_label(size)} elements vs {against}"
    benchmark.extra_info["role"] = "baseline" if impl == "reference" else "ferro"
    x = np.random.default_rng(0).standard_normal(size).astype(dtype) * 3
    out, cdf = np.empty_like(x), np.empty_like(x)
    if impl == "ferro":
        benchmark(_gelu_ferro, x, out, cdf)
    elif against == "numpy_vectorize_erf":
        benchmark(_gelu_erf_numpy, x)
    else:
        benchmark(_gelu_tanh_numpy, x)
    # after timing: the compiled kernel is the exact GELU, as the erf reference computes it
    ref, ref_cdf = _gelu_erf_numpy(x[:4096])
    _gelu.gelu_forward(x[:4096], out[:4096], cdf[:4096])
    tol = 1e-6 if dtype == "float32" else 1e-14
    np.testing.assert_allclose(out[:4096], ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(cdf[:4096], ref_cdf, rtol=tol, atol=tol)


def _gelu_backward_numpy(g, x, cdf):
    return g * (cdf + x * np.exp(-0.5 * x * x) * x.dtype.type(_INV_SQRT_2PI))


@pytest.mark.parametrize("size", [1 << 16, 1 << 20], ids=_label)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("impl", ["numpy", "ferro"])
def bench_gelu_backward(benchmark, dtype, size, impl):
    """GELU backward from the saved ``Phi(x)``: compiled (_gelu.gelu_backward, one pass) against
    the same formula in numpy ufuncs (a temporary per operation)."""
    benchmark.group = f"gelu backward {dtype} {_label(size)} elements"
    benchmark.extra_info["role"] = "baseline" if impl == "numpy" else "ferro"
    rng = np.random.default_rng(1)
    x = rng.standard_normal(size).astype(dtype) * 3
    g = rng.standard_normal(size).astype(dtype)
    _, cdf = _gelu_erf_numpy(x)
    out = np.empty_like(x)
    if impl == "ferro":
        benchmark(_gelu.gelu_backward, g, x, cdf, out)
    else:
        benchmark(_gelu_backward_numpy, g, x, cdf)
    _gelu.gelu_backward(g, x, cdf, out)
    tol = 1e-5 if dtype == "float32" else 1e-13
    np.testing.assert_allclose(out, _gelu_backward_numpy(g.astype(np.float64),
                                                         x.astype(np.float64),
                                                         cdf.astype(np.float64)),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("size", [1 << 16, 1 << 20], ids=_label)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("impl", ["numpy", "ferro"])
def bench_gelu_tanh_forward(benchmark, dtype, size, impl):
    """GELU with torch's tanh approximation: compiled (_gelu.gelu_tanh_forward) against the same
    formula in numpy ufuncs."""
    benchmark.group = f"gelu tanh forward {dtype} {_label(size)} elements"
    benchmark.extra_info["role"] = "baseline" if impl == "numpy" else "ferro"
    x = np.random.default_rng(0).standard_normal(size).astype(dtype) * 3
    out = np.empty_like(x)
    if impl == "ferro":
        benchmark(_gelu.gelu_tanh_forward, x, out)
    else:
        benchmark(_gelu_tanh_numpy, x)
    _gelu.gelu_tanh_forward(x, out)
    tol = 2e-6 if dtype == "float32" else 1e-13
    np.testing.assert_allclose(out, _gelu_tanh_numpy(x.astype(np.float64)), rtol=tol, atol=tol)


@pytest.mark.parametrize("size", [1 << 16, 1 << 20], ids=_label)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("impl", ["numpy", "ferro"])
def bench_gelu_tanh_backward(benchmark, dtype, size, impl):
    """Its backward: compiled (_gelu.gelu_tanh_backward, from x alone) against numpy ufuncs."""
    benchmark.group = f"gelu tanh backward {dtype} {_label(size)} elements"
    benchmark.extra_info["role"] = "baseline" if impl == "numpy" else "ferro"
    rng = np.random.default_rng(1)
    x = rng.standard_normal(size).astype(dtype) * 3
    g = rng.standard_normal(size).astype(dtype)
    out = np.empty_like(x)
    if impl == "ferro":
        benchmark(_gelu.gelu_tanh_backward, g, x, out)
    else:
        benchmark(_gelu_tanh_backward_numpy, g, x)
    _gelu.gelu_tanh_backward(g, x, out)
    tol = 1e-5 if dtype == "float32" else 1e-13
    np.testing.assert_allclose(out, _gelu_tanh_backward_numpy(g.astype(np.float64),
                                                              x.astype(np.float64)),
                               rtol=tol, atol=tol)
