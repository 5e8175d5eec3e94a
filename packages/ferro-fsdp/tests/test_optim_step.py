"""The compiled optimizer step (_optim_step.pyx): the same bits as the numpy step, for SGD,
Adam and AdamW, float32 and float64; the optimizers use it whenever the arrays allow."""

import importlib.machinery

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ferro_fsdp.optim as optim_mod
from ferro_fsdp import Parameter, _optim_step, optim

CONFIGS = [
    ("sgd", {"lr": 0.1}),
    ("sgd", {"lr": 0.1, "momentum": 0.9}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}),
    ("sgd", {"lr": 0.1, "momentum": 0.5, "dampening": 0.3, "weight_decay": 0.01}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("adam", {"lr": 0.01}),
    ("adam", {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05}),
    ("adamw", {}),
    ("adamw", {"lr": 0.02, "betas": (0.85, 0.95), "weight_decay": 0.3}),
]
MAKE = {"sgd": optim.SGD, "adam": optim.Adam, "adamw": optim.AdamW}


def trajectory(kind, kw, p0, grads, fused):
    p = Parameter(p0.copy())
    opt = MAKE[kind]([p], fused=fused, **kw)
    for g in grads:
        p.grad = g
        opt.step()
    return p.data, opt.state.get(p, {})


def assert_same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_the_step_kernel_is_compiled_and_the_one_in_use():
    assert _optim_step.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    assert optim_mod._optim_step is _optim_step


@pytest.mark.parametrize("kind,kw", CONFIGS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_step_gives_the_bits_of_the_numpy_step(kind, kw, dtype):
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal((7, 9)).astype(dtype)
    grads = [rng.standard_normal((7, 9)).astype(dtype) for _ in range(5)]
    fused, fused_state = trajectory(kind, kw, p0, grads, True)
    ref, ref_state = trajectory(kind, kw, p0, grads, False)
    assert_same_bits(fused, ref)
    assert fused_state.keys() == ref_state.keys()
    for k, v in ref_state.items():
        if isinstance(v, np.ndarray):
            assert_same_bits(fused_state[k], v)
        else:
            assert fused_state[k] == v


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(0, 6), min_size=1, max_size=3), config=st.sampled_from(CONFIGS),
       dtype=st.sampled_from([np.float32, np.float64]), scale=st.sampled_from([1e-30, 1.0, 1e20]))
def test_fused_step_bits_over_shapes_and_magnitudes(shape, config, dtype, scale):
    rng = np.random.default_rng(len(shape))
    p0 = (rng.standard_normal(shape) * scale).astype(dtype)
    grads = [(rng.standard_normal(shape) * scale).astype(dtype) for _ in range(3)]
    kind, kw = config
    with np.errstate(all="ignore"):                     # 1e20 squared overflows float32: inf
        assert_same_bits(trajectory(kind, kw, p0, grads, True)[0],
                         trajectory(kind, kw, p0, grads, False)[0])


class Counting:
    """Stands in for the kernel module: counts the calls, then runs the real kernel."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        real = getattr(_optim_step, name)

        def run(*args):
            self.calls.append(name)
            return real(*args)
        return run


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_optimizers_call_the_kernel_when_the_arrays_allow(kind, monkeypatch):
    counting = Counting()
    monkeypatch.setattr(optim_mod, "_optim_step", counting)
    kw = {"lr": 0.1, "momentum": 0.9} if kind == "sgd" else {}
    contiguous = Parameter(np.ones((3, 4), np.float32))
    strided = Parameter(np.ones((4, 6))[:, ::2])        # not C-contiguous: numpy step
    wide = Parameter(np.ones(3, np.float16))            # not float32/64: numpy step
    opt = MAKE[kind]([contiguous, strided, wide], **kw)
    for p in (contiguous, strided, wide):
        p.grad = np.ones(p.shape, p.dtype)
    opt.step()
    # SGD's first momentum step creates the buffer (numpy's copy of d); Adam's is the kernel's
    expected = ["sgd_step"] if kind == "sgd" else ["adam_step"] * 2
    readonly = np.ones((3, 4), np.float32)
    readonly.flags.writeable = False                     # a read-only gradient is fine
    contiguous.grad = readonly
    opt.step()
    assert counting.calls == expected
    MAKE[kind]([contiguous], fused=False, **kw).step()   # the numpy step, on request
    assert counting.calls == expected
    plain = optim.SGD([contiguous], lr=0.1)              # no momentum: the kernel from step 1
    plain.step()
    assert counting.calls == [*expected, "sgd_step"]


def test_fused_and_numpy_state_dicts_are_interchangeable():
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(5) for _ in range(6)]
    a, b = Parameter(np.zeros(5)), Parameter(np.zeros(5))
    fused, plain = optim.AdamW([a]), optim.AdamW([b], fused=False)
    for g in grads[:3]:
        a.grad, b.grad = g, g
        fused.step()
        plain.step()
    fused.load_state_dict(plain.state_dict())
    for g in grads[3:]:
        a.grad, b.grad = g, g
        fused.step()
        plain.step()
    assert_same_bits(a.data, b.data)


@pytest.mark.parametrize("kind,kw", CONFIGS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_step_bits_with_nan_inf_and_signed_zeros(kind, kw, dtype):
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 1e-40, 3e38], dtype)
    p0 = np.tile(special, len(special))
    grads = [np.repeat(special, len(special)), np.tile(special[::-1], len(special))]
    with np.errstate(all="ignore"):
        assert_same_bits(trajectory(kind, kw, p0, grads, True)[0],
                         trajectory(kind, kw, p0, grads, False)[0])


def test_the_kernels_share_one_compiled_cython_utility_module():
    """Cython's utility code (memoryviews) is built once per distribution and imported by each
    kernel as it loads, not compiled into every kernel."""
    import sys

    import ferro_fsdp._gelu  # noqa: F401

    util = sys.modules["ferro_fsdp._cyutility"]
    assert util.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind,key", [("sgd", "momentum_buffer"), ("adam", "exp_avg"),
                                      ("adamw", "exp_avg_sq")])
def test_a_state_array_of_another_shape_is_refused_by_the_step(kind, key, fused):
    # the compiled step looped over the parameter's length and indexed the state with it: a
    # 2-element buffer on a 1000-element parameter was read and written past its end
    # (memory corruption), a longer one silently used its first elements; the numpy step
    # failed on broadcasting. Now both refuse it before anything is written
    p = Parameter(np.zeros(1000))
    opt = MAKE[kind]([p], fused=fused, **({"lr": 0.1, "momentum": 0.9} if kind == "sgd" else {}))
    p.grad = np.ones(1000)
    opt.step()
    before = p.data.copy()
    guard = np.full(4000, 7.0)
    opt.state[p][key] = guard[:2]  # a 2-element buffer inside a larger block
    with pytest.raises(ValueError, match=rf"{type(opt).__name__}\.step: parameter 0's "
                                         rf"'{key}' has shape \(2,\), its parameter \(1000,\)"):
        opt.step()
    assert (guard == 7.0).all()
    np.testing.assert_array_equal(p.data, before)
    opt.state[p][key] = np.zeros(2000)[::2]  # the right shape, not contiguous: the numpy step
    opt.step()


@pytest.mark.parametrize("fused", [True, False])
def test_momentum_from_before_fsdp_wrapping_is_refused_on_every_rank(fused):
    # an SGD that stepped the full parameters keeps full-size buffers; after FULL_SHARD the
    # fused step used each buffer's first chunk on every rank (rank 1 took rank 0's momentum)
    from _helpers import run

    from ferro_fsdp import FSDP, nn

    def body(b):
        m = nn.Sequential(nn.Linear(4, 4, rng=0, dtype=np.float64))
        opt = optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=fused)
        loss_fn, x = nn.MSELoss(), np.arange(8.0).reshape(2, 4)
        loss_fn(m(x), np.zeros((2, 4)))
        m.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
        fsdp = FSDP(m, b, "full_shard")
        loss_fn(fsdp(x), np.zeros((2, 4)))
        fsdp.backward(loss_fn.backward())
        fsdp.sync_gradients()
        shards = [p.data.copy() for p in fsdp.parameters()]
        with pytest.raises(ValueError, match=r"SGD\.step: parameter 0's 'momentum_buffer' has "
                                             r"shape \(4, 4\), its parameter \(8,\)"):
            opt.step()
        for p, s in zip(fsdp.parameters(), shards):
            np.testing.assert_array_equal(p.data, s)
        return True

    assert run(body, 2) == [True, True]
