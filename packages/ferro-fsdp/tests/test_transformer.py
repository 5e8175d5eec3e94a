"""Embedding, LayerNorm, GELU, Dropout, CausalSelfAttention and TransformerBlock against torch:
forward values, input gradients and parameter gradients, float32 and float64."""

import numpy as np
import pytest
import torch
from _gpt import TinyGPT, lm_step
from _torch_models import TORCH_DTYPE, TorchAttention, TorchBlock, TorchGPT, load_from
from hypothesis import given, settings
from hypothesis import strategies as st

from ferro_fsdp import nn

DTYPES = [np.float32, np.float64]
# float32: gradients are sums of many products accumulated in another order than torch's; a
# block's qkv weight gradient of a few 1e-2 came out 2.6e-5 away in one drawn case (atol 5e-5)
TOL = {np.dtype(np.float32): {"rtol": 2e-4, "atol": 5e-5},
       np.dtype(np.float64): {"rtol": 1e-10, "atol": 1e-12}}
FEW = settings(max_examples=8, deadline=None)


def check_against_torch(ours, theirs, x, *, seed=0, input_grad=True):
    """ours(x) vs theirs(x); then backward of the same random grad_output: input gradient
    and every parameter's gradient, matched by name."""
    x = np.asarray(x)
    out = ours(x)
    xt = torch.from_numpy(x.copy())
    if input_grad:
        xt.requires_grad_(True)
    out_t = theirs(xt)
    tol = TOL[out.dtype]
    assert out.dtype == x.dtype if input_grad else True
    np.testing.assert_allclose(out, out_t.detach().numpy(), **tol)
    g = np.random.default_rng(seed).standard_normal(out.shape).astype(out.dtype)
    gx = ours.backward(g)
    out_t.backward(torch.from_numpy(g))
    if input_grad:
        assert gx.dtype == x.dtype
        np.testing.assert_allclose(gx, xt.grad.numpy(), **tol)
    torch_grads = {n: p.grad for n, p in theirs.named_parameters()}
    for name, p in ours.named_parameters():
        assert p.grad.dtype == p.data.dtype
        np.testing.assert_allclose(p.grad, torch_grads[name].numpy(), **tol, err_msg=name)
    return gx


def randn(shape, dtype, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ------------------------------------------------------------------------------ Embedding
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_matches_torch_and_adds_repeated_rows(dtype):
    ours = nn.Embedding(7, 5, dtype=dtype, rng=0)
    theirs = load_from(torch.nn.Embedding(7, 5, dtype=TORCH_DTYPE[np.dtype(dtype)]), ours)
    idx = np.array([[1, 3, 1], [6, 1, 0]])
    assert check_against_torch(ours, theirs, idx, input_grad=False) is None
    g = np.random.default_rng(0).standard_normal((2, 3, 5)).astype(dtype)
    np.testing.assert_allclose(ours.weight.grad[1], g[0, 0] + g[0, 2] + g[1, 1], rtol=1e-6)
    np.testing.assert_array_equal(ours.weight.grad[[2, 4, 5]], 0)


def test_embedding_init_dtype_and_errors():
    e = nn.Embedding(4, 3, rng=0)
    assert e.weight.shape == (4, 3) and e.weight.dtype == np.float32
    assert e(np.array(2)).shape == (3,) and e(np.zeros((2, 3, 4), np.int64)).shape == (2, 3, 4, 3)
    with pytest.raises(IndexError, match=r"index 4 out of range \[0, 4\)"):
        e(np.array([0, 4]))
    with pytest.raises(IndexError, match="index -1"):
        e(np.array([-1]))
    with pytest.raises(TypeError, match="float64"):
        e(np.array([0.0]))
    with pytest.raises(ValueError, match="num_embeddings 0"):
        nn.Embedding(0, 3)
    with pytest.raises(TypeError, match="int32"):
        nn.Embedding(2, 3, dtype=np.int32)
    with pytest.raises(RuntimeError, match="before forward"):
        nn.Embedding(2, 3).backward(np.ones(3))


# ------------------------------------------------------------------------------ LayerNorm
@FEW
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=3), dim=st.integers(1, 9),
       affine=st.booleans(), dtype=st.sampled_from(DTYPES))
def test_layernorm_matches_torch(lead, dim, affine, dtype):
    ours = nn.LayerNorm(dim, eps=1e-5, elementwise_affine=affine, dtype=dtype)
    theirs = torch.nn.LayerNorm(dim, elementwise_affine=affine, dtype=TORCH_DTYPE[np.dtype(dtype)])
    if affine:  # non-trivial affine parameters, copied into torch's
        ours.weight.data[:] = randn(dim, dtype, seed=5)
        ours.bias.data[:] = randn(dim, dtype, seed=6)
        load_from(theirs, ours)
    check_against_torch(ours, theirs, randn((*lead, dim), dtype))


def test_layernorm_defaults_and_errors():
    ln = nn.LayerNorm(4)
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"]
    np.testing.assert_array_equal(ln.weight.data, 1)
    np.testing.assert_array_equal(ln.bias.data, 0)
    assert ln.weight.dtype == np.float32 and ln.eps == 1e-5
    assert nn.LayerNorm(4, elementwise_affine=False).named_parameters() == []
    with pytest.raises(ValueError, match="last dimension 4"):
        ln(np.ones((2, 3)))
    with pytest.raises(ValueError, match="normalized_shape 0"):
        nn.LayerNorm(0)
    with pytest.raises(RuntimeError, match="before forward"):
        nn.LayerNorm(3).backward(np.ones(3))


# ------------------------------------------------------------------------------ GELU
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_matches_torch(approximate, dtype):
    x = np.concatenate([randn((3, 50), dtype).ravel() * 3,
                        np.array([0.0, -0.0, 7.5, -7.5, 1e-3, -30.0], dtype)])
    check_against_torch(nn.GELU(approximate), torch.nn.GELU(approximate), x)


def test_gelu_kernel_is_compiled_and_matches_libm_erf():
    import importlib.machinery
    import math

    import ferro_fsdp.activations as activations
    from ferro_fsdp import _gelu

    assert _gelu.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    assert activations._gelu is _gelu
    x = np.concatenate([np.linspace(-9, 9, 1001), [0.0, -0.0, np.inf, -np.inf]])
    ref = np.array([v * 0.5 * (1 + math.erf(v * math.sqrt(0.5))) if np.isfinite(v)
                    else (v if v > 0 else np.nan) for v in x])   # -inf * 0: NaN, as torch
    y = nn.GELU()(x)
    np.testing.assert_allclose(y, ref, rtol=4e-16, atol=1e-300)
    assert np.isnan(nn.GELU()(np.array([np.nan]))).all()
    # non-contiguous, integer and mixed-dtype inputs take the same kernel
    strided = np.linspace(-3, 3, 20).reshape(4, 5)[:, ::2]
    np.testing.assert_array_equal(nn.GELU()(strided), nn.GELU()(strided.copy()))
    assert nn.GELU()(np.arange(3)).dtype == np.float64
    g = nn.GELU()
    g(np.ones(3, np.float32))
    assert g.backward(np.ones(3)).dtype == np.float64
    with pytest.raises(ValueError, match=r"grad_output of shape \(2,\), expected \(3,\)"):
        g.backward(np.ones(2))


def test_gelu_float32_kernels_match_double_precision_references():
    """The float32 kernels use their own vectorizable exp/erf polynomials: against math.erf /
    math.exp / math.tanh in double over the whole range (tails included), a few float ulps."""
    import math

    from ferro_fsdp import _gelu

    x64 = np.concatenate([np.linspace(-16, 16, 64001), randn(4000, np.float64) * 3])
    x = x64.astype(np.float32)
    xd = x.astype(np.float64)
    cdf_ref = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in xd])
    out, cdf = np.empty_like(x), np.empty_like(x)
    _gelu.gelu_forward(x, out, cdf)
    np.testing.assert_allclose(cdf, cdf_ref, rtol=2e-6, atol=1e-38)   # relative in both tails
    np.testing.assert_allclose(out, xd * cdf_ref, rtol=2e-6, atol=1e-37)
    g = randn(x.shape, np.float32, seed=2)
    gx = np.empty_like(x)
    _gelu.gelu_backward(g, x, cdf, gx)
    pdf = np.array([math.exp(-0.5 * v * v) for v in xd]) / math.sqrt(2 * math.pi)
    ref = g * (cdf.astype(np.float64) + xd * pdf)
    np.testing.assert_allclose(gx, ref, rtol=2e-6, atol=2e-7)   # Phi + x phi cancels near -0.75
    tail = np.abs(xd) > 4
    np.testing.assert_allclose(gx[tail], ref[tail], rtol=2e-6, atol=1e-36)   # 0 below ~1e-37
    k = math.sqrt(2 / math.pi)
    u = k * (xd + 0.044715 * xd ** 3)
    with np.errstate(over="ignore"):   # (1 + tanh u) / 2 and (1 - tanh u) / 2, no cancellation
        s, s1 = 1 / (1 + np.exp(-2 * u)), 1 / (1 + np.exp(2 * u))
    # u itself is rounded to float: exp(-2 |u|) carries ~|u| ulp in the lower tail
    _gelu.gelu_tanh_forward(x, out)
    np.testing.assert_allclose(out, xd * s, rtol=2e-5, atol=1e-36)
    _gelu.gelu_tanh_backward(g, x, gx)
    ref = g * (s + 2 * xd * s * s1 * k * (1 + 3 * 0.044715 * xd * xd))
    np.testing.assert_allclose(gx, ref, rtol=2e-6, atol=2e-7)
    np.testing.assert_allclose(gx[tail], ref[tail], rtol=2e-5, atol=1e-33)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_is_compiled_and_keeps_special_values(dtype, monkeypatch):
    import ferro_fsdp.activations as activations
    from ferro_fsdp import _gelu

    calls = []

    def spy(name):
        kernel = getattr(_gelu, name)

        def call(*args):
            calls.append(name)
            return kernel(*args)
        return call

    for name in ("gelu_tanh_forward", "gelu_tanh_backward"):
        monkeypatch.setattr(activations._gelu, name, spy(name))
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, 40.0, -40.0], dtype)
    gelu = nn.GELU("tanh")
    y = gelu(x)
    gx = gelu.backward(np.ones_like(x))
    assert calls == ["gelu_tanh_forward", "gelu_tanh_backward"]
    with np.errstate(invalid="ignore"):
        yt = torch.nn.functional.gelu(torch.from_numpy(x), approximate="tanh").numpy()
    np.testing.assert_array_equal(y, yt)             # -inf * 0: NaN, as torch; signed zeros
    np.testing.assert_array_equal(np.signbit(y), np.signbit(yt))
    np.testing.assert_array_equal(gx[[0, 1, 5, 6, 7]], [0.5, 0.5, 0.5, 1.0, 0.0])
    assert np.isnan(gx[4])
    strided = np.linspace(-3, 3, 20).reshape(4, 5)[:, ::2].astype(dtype)
    np.testing.assert_array_equal(nn.GELU("tanh")(strided), nn.GELU("tanh")(strided.copy()))
    assert nn.GELU("tanh")(np.arange(3)).dtype == np.float64


def test_gelu_rejects_an_unknown_approximation():
    with pytest.raises(ValueError, match="approximate 'erf'"):
        nn.GELU("erf")


# ------------------------------------------------------------------------------ Dropout
@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_masks_scales_and_reuses_the_mask_in_backward(dtype):
    d = nn.Dropout(0.25, rng=0)
    x = np.ones((200, 50), dtype)
    y = d(x)
    assert y.dtype == dtype
    kept = y != 0
    assert 0.7 < kept.mean() < 0.8
    np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-6)
    g = randn(x.shape, dtype)
    gx = d.backward(g)
    np.testing.assert_array_equal(gx == 0, ~kept)
    np.testing.assert_allclose(gx[kept], g[kept] / 0.75, rtol=1e-6)
    np.testing.assert_array_equal(d.backward(g), gx)   # the same mask again, not a new one
    assert not np.array_equal(d(x) != 0, kept)        # a new forward draws a new mask


def test_dropout_is_the_identity_in_eval_and_at_p_zero():
    x = randn((4, 5), np.float32)
    d = nn.Dropout(0.5, rng=0).eval()
    assert d(x) is x or np.array_equal(d(x), x)
    np.testing.assert_array_equal(d.backward(x), x)
    np.testing.assert_array_equal(nn.Dropout(0.0)(x), x)
    d.train()
    assert (d(x) == 0).any()


def test_dropout_at_p_one_gives_zeros_as_torch():
    import torch

    x = randn((4, 5), np.float32)
    d = nn.Dropout(1.0, rng=0)
    want = torch.nn.Dropout(1.0)(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(d(x), want)
    assert not d(x).any() and d(x).dtype == x.dtype
    np.testing.assert_array_equal(d.backward(np.ones_like(x)), np.zeros_like(x))


def test_dropout_errors():
    for p in (-0.1, 1.01, 1.5):
        with pytest.raises(ValueError, match=rf"p {p} outside \[0, 1\]"):
            nn.Dropout(p)
    with pytest.raises(RuntimeError, match="before forward"):
        nn.Dropout(0.1).backward(np.ones(2))


# ------------------------------------------------------------------------------ attention
@FEW
@given(lead=st.lists(st.integers(1, 3), min_size=1, max_size=2), seq=st.integers(1, 6),
       heads=st.integers(1, 3), head_dim=st.integers(1, 4), bias=st.booleans(),
       dtype=st.sampled_from(DTYPES))
def test_causal_self_attention_matches_torch(lead, seq, heads, head_dim, bias, dtype):
    e = heads * head_dim
    ours = nn.CausalSelfAttention(e, heads, bias, dtype=dtype, rng=seq)
    theirs = load_from(TorchAttention(e, heads, bias, dtype=TORCH_DTYPE[np.dtype(dtype)]), ours)
    check_against_torch(ours, theirs, randn((*lead, seq, e), dtype))


def test_attention_is_causal():
    attn = nn.CausalSelfAttention(4, 2, dtype=np.float64, rng=0)
    x = randn((1, 5, 4), np.float64)
    y = attn(x)
    x2 = x.copy()
    x2[0, 3:] += 1.0                       # change the future: the past's outputs stay
    np.testing.assert_array_equal(attn(x2)[0, :3], y[0, :3])


def test_attention_on_an_empty_sequence_is_empty_as_torchs():
    # the softmax's max() over no keys raised numpy's "zero-size array" error
    attn = nn.CausalSelfAttention(8, 2, dtype=np.float64, rng=0)
    y = attn(np.ones((2, 0, 8)))
    assert y.shape == (2, 0, 8)
    g = attn.backward(np.ones((2, 0, 8)))
    assert g.shape == (2, 0, 8)


def test_attention_errors_and_names():
    with pytest.raises(ValueError, match="embed_dim 6 is not divisible by num_heads 4"):
        nn.CausalSelfAttention(6, 4)
    with pytest.raises(ValueError, match="num_heads 0"):
        nn.CausalSelfAttention(6, 0)
    attn = nn.CausalSelfAttention(6, 3)
    assert [n for n, _ in attn.named_parameters()] == [
        "qkv.weight", "qkv.bias", "proj.weight", "proj.bias"]
    assert attn.qkv.weight.shape == (18, 6)
    with pytest.raises(ValueError, match=r"expected \[..., seq, 6\]"):
        attn(np.ones((2, 5)))
    with pytest.raises(RuntimeError, match="before forward"):
        nn.CausalSelfAttention(6, 3).backward(np.ones((1, 2, 6)))


# ------------------------------------------------------------------------------ block, GPT
@FEW
@given(batch=st.integers(1, 3), seq=st.integers(1, 5), heads=st.integers(1, 3),
       head_dim=st.integers(1, 3), approximate=st.sampled_from(["none", "tanh"]),
       dtype=st.sampled_from(DTYPES))
def test_transformer_block_matches_torch(batch, seq, heads, head_dim, approximate, dtype):
    e = heads * head_dim
    ours = nn.TransformerBlock(e, heads, approximate=approximate, dtype=dtype, rng=1)
    for p in (ours.ln1.weight, ours.ln2.bias):      # not the trivial ones and zeros
        p.data[:] = randn(p.shape, dtype, seed=7)
    theirs = load_from(TorchBlock(e, heads, approximate, TORCH_DTYPE[np.dtype(dtype)]), ours)
    check_against_torch(ours, theirs, randn((batch, seq, e), dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt_loss_and_gradients_match_torch(dtype):
    vocab, seq = 11, 6
    ours = TinyGPT(vocab, seq, 8, 2, 2, dtype=dtype, rng=3)
    theirs = load_from(TorchGPT(vocab, seq, 8, 2, 2, dtype=TORCH_DTYPE[np.dtype(dtype)]), ours)
    rng = np.random.default_rng(4)
    idx = rng.integers(0, vocab, (3, seq))
    targets = rng.integers(0, vocab, (3, seq))
    loss = lm_step(ours, nn.CrossEntropyLoss(), idx, targets)
    logits = theirs(torch.from_numpy(idx))
    loss_t = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                               torch.from_numpy(targets).reshape(-1))
    loss_t.backward()
    tol = TOL[np.dtype(dtype)]
    assert loss == pytest.approx(loss_t.item(), rel=tol["rtol"])
    torch_grads = dict(theirs.named_parameters())
    assert [n for n, _ in ours.named_parameters()] == list(torch_grads)
    for name, p in ours.named_parameters():
        np.testing.assert_allclose(p.grad, torch_grads[name].grad.numpy(), **tol, err_msg=name)
