"""The layers of :mod:`ferro_fsdp.nn` (re-exported there): numpy forward and backward.

Each ``backward(grad_output)`` adds its parameters' gradients to their ``.grad`` and returns the
gradient wrt the input; it reads the parameters' ``.data`` again (never a copy kept from
``forward``), which is what lets FSDP free gathered parameters between forward and backward.
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

    Parameters
    ----------
    in_features, out_features : int
        Sizes of the input's last dimension and of the output's (positive).
    bias : bool, default True
        Add a learned ``bias`` of shape ``(out_features,)``.
    dtype : numpy dtype, default numpy.float32
        The parameters' floating dtype.
    rng : int, numpy.random.Generator or None, default None
        Seed or generator of the initialisation (None: fresh entropy).
    input_grad : bool, default True
        Whether ``backward`` computes the gradient wrt the input.

    Raises
    ------
    ValueError, TypeError
        A size that is not positive; a dtype that is not floating.

    Examples
    --------
    >>> layer = Linear(4, 2, rng=0)
    >>> y = layer(np.ones((3, 4), np.float32))  # shape (3, 2)
    >>> gx = layer.backward(np.ones_like(y))    # adds to weight.grad and bias.grad
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
        """``x @ weight.T + bias`` over the last dimension; keeps ``x`` for :meth:`backward`.

        Parameters
        ----------
        x : array_like
            Shape ``(..., in_features)``, any leading dimensions.

        Returns
        -------
        numpy.ndarray
            Shape ``(..., out_features)``, in the result dtype of ``x`` and the weight.

        Raises
        ------
        ValueError
            The last dimension is not ``in_features``.
        """
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
        """Add ``grad_output.T @ x`` to ``weight.grad`` (and its row sums to ``bias.grad``).

        Under DDP the weight's gradient is written straight into its bucket when that slot is free
        (no copy); the result is the same as accumulating.

        Parameters
        ----------
        grad_output : array_like
            The gradient wrt the last forward's output, shape ``(..., out_features)``.

        Returns
        -------
        numpy.ndarray or None
            ``grad_output @ weight``, the gradient wrt the input; None when ``input_grad`` is False.

        Raises
        ------
        RuntimeError
            No forward ran before.
        ValueError
            ``grad_output`` does not have the output's shape.
        """
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
        self.grads_ready()  # (DDP may start their bucket while the input's gradient computes)
        return g @ w.data if self.input_grad else None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def _float_dtype(who: str, dtype: Any) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(f"{who}: dtype {dtype} is not a floating dtype")
    return dtype


def _positive(who: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
            raise ValueError(f"{who}: {name} {value!r} must be a positive int")


class Embedding(Module):
    """``weight[indices]``: a lookup table of ``num_embeddings`` rows of ``embedding_dim``.

    ``weight`` is initialised N(0, 1) like torch's. ``forward`` takes an integer array of any
    shape and returns ``[..., embedding_dim]``; an index outside ``[0, num_embeddings)`` raises
    ``IndexError`` naming it. ``backward`` adds each looked-up row's gradient into its row
    (repeated indices add up) and returns None: indices have no gradient.

    Parameters
    ----------
    num_embeddings, embedding_dim : int
        Rows of the table and the size of each (positive).
    dtype : numpy dtype, default numpy.float32
        The weight's floating dtype.
    rng : int, numpy.random.Generator or None, default None
        Seed or generator of the initialisation.

    Raises
    ------
    ValueError, TypeError
        A size that is not a positive int; a dtype that is not floating.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: Any = np.float32,
                 rng: Any = None) -> None:
        super().__init__()
        _positive("Embedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        dtype = _float_dtype("Embedding", dtype)
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.weight = Parameter(_rng(rng).standard_normal((num_embeddings, embedding_dim))
                                .astype(dtype))
        self._idx: np.ndarray | None = None

    def forward(self, indices: Any) -> np.ndarray:
        """The rows ``weight[indices]``; keeps the indices for :meth:`backward`.

        Parameters
        ----------
        indices : array_like of int
            Any shape, each in ``[0, num_embeddings)``.

        Returns
        -------
        numpy.ndarray
            Shape ``indices.shape + (embedding_dim,)``, a copy (fancy indexing).

        Raises
        ------
        TypeError
            Indices that are not integers.
        IndexError
            An index out of range (the message names it).
        """
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"Embedding.forward: indices of dtype {idx.dtype}, expected integers")
        bad = (idx < 0) | (idx >= self.num_embeddings)
        if bad.any():
            raise IndexError(f"Embedding.forward: index {idx[bad].flat[0]} out of range "
                             f"[0, {self.num_embeddings})")
        self._idx = idx
        return self.weight.data[idx]

    def backward(self, grad_output: Any) -> None:
        """Add each looked-up row's gradient into ``weight.grad`` (repeated indices add up).

        Parameters
        ----------
        grad_output : array_like
            Shape ``indices.shape + (embedding_dim,)`` of the last forward.

        Returns
        -------
        None
            Indices have no gradient.

        Raises
        ------
        RuntimeError
            No forward ran before.
        ValueError
            ``grad_output`` of another shape.
        """
        if self._idx is None:
            raise RuntimeError("Embedding.backward: called before forward")
        g = np.asarray(grad_output)
        expected = self._idx.shape + (self.embedding_dim,)
        if g.shape != expected:
            raise ValueError(f"Embedding.backward: grad_output of shape {g.shape}, expected "
                             f"{expected}")
        w = self.weight
        grad = np.zeros(w.data.shape, dtype=w.data.dtype)
        np.add.at(grad, self._idx.reshape(-1), g.reshape(-1, self.embedding_dim))
        w.accumulate_grad(grad, owned=True)
        return None

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LayerNorm(Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension (biased var).

    ``weight`` (ones) and ``bias`` (zeros) of shape ``(normalized_shape,)`` exist only when
    ``elementwise_affine``, as in torch.

    Parameters
    ----------
    normalized_shape : int or tuple of one int
        Size of the last dimension.
    eps : float, default 1e-5
        Added to the variance (>= 0).
    elementwise_affine : bool, default True
        Learn ``weight`` and ``bias``.
    dtype : numpy dtype, default numpy.float32
        The parameters' floating dtype.

    Raises
    ------
    ValueError, TypeError
        A size that is not a positive int or a negative ``eps``; a dtype that is not floating.
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-5, elementwise_affine: bool = True,
                 *, dtype: Any = np.float32) -> None:
        super().__init__()
        if isinstance(normalized_shape, tuple | list) and len(normalized_shape) == 1:
            normalized_shape = normalized_shape[0]
        _positive("LayerNorm", normalized_shape=normalized_shape)
        dtype = _float_dtype("LayerNorm", dtype)
        if not eps >= 0:
            raise ValueError(f"LayerNorm: eps {eps} must be >= 0")
        self.normalized_shape = int(normalized_shape)
        self.eps = float(eps)
        self.elementwise_affine = bool(elementwise_affine)
        if self.elementwise_affine:
            self.weight = Parameter(np.ones(self.normalized_shape, dtype))
            self.bias = Parameter(np.zeros(self.normalized_shape, dtype))
        self._cache: tuple[np.ndarray, np.ndarray] | None = None

    def forward(self, x: Any) -> np.ndarray:
        """Normalize over the last dimension (biased variance, ``eps`` added), then scale and shift
        when ``elementwise_affine``; keeps the normalized input for :meth:`backward`.

        Parameters
        ----------
        x : array_like
            Shape ``(..., normalized_shape)``.

        Returns
        -------
        numpy.ndarray
            Same shape as ``x``.

        Raises
        ------
        ValueError
            A scalar input or a last dimension other than ``normalized_shape``.
        """
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[-1] != self.normalized_shape:
            raise ValueError(f"LayerNorm.forward: input of shape {x.shape}, expected last "
                             f"dimension {self.normalized_shape}")
        centered = x - x.mean(axis=-1, keepdims=True)
        var = np.mean(centered * centered, axis=-1, keepdims=True)
        rstd = 1.0 / np.sqrt(var + np.asarray(self.eps, dtype=var.dtype))
        xhat = centered * rstd
        self._cache = (xhat, rstd)
        if not self.elementwise_affine:
            return xhat
        return xhat * self.weight.data + self.bias.data

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the ``weight`` and ``bias`` gradients (when affine) and return the input gradient.

        Parameters
        ----------
        grad_output : array_like
            The gradient wrt the last forward's output (same shape).

        Returns
        -------
        numpy.ndarray
            The gradient wrt the last forward's input.

        Raises
        ------
        RuntimeError
            No forward ran before.
        ValueError
            ``grad_output`` of another shape.
        """
        if self._cache is None:
            raise RuntimeError("LayerNorm.backward: called before forward")
        xhat, rstd = self._cache
        g = np.asarray(grad_output)
        if g.shape != xhat.shape:
            raise ValueError(f"LayerNorm.backward: grad_output of shape {g.shape}, expected "
                             f"{xhat.shape}")
        if self.elementwise_affine:
            n = self.normalized_shape
            self.weight.accumulate_grad((g * xhat).reshape(-1, n).sum(axis=0), owned=True)
            self.bias.accumulate_grad(g.reshape(-1, n).sum(axis=0), owned=True)
            g = g * self.weight.data
        return rstd * (g - g.mean(axis=-1, keepdims=True)
                       - xhat * np.mean(g * xhat, axis=-1, keepdims=True))

    def extra_repr(self) -> str:
        return (f"({self.normalized_shape},), eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class Dropout(Module):
    """In ``train()`` mode zero each element with probability ``p`` and scale the rest by
    ``1/(1-p)``; in ``eval()`` mode, or with ``p == 0``, the identity; with ``p == 1`` zeros (as
    torch's). ``backward`` applies the mask of the last forward. ``rng``: a seed or a
    ``numpy.random.Generator``.

    Parameters
    ----------
    p : float, default 0.5
        Probability of zeroing an element, in ``[0, 1]`` (else ValueError).
    rng : int, numpy.random.Generator or None, default None
        Seed or generator of the masks.
    """

    def __init__(self, p: float = 0.5, *, rng: Any = None) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p {p} outside [0, 1]")
        self.p = float(p)
        self._gen = _rng(rng)
        self._scale: np.ndarray | None = None
        self._called = False

    def forward(self, x: Any) -> np.ndarray:
        """In training mode, zero each element with probability ``p`` (a fresh mask from ``rng``
        every call) and scale the kept ones by ``1/(1-p)``; the identity in eval mode or at
        ``p == 0`` (``x`` itself is returned, not a copy); zeros at ``p == 1``.

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
        self._called = True
        if not self.training or self.p == 0.0:
            self._scale = None
            return x
        if self.p == 1.0:  # every element dropped (torch's zeros; no mask drawn)
            self._scale = np.zeros(x.shape, x.dtype)
            return x * self._scale
        keep = self._gen.random(x.shape) >= self.p
        self._scale = keep * np.asarray(1.0 / (1.0 - self.p), dtype=x.dtype)
        return x * self._scale

    def backward(self, grad_output: Any) -> np.ndarray:
        """Apply the last forward's mask and scale to ``grad_output`` (the identity if it had none).

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
            ``grad_output`` of another shape than the mask.
        """
        if not self._called:
            raise RuntimeError("Dropout.backward: called before forward")
        g = np.asarray(grad_output)
        if self._scale is None:
            return g
        if g.shape != self._scale.shape:
            raise ValueError(f"Dropout.backward: grad_output of shape {g.shape}, expected "
                             f"{self._scale.shape}")
        return g * self._scale

    def extra_repr(self) -> str:
        return f"p={self.p}"


__all__ = ["Dropout", "Embedding", "LayerNorm", "Linear"]
