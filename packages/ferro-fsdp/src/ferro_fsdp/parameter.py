"""``Parameter``: a trainable array, its gradient, and the gradient's optional persistent home.

Optimizers step Parameters and distributed wrappers shard them; neither ever replaces a Parameter
object, they swap its ``data`` and ``grad``. A gradient *slot* (:meth:`Parameter.set_grad_slot`)
is a buffer the next fresh gradient is written into instead of a new array: DDP's bucket views,
FSDP's pooled full-gradient buffers. :class:`~ferro_fsdp.module.Module` registers Parameters.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Parameter:
    """A trainable array: ``data``, its gradient ``grad`` (None until a backward), ``requires_grad``.

    The array is not copied. Distributed wrappers swap ``data`` and ``grad`` but never replace the
    Parameter object, so an optimizer built on it stays valid for the whole run.

    Parameters
    ----------
    data : array_like
        The values (``numpy.asarray(data)``).
    requires_grad : bool, default True
        False: backward passes and optimizers leave this parameter alone.

    Examples
    --------
    >>> w = Parameter(np.zeros((2, 3), np.float32))
    >>> w.accumulate_grad(np.ones((2, 3))); float(w.grad.sum())
    6.0
    """

    __slots__ = ("__weakref__", "_slot", "data", "grad", "requires_grad")

    def __init__(self, data: Any, requires_grad: bool = True) -> None:
        self.data: np.ndarray = np.asarray(data)
        self.grad: np.ndarray | None = None
        self.requires_grad: bool = bool(requires_grad)
        self._slot: np.ndarray | None = None

    def set_grad_slot(self, slot: np.ndarray | None) -> None:
        """Give the gradient a persistent home (DDP: a view into its bucket), or take it away.

        While a slot is set, a backward that finds no gradient writes the new one into the slot
        (``.grad`` becomes the slot itself) and later backwards add to it in place, so the
        bucket never needs packing.

        Parameters
        ----------
        slot : numpy.ndarray or None
            A writable array of the parameter's shape; None removes the slot.

        Raises
        ------
        ValueError
            A slot of another shape, or read-only.
        """
        if slot is not None and (slot.shape != self.data.shape or not slot.flags.writeable):
            raise ValueError(f"Parameter.set_grad_slot: slot of shape {slot.shape} "
                             f"(writeable={slot.flags.writeable}), expected a writable "
                             f"{self.data.shape}")
        self._slot = slot

    def free_grad_slot(self) -> np.ndarray | None:
        """The slot a layer may write a fresh gradient straight into (``np.matmul(...,
        out=slot)``, then ``.grad = slot``): only while there is no gradient yet and the
        parameter has a slot of its dtype; else None (use :meth:`accumulate_grad`).

        Returns
        -------
        numpy.ndarray or None
        """
        if self.grad is None and self.requires_grad:
            return self._slot
        return None

    @property
    def shape(self) -> tuple[int, ...]:
        """``data.shape``: under a sharding strategy, this rank's shard's (flat) shape."""
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        """``data.dtype``."""
        return self.data.dtype

    @property
    def size(self) -> int:
        """``data.size``, the number of elements of ``data`` (of the shard, when sharded)."""
        return self.data.size

    def accumulate_grad(self, grad: np.ndarray, *, owned: bool = False) -> None:
        """Add ``grad`` to ``.grad`` (or set it when there is none); no-op if not ``requires_grad``.

        ``owned=True`` hands over a fresh array that nobody else references (a layer's own
        result): it becomes ``.grad`` without a copy.

        Parameters
        ----------
        grad : array_like
            A gradient of the parameter's shape (cast to its dtype).
        owned : bool, default False
            The caller hands ``grad`` over (no copy).

        Raises
        ------
        ValueError
            ``grad`` has another shape.
        """
        if not self.requires_grad:
            return
        grad = np.asarray(grad, dtype=self.data.dtype)
        if grad.shape != self.data.shape:
            raise ValueError(
                f"Parameter.accumulate_grad: gradient of shape {grad.shape}, "
                f"expected the parameter's shape {self.data.shape}"
            )
        slot = self._slot
        if self.grad is None:
            if slot is not None:
                np.copyto(slot, grad)
                self.grad = slot
            else:
                self.grad = grad if owned and grad.flags.writeable else np.array(grad, copy=True)
        elif slot is not None and self.grad is slot:
            np.add(slot, grad, out=slot)
        else:
            self.grad = self.grad + grad

    def __repr__(self) -> str:
        return (f"Parameter(shape={self.data.shape}, dtype={self.data.dtype}, "
                f"requires_grad={self.requires_grad})")


__all__ = ["Parameter"]
