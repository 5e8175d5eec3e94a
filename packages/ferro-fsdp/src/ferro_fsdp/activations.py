"""Activations of :mod:`ferro_fsdp.nn` (re-exported there): ``ReLU`` and ``GELU``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _gelu
from .module import Module

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


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


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


class GELU(Module):
    """``x * Phi(x)``: ``approximate="none"`` with the exact normal CDF (erf), ``"tanh"`` with
    torch's tanh formula ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate {approximate!r}, expected 'none' or 'tanh'")
        self.approximate = approximate
        self._cache: tuple[np.ndarray, np.ndarray] | None = None

    def forward(self, x: Any) -> np.ndarray:
        x = np.asarray(x)
        if self.approximate == "none":       # the compiled kernel: libm's erf, no GIL
            x = np.ascontiguousarray(x, dtype=x.dtype if x.dtype in _FLOATS else np.float64)
            out, cdf = np.empty_like(x), np.empty_like(x)
            _gelu.gelu_forward(x.reshape(-1), out.reshape(-1), cdf.reshape(-1))
            self._cache = (x, cdf)
            return out
        t = np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3))
        self._cache = (x, t)
        return 0.5 * x * (1.0 + t)

    def backward(self, grad_output: Any) -> np.ndarray:
        if self._cache is None:
            raise RuntimeError("GELU.backward: called before forward")
        x, c = self._cache
        g = np.asarray(grad_output)
        if g.shape != x.shape:
            raise ValueError(f"GELU.backward: grad_output of shape {g.shape}, expected {x.shape}")
        if self.approximate == "none":
            dtype = np.result_type(g.dtype, x.dtype)
            dtype = dtype if dtype in _FLOATS else np.dtype(np.float64)
            x, c = x.astype(dtype, copy=False), c.astype(dtype, copy=False)
            g = np.ascontiguousarray(g, dtype=dtype)
            out = np.empty_like(x)
            _gelu.gelu_backward(g.reshape(-1), x.reshape(-1), c.reshape(-1), out.reshape(-1))
            return out
        dinner = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
        return g * (0.5 * (1.0 + c) + 0.5 * x * (1.0 - c * c) * dinner)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


__all__ = ["GELU", "ReLU"]
