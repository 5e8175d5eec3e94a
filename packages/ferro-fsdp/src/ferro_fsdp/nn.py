"""Layers and losses with numpy forward and backward, float32 and float64.

``module.backward(grad_output)`` returns the gradient wrt the module's input and adds the
parameters' gradients to their ``.grad`` (torch accumulates the same way; ``zero_grad`` resets).
A layer reads its parameters' ``.data`` again in ``backward`` (it caches only its input), which is
what lets FSDP free the gathered parameters between ``forward`` and ``backward``.

Losses are called as ``loss = loss_fn(output, target)`` (a Python float) and
``loss_fn.backward()`` returns d loss / d output for the last call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .module import Module
from .parameter import Parameter


def _rng(rng: Any) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(rng)


class Linear(Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape ``(out_features, in_features)``.

    Initialised like torch: weight and bias uniform in ``±1/sqrt(in_features)``. ``rng`` is a seed
    or a ``numpy.random.Generator``; ``dtype`` float32 (default, as torch) or float64.
    ``input_grad=False`` (also settable later as an attribute): ``backward`` skips the gradient
    wrt the input and returns None, one matmul less per step; for a model's first layer, whose
    input (the data) needs no gradient, as torch's autograd skips it on its own.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: Any = np.float32, rng: Any = None, input_grad: bool = True) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear: in_features {in_features} and out_features {out_features} "
                             "must be positive")
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise TypeError(f"Linear: dtype {dtype} is not a floating dtype")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        gen = _rng(rng)
        bound = 1.0 / np.sqrt(in_features)
        self.weight = Parameter(gen.uniform(-bound, bound, (out_features, in_features)).astype(dtype))
        if bias:
            self.bias = Parameter(gen.uniform(-bound, bound, out_features).astype(dtype))
        else:
            self.bias = None
        self._x: np.ndarray | None = None
        self.input_grad = bool(input_grad)

    def forward(self, x: Any) -> np.ndarray:
        x = np.asarray(x)
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(f"Linear.forward: input of shape {x.shape}, expected last dimension "
                             f"{self.in_features}")
        self._x = x
        y = x @ self.weight.data.T
        if self.bias is not None:
            y = y + self.bias.data
        return y

    def backward(self, grad_output: Any) -> np.ndarray:
        if self._x is None:
            raise RuntimeError("Linear.backward: called before forward")
        g = np.asarray(grad_output)
        x = self._x
        if g.shape != x.shape[:-1] + (self.out_features,):
            raise ValueError(f"Linear.backward: grad_output of shape {g.shape}, expected "
                             f"{x.shape[:-1] + (self.out_features,)}")
        g2 = g.reshape(-1, self.out_features)
        x2 = x.reshape(-1, self.in_features)
        w, b = self.weight, self.bias
        slot = w.free_grad_slot()
        if slot is not None and g2.dtype == x2.dtype == slot.dtype:
            w.grad = np.matmul(g2.T, x2, out=slot)  # straight into DDP's bucket: no copy
        else:
            w.accumulate_grad(g2.T @ x2, owned=True)
        if b is not None:
            slot = b.free_grad_slot()
            if slot is not None and g2.dtype == slot.dtype:
                b.grad = np.sum(g2, axis=0, out=slot)
            else:
                b.accumulate_grad(g2.sum(axis=0), owned=True)
        return g @ w.data if self.input_grad else None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class ReLU(Module):
    """``max(x, 0)`` as ``np.maximum`` and torch compute it: NaN stays NaN (never silently 0).

    Backward is torch's ``threshold_backward``: the gradient is 0 where ``x <= 0`` (so 0 at
    ``x == 0``, as in torch) and ``grad_output`` elsewhere, NaN inputs included; a NaN
    ``grad_output`` stays NaN where it passes.
    """

    def __init__(self) -> None:
        super().__init__()
        self._off: np.ndarray | None = None

    def forward(self, x: Any) -> np.ndarray:
        x = np.asarray(x)
        self._off = x <= 0                     # False for NaN: its gradient passes, as in torch
        return np.maximum(x, np.zeros((), dtype=x.dtype))

    def backward(self, grad_output: Any) -> np.ndarray:
        if self._off is None:
            raise RuntimeError("ReLU.backward: called before forward")
        g = np.asarray(grad_output)
        return np.where(self._off, np.zeros((), dtype=g.dtype), g)


class Sequential(Module):
    """Runs its modules in order; registered as attributes ``"0"``, ``"1"``, ..."""

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            self.add_module(str(i), m)

    def _layers(self) -> list[Module]:
        return self.children()

    def __len__(self) -> int:
        return len(self._layers())

    def __iter__(self):
        return iter(self._layers())

    def __getitem__(self, index: int) -> Module:
        return self._layers()[index]

    def forward(self, x: Any) -> Any:
        for m in self._layers():
            x = m(x)
        return x

    def backward(self, grad_output: Any) -> Any:
        g = grad_output
        for m in reversed(self._layers()):
            if g is None:  # a later layer computed no input gradient (input_grad=False)
                raise ValueError(f"Sequential.backward: {type(m).__name__} comes before a layer "
                                 "with input_grad=False: it needs that gradient")
            g = m.backward(g)
        return g


class _Loss(Module):
    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        if reduction not in ("mean", "sum"):
            raise ValueError(f"{type(self).__name__}: reduction {reduction!r}, expected 'mean' or 'sum'")
        self.reduction = reduction
        self._grad: np.ndarray | None = None

    def backward(self, grad_output: Any = 1.0) -> np.ndarray:
        """d loss / d output of the last call, times ``grad_output`` (default 1)."""
        if self._grad is None:
            raise RuntimeError(f"{type(self).__name__}.backward: called before the loss was computed")
        if np.isscalar(grad_output) and grad_output == 1.0:
            return self._grad
        return self._grad * np.asarray(grad_output, dtype=self._grad.dtype)


class MSELoss(_Loss):
    """``mean((output - target) ** 2)`` over every element (``reduction="sum"``: the sum)."""

    def forward(self, output: Any, target: Any) -> float:
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
    """Softmax cross entropy of logits ``(N, C)`` vs class indices ``(N,)`` or probabilities ``(N, C)``."""

    def forward(self, output: Any, target: Any) -> float:
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


__all__ = ["CrossEntropyLoss", "Linear", "MSELoss", "ReLU", "Sequential"]
