"""Causal self-attention and a pre-LN transformer block (re-exported by :mod:`ferro_fsdp.nn`).

Both are containers of :mod:`~ferro_fsdp.layers` layers, so their parameters are named like the
same structure built from torch modules (``attn.qkv.weight``, ``mlp.0.weight``, ...), and FSDP
can make each :class:`TransformerBlock` a unit (``FSDP(model, backend, wrap=TransformerBlock)``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .activations import GELU
from .containers import Sequential
from .layers import Dropout, LayerNorm, Linear, _positive, _rng
from .module import Module


def _softmax(s: np.ndarray) -> np.ndarray:
    if s.size == 0:  # a sequence of length 0: nothing to weigh (max() has no identity)
        return s.copy()
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class CausalSelfAttention(Module):
    """Multi-head self-attention where position ``i`` sees positions ``<= i``.

    ``x [..., seq, embed_dim] -> [..., seq, embed_dim]``. Children ``qkv = Linear(embed_dim,
    3 * embed_dim)`` (q, k, v in that order along its output) and ``proj = Linear(embed_dim,
    embed_dim)``. Head ``h`` uses columns ``h*d:(h+1)*d`` of q, k and v (``d = embed_dim //
    num_heads``) and computes ``softmax(q k^T / sqrt(d) + causal mask) v``; the heads are
    concatenated in order and projected by ``proj``. ``embed_dim`` not divisible by
    ``num_heads`` raises ``ValueError``.

    Parameters
    ----------
    embed_dim, num_heads : int
        Model width and number of heads (positive; ``embed_dim % num_heads == 0``).
    bias : bool, default True
        Whether ``qkv`` and ``proj`` have biases.
    dtype : numpy dtype, default numpy.float32
        The parameters' floating dtype.
    rng : int, numpy.random.Generator or None, default None
        Seed or generator of the initialisation.

    Raises
    ------
    ValueError, TypeError
        A size that is not a positive int or not divisible; a dtype that is not floating.
    """

    def __init__(self, embed_dim: int, num_heads: int, bias: bool = True, *,
                 dtype: Any = np.float32, rng: Any = None) -> None:
        super().__init__()
        _positive("CausalSelfAttention", embed_dim=embed_dim, num_heads=num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"CausalSelfAttention: embed_dim {embed_dim} is not divisible by "
                             f"num_heads {num_heads}")
        gen = _rng(rng)
        self.embed_dim = int(embed_dim)
        self.num_heads = int(num_heads)
        self.head_dim = self.embed_dim // self.num_heads
        self.qkv = Linear(embed_dim, 3 * embed_dim, bias, dtype=dtype, rng=gen)
        self.proj = Linear(embed_dim, embed_dim, bias, dtype=dtype, rng=gen)
        self._cache: tuple[np.ndarray, ...] | None = None

    def _heads(self, t: np.ndarray) -> np.ndarray:
        """``[..., seq, embed_dim] -> [..., heads, seq, head_dim]``."""
        return np.swapaxes(t.reshape(t.shape[:-1] + (self.num_heads, self.head_dim)), -2, -3)

    def _merge(self, t: np.ndarray) -> np.ndarray:
        """``[..., heads, seq, head_dim] -> [..., seq, embed_dim]``."""
        t = np.swapaxes(t, -2, -3)
        return t.reshape(t.shape[:-2] + (self.embed_dim,))

    def forward(self, x: Any) -> np.ndarray:
        """Causal multi-head attention of ``x`` with itself, projected by ``proj``; keeps q, k, v
        and the attention weights for :meth:`backward`.

        Parameters
        ----------
        x : array_like
            Shape ``(..., seq, embed_dim)``, at least 2-D.

        Returns
        -------
        numpy.ndarray
            Same shape as ``x``; position ``i`` depends only on positions ``<= i``.

        Raises
        ------
        ValueError
            Fewer than 2 dimensions or a last dimension other than ``embed_dim``.
        """
        x = np.asarray(x)
        if x.ndim < 2 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"CausalSelfAttention.forward: input of shape {x.shape}, expected "
                             f"[..., seq, {self.embed_dim}]")
        qkv = self.qkv(x)
        e = self.embed_dim
        q, k, v = (self._heads(qkv[..., i * e:(i + 1) * e]) for i in range(3))
        seq = x.shape[-2]
        scale = 1.0 / math.sqrt(self.head_dim)
        s = np.matmul(q, np.swapaxes(k, -1, -2)) * np.asarray(scale, dtype=q.dtype)
        s[..., np.triu(np.ones((seq, seq), dtype=bool), k=1)] = -np.inf
        a = _softmax(s)
        self._cache = (q, k, v, a)
        return self.proj(self._merge(np.matmul(a, v)))

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the gradients of ``qkv`` and ``proj`` and return the gradient wrt the input.

        Parameters
        ----------
        grad_output : array_like
            The gradient wrt the last forward's output (same shape).

        Returns
        -------
        numpy.ndarray
            The gradient wrt that forward's input.

        Raises
        ------
        RuntimeError
            No forward ran before.
        """
        if self._cache is None:
            raise RuntimeError("CausalSelfAttention.backward: called before forward")
        q, k, v, a = self._cache
        go = self._heads(self.proj.backward(grad_output))
        ga = np.matmul(go, np.swapaxes(v, -1, -2))
        gv = np.matmul(np.swapaxes(a, -1, -2), go)
        gs = a * (ga - np.sum(ga * a, axis=-1, keepdims=True))  # masked entries: a == 0
        gs *= np.asarray(1.0 / math.sqrt(self.head_dim), dtype=gs.dtype)
        gq = np.matmul(gs, k)
        gk = np.matmul(np.swapaxes(gs, -1, -2), q)
        gqkv = np.concatenate([self._merge(gq), self._merge(gk), self._merge(gv)], axis=-1)
        return self.qkv.backward(gqkv)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"


class TransformerBlock(Module):
    """A GPT-2 style pre-LN block: ``h = x + drop(attn(ln1(x)))``, ``y = h + mlp(ln2(h))``.

    Children, in this order (their parameter names): ``ln1`` (LayerNorm), ``attn``
    (:class:`CausalSelfAttention`), ``ln2``, ``mlp = Sequential(Linear(embed_dim, mlp_ratio *
    embed_dim), GELU(approximate), Linear(mlp_ratio * embed_dim, embed_dim), Dropout(dropout))``
    and ``drop = Dropout(dropout)`` (no parameters: torch's equivalent is ``nn.LayerNorm``,
    ``nn.Linear``, ``nn.GELU`` and ``nn.Dropout`` in the same places). ``x [..., seq,
    embed_dim] -> same shape``; ``backward`` returns the gradient wrt ``x``.

    Parameters
    ----------
    embed_dim, num_heads : int
        As for :class:`CausalSelfAttention`.
    mlp_ratio : int, default 4
        The MLP's hidden width is ``mlp_ratio * embed_dim``.
    dropout : float, default 0.0
        Probability of both Dropouts.
    bias : bool, default True
        Whether the Linear layers have biases.
    approximate : {"none", "tanh"}, default "none"
        The GELU's form.
    eps : float, default 1e-5
        The LayerNorms' ``eps``.
    dtype : numpy dtype, default numpy.float32
        The parameters' floating dtype.
    rng : int, numpy.random.Generator or None, default None
        Seed or generator of the initialisation (shared by the children, in order).

    Raises
    ------
    ValueError, TypeError
        As the children raise for these arguments (sizes, ``dropout``, ``approximate``, dtype).

    Examples
    --------
    >>> block = TransformerBlock(64, 4, rng=0)
    >>> y = block(np.zeros((2, 16, 64), np.float32))  # same shape
    """

    def __init__(self, embed_dim: int, num_heads: int, *, mlp_ratio: int = 4,
                 dropout: float = 0.0, bias: bool = True, approximate: str = "none",
                 eps: float = 1e-5, dtype: Any = np.float32, rng: Any = None) -> None:
        super().__init__()
        _positive("TransformerBlock", mlp_ratio=mlp_ratio)
        gen = _rng(rng)
        hidden = int(mlp_ratio) * int(embed_dim)
        self.ln1 = LayerNorm(embed_dim, eps, dtype=dtype)
        self.attn = CausalSelfAttention(embed_dim, num_heads, bias, dtype=dtype, rng=gen)
        self.ln2 = LayerNorm(embed_dim, eps, dtype=dtype)
        self.mlp = Sequential(Linear(embed_dim, hidden, bias, dtype=dtype, rng=gen),
                              GELU(approximate),
                              Linear(hidden, embed_dim, bias, dtype=dtype, rng=gen),
                              Dropout(dropout, rng=gen))
        self.drop = Dropout(dropout, rng=gen)

    def forward(self, x: Any) -> np.ndarray:
        """``h = x + drop(attn(ln1(x)))``, then ``h + mlp(ln2(h))``.

        Parameters
        ----------
        x : array_like
            Shape ``(..., seq, embed_dim)``.

        Returns
        -------
        numpy.ndarray
            Same shape as ``x``.

        Raises
        ------
        ValueError
            An input the children reject (last dimension not ``embed_dim``).
        """
        h = x + self.drop(self.attn(self.ln1(x)))
        return h + self.mlp(self.ln2(h))

    def backward(self, grad_output: Any) -> np.ndarray:
        """Back through both residual branches: adds every child's parameter gradients.

        Parameters
        ----------
        grad_output : array_like
            The gradient wrt the last forward's output (same shape).

        Returns
        -------
        numpy.ndarray
            The gradient wrt that forward's input ``x``.

        Raises
        ------
        RuntimeError
            No forward ran before.
        """
        g = np.asarray(grad_output)
        g = g + self.ln2.backward(self.mlp.backward(g))
        return g + self.ln1.backward(self.attn.backward(self.drop.backward(g)))


__all__ = ["CausalSelfAttention", "TransformerBlock"]
