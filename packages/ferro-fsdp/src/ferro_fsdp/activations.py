"""Activations of :mod:`ferro_fsdp.nn` (re-exported there): ``ReLU`` and ``GELU``."""

from __future__ import annotations

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
        """``max(x, 0)`` elementwise (NaN stays NaN); keeps where ``x <= 0`` for :meth:`backward`.

        Parameters
        ----------
        x : array_like
            Any shape.

        Returns
        -------
        numpy.ndarray
            Same shape and dtype as ``x``.
        """
        x = np.asarray(x)
        self._off = x <= 0                     # False for NaN: its gradient passes, as in torch
        return np.maximum(x, np.zeros((), dtype=x.dtype))

    def backward(self, grad_output: Any) -> np.ndarray:
        """``grad_output`` where the last forward's input was ``> 0`` or NaN, 0 elsewhere.

        Parameters
        ----------
        grad_output : array_like
            The gradient wrt the last forward's output.

        Returns
        -------
        numpy.ndarray
            The gradient wrt that forward's input.

        Raises
        ------
        RuntimeError
            No forward ran before.
        ValueError
            ``grad_output`` of another shape (it was broadcast against the input).
        """
        if self._off is None:
            raise RuntimeError("ReLU.backward: called before forward")
        g = np.asarray(grad_output)
        if g.shape != self._off.shape:
            raise ValueError(f"ReLU.backward: grad_output of shape {g.shape}, expected "
                             f"{self._off.shape}")
        return np.where(self._off, np.zeros((), dtype=g.dtype), g)


class GELU(Module):
    """``x * Phi(x)``: ``approximate="none"`` with the exact normal CDF (erf), ``"tanh"`` with
    torch's tanh formula ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    Both run in the compiled kernels of ``_gelu`` (vectorized, no GIL), in float32 or float64
    (other dtypes compute in float64). Measured on the shared 2-core AVX2 machine, 64 Ki and
    1 Mi elements (benchmarks/bench_optim.py), each is faster than the same function in numpy
    (numpy has no erf; its tanh formula makes a pass and a temporary per operation): 1.7-8x,
    except the float64 exact forward, which keeps libm's scalar erf (7-10x numpy's exact
    GELU, 0.8-1x numpy's cheaper tanh approximation). There is no faster numpy path to pick.
    The erf forward keeps ``Phi(x)`` for the backward; the tanh backward recomputes from ``x``.

    Parameters
    ----------
    approximate : {"none", "tanh"}, default "none"
        The exact erf form or torch's tanh approximation.

    Raises
    ------
    ValueError
        Another ``approximate``.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate {approximate!r}, expected 'none' or 'tanh'")
        self.approximate = approximate
        self._cache: tuple[np.ndarray, np.ndarray | None] | None = None

    def forward(self, x: Any) -> np.ndarray:
        """``x * Phi(x)``, exact (erf) or tanh-approximated as ``approximate`` says.

        Parameters
        ----------
        x : array_like
            Any shape; float32 and float64 compute in their dtype, other dtypes in float64.

        Returns
        -------
        numpy.ndarray
            Same shape as ``x``, a new contiguous array.
        """
        x = np.asarray(x)
        x = np.ascontiguousarray(x, dtype=x.dtype if x.dtype in _FLOATS else np.float64)
        out = np.empty_like(x)
        if self.approximate == "none":
            cdf = np.empty_like(x)
            _gelu.gelu_forward(x.reshape(-1), out.reshape(-1), cdf.reshape(-1))
            self._cache = (x, cdf)
        else:
            _gelu.gelu_tanh_forward(x.reshape(-1), out.reshape(-1))
            self._cache = (x, None)
        return out

    def backward(self, grad_output: Any) -> np.ndarray:
        """The gradient wrt the last forward's input: ``grad_output`` times the derivative of the
        same form (exact or tanh) at that input.

        Parameters
        ----------
        grad_output : array_like
            Same shape as the last forward's input.

        Returns
        -------
        numpy.ndarray
            In the result dtype of ``grad_output`` and the input when that is float32 or
            float64, else in float64.

        Raises
        ------
        RuntimeError
            No forward ran before.
        ValueError
            ``grad_output`` of another shape.
        """
        if self._cache is None:
            raise RuntimeError("GELU.backward: called before forward")
        x, cdf = self._cache
        g = np.asarray(grad_output)
        if g.shape != x.shape:
            raise ValueError(f"GELU.backward: grad_output of shape {g.shape}, expected {x.shape}")
        dtype = np.result_type(g.dtype, x.dtype)
        dtype = dtype if dtype in _FLOATS else np.dtype(np.float64)
        x = x.astype(dtype, copy=False)
        g = np.ascontiguousarray(g, dtype=dtype)
        out = np.empty_like(x)
        if cdf is None:
            _gelu.gelu_tanh_backward(g.reshape(-1), x.reshape(-1), out.reshape(-1))
        else:
            cdf = cdf.astype(dtype, copy=False)
            _gelu.gelu_backward(g.reshape(-1), x.reshape(-1), cdf.reshape(-1), out.reshape(-1))
        return out

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


__all__ = ["GELU", "ReLU"]
