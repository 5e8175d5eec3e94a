"""Layers and losses with numpy forward and backward, float32 and float64.

``module.backward(grad_output)`` returns the gradient wrt the module's input and adds the
parameters' gradients to their ``.grad`` (torch accumulates the same way; ``zero_grad`` resets).
A layer reads its parameters' ``.data`` again in ``backward`` (it caches only its input), which is
what lets FSDP free the gathered parameters between ``forward`` and ``backward``.

Layers: ``Linear``, ``Embedding``, ``LayerNorm``, ``Dropout`` (``ferro_fsdp.layers``),
``Sequential`` (``ferro_fsdp.containers``), ``ReLU``, ``GELU`` (``ferro_fsdp.activations``),
``CausalSelfAttention`` and the pre-LN ``TransformerBlock`` (``ferro_fsdp.attention``):
torch's names, defaults and math.

Losses are called as ``loss = loss_fn(output, target)`` (a Python float) and
``loss_fn.backward()`` returns d loss / d output for the last call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .activations import GELU, ReLU
from .attention import CausalSelfAttention, TransformerBlock
from .containers import Sequential
from .layers import Dropout, Embedding, LayerNorm, Linear
from .module import Module


class _Loss(Module):
    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        if reduction not in ("mean", "sum"):
            raise ValueError(f"{type(self).__name__}: reduction {reduction!r}, expected 'mean' or 'sum'")
        self.reduction = reduction
        self._grad: np.ndarray | None = None

    def backward(self, grad_output: Any = 1.0) -> np.ndarray:
        """d loss / d output of the last call, times ``grad_output`` (default 1).

        Parameters
        ----------
        grad_output : float or array_like, default 1.0
            The gradient wrt the loss (broadcast against the output).

        Returns
        -------
        numpy.ndarray
            Of the output's shape and dtype.

        Raises
        ------
        RuntimeError
            No loss was computed yet.
        """
        if self._grad is None:
            raise RuntimeError(f"{type(self).__name__}.backward: called before the loss was computed")
        if np.isscalar(grad_output) and grad_output == 1.0:
            return self._grad
        return self._grad * np.asarray(grad_output, dtype=self._grad.dtype)


class MSELoss(_Loss):
    """``mean((output - target) ** 2)`` over every element (``reduction="sum"``: the sum).

    ``loss_fn(output, target)`` returns a float; ``target`` must have the output's shape, the
    output a floating dtype (else ValueError / TypeError).

    Parameters
    ----------
    reduction : {"mean", "sum"}, default "mean"
        Average or sum the squared errors.

    Raises
    ------
    ValueError
        Another ``reduction``.
    """

    def forward(self, output: Any, target: Any) -> float:
        """The mean (or sum) squared error; keeps its gradient for :meth:`backward`.

        Parameters
        ----------
        output : array_like
            Floating predictions, any shape.
        target : array_like
            Same shape as ``output`` (cast to its dtype).

        Returns
        -------
        float
            The loss, a Python float.

        Raises
        ------
        TypeError
            A non-floating ``output``.
        ValueError
            ``target`` of another shape.
        """
        o = np.asarray(output)
        if o.dtype.kind != "f":
            raise TypeError(f"MSELoss: output dtype {o.dtype} is not floating")
        t = np.asarray(target, dtype=o.dtype)
        if t.shape != o.shape:
            raise ValueError(f"MSELoss: target of shape {t.shape}, expected the output's {o.shape}")
        diff = o - t
        scale = 1.0 / max(o.size, 1) if self.reduction == "mean" else 1.0
        self._grad = (diff * (2.0 * scale)).astype(o.dtype, copy=False)
        return float(np.sum(diff * diff) * scale)


class CrossEntropyLoss(_Loss):
    """Softmax cross entropy of logits ``(N, C)`` vs class indices ``(N,)`` or probabilities ``(N, C)``.

    ``loss_fn(output, target)`` returns a float; a non-floating output raises TypeError, a class
    index outside ``[0, C)`` or a target of another shape ValueError.

    Parameters
    ----------
    reduction : {"mean", "sum"}, default "mean"
        Average or sum the per-sample losses.

    Raises
    ------
    ValueError
        Another ``reduction``.

    Examples
    --------
    >>> loss_fn = CrossEntropyLoss()
    >>> loss = loss_fn(np.zeros((2, 4), np.float32), np.array([0, 3]))  # log(4)
    >>> grad = loss_fn.backward()  # d loss / d logits, shape (2, 4)
    """

    def forward(self, output: Any, target: Any) -> float:
        """The mean (or sum) over samples of ``-log softmax(output)[target]``, computed stably
        (logits shifted by their row maximum); keeps its gradient for :meth:`backward`.

        Parameters
        ----------
        output : array_like
            Floating logits of shape ``(N, C)``.
        target : array_like
            Class indices of shape ``(N,)`` (integers in ``[0, C)``) or class probabilities of
            shape ``(N, C)``.

        Returns
        -------
        float
            The loss, a Python float.

        Raises
        ------
        TypeError
            A non-floating ``output``.
        ValueError
            ``output`` not 2-D, a class index out of range, or a target of another shape.
        """
        z = np.asarray(output)
        if z.dtype.kind != "f":
            raise TypeError(f"CrossEntropyLoss: output dtype {z.dtype} is not floating")
        if z.ndim != 2:
            raise ValueError(f"CrossEntropyLoss: output of shape {z.shape}, expected (N, C)")
        n, c = z.shape
        t = np.asarray(target)
        shifted = z - z.max(axis=1, keepdims=True)
        logsum = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        logp = shifted - logsum
        prob = np.exp(logp)
        if t.shape == (n,) and t.dtype.kind in "iub":
            if n and (t.min() < 0 or t.max() >= c):
                raise ValueError(f"CrossEntropyLoss: class index out of range [0, {c})")
            idx = t.astype(np.intp)
            losses = -logp[np.arange(n), idx]
            onehot = np.zeros_like(z)
            onehot[np.arange(n), idx] = 1
        elif t.shape == (n, c):
            onehot = t.astype(z.dtype)
            losses = -(onehot * logp).sum(axis=1)
        else:
            raise ValueError(f"CrossEntropyLoss: target of shape {t.shape} ({t.dtype}), expected "
                             f"({n},) class indices or ({n}, {c}) probabilities")
        scale = 1.0 / max(n, 1) if self.reduction == "mean" else 1.0
        self._grad = ((prob * onehot.sum(axis=1, keepdims=True) - onehot) * scale).astype(z.dtype,
                                                                                        copy=False)
        return float(losses.sum() * scale)


__all__ = [
    "GELU",
    "CausalSelfAttention",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "MSELoss",
    "ReLU",
    "Sequential",
    "TransformerBlock",
]
