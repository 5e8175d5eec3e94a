"""``ModuleWrapper``: the base class of FSDP and DDP, wrappers of one module over one backend.

Besides the accessors both wrappers share, it holds the one gradient clipping behind their
``clip_grad_norm_``: they differ only in which ranks' squared sums add up to the global norm,
and the check at construction that every rank wraps the same parameters.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from typing import Any

import numpy as np

from ferro_backend import CollectiveMismatchError
from ferro_collective import all_gather, all_gather_object, allreduce

from .module import Module
from .parameter import Parameter


def _squared_sum(g: np.ndarray) -> float:
    """``sum(|g|**2)`` as a Python float: float32 / float64 gradients in their own dtype (one
    BLAS dot), narrower ones (float16) in float64, whose squares would overflow them (a norm
    past 256 read inf in float16, and clipping by it zeroed every gradient)."""
    if g.dtype.itemsize < 4 and g.dtype.kind != "c":
        g = g.astype(np.float64)
    return float(np.vdot(g, g).real)


class ModuleWrapper:
    """What FSDP and DDP share as wrappers of one module over one backend: the read-only
    ``module``/``backend``, the module's parameters (what an optimizer steps), ``train``/``eval``
    and calling the wrapper as its ``forward``."""

    _module: Module
    _backend: Any

    @property
    def module(self) -> Module:
        """The wrapped :class:`~ferro_fsdp.Module` (read-only: the wrapper keeps this one)."""
        return self._module

    @property
    def backend(self) -> Any:
        """The ``ferro_backend.Backend`` the wrapper communicates over (read-only)."""
        return self._backend

    def parameters(self) -> list[Parameter]:
        """``module.parameters()``: the Parameters an optimizer should step (under a sharding
        strategy, this rank's shards).

        Returns
        -------
        list of Parameter
        """
        return self._module.parameters()

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        """``module.named_parameters()``: the parameters with their dotted names (under a sharding
        strategy, this rank's shards, named as the full parameters they are pieces of).

        Returns
        -------
        list of (str, Parameter)
        """
        return self._module.named_parameters()

    def forward(self, x: Any) -> Any:  # pragma: no cover - every wrapper defines its own
        """Run the wrapped module (each wrapper defines it: see FSDP's and DDP's ``forward``).

        Parameters
        ----------
        x : object
            The module's input.

        Returns
        -------
        object
            The module's output.
        """
        raise NotImplementedError

    @staticmethod
    def _check_same_parameters(op: str, described: list[tuple], backend, timeout) -> None:
        """Every rank wraps the same parameters (``described``: name, full shape, dtype and
        ``requires_grad`` of each, in order): one all-gather of a 16-byte digest at construction,
        as torch's DDP verifies parameter shapes. Where a rank's differ, every rank raises
        CollectiveMismatchError naming the first such rank and the first parameter that differs
        (before, a rank with more parameters waited in a collective its peers never called
        until its deadline)."""
        if backend.world_size == 1:
            return
        digest = np.frombuffer(hashlib.sha256(repr(described).encode()).digest()[:16], np.uint8)
        every = all_gather(digest, backend, timeout=timeout).reshape(backend.world_size, -1)
        if (every == every[0]).all():
            return
        theirs = all_gather_object(described, backend, timeout=timeout)
        r = next(r for r in range(1, len(theirs)) if theirs[r] != theirs[0])
        if len(theirs[r]) != len(theirs[0]):
            how = f"rank 0 has {len(theirs[0])} parameters, rank {r} {len(theirs[r])}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(theirs[0], theirs[r])) if a != b)
            how = f"parameter {i}: rank 0's is {theirs[0][i]}, rank {r}'s {theirs[r][i]}"
        raise CollectiveMismatchError(f"{op}: the ranks wrap different parameters (name, shape, "
                                      f"dtype, requires_grad): {how}")

    def _clip(self, max_norm: float, op: str, norm_group) -> float:
        """Scale every ``.grad`` so that the global L2 norm is at most ``max_norm``; return the
        norm before clipping. ``norm_group``: the ranks whose squared sums add up to the global
        one (None when every rank holds the whole gradient)."""
        if isinstance(max_norm, bool | np.bool_) or not isinstance(max_norm, numbers.Real) \
                or not max_norm > 0:
            raise ValueError(f"{op}: max_norm {max_norm!r} must be a number > 0")
        grads = [p.grad for p in self._module.parameters() if p.grad is not None]
        local = np.array([sum(_squared_sum(g) for g in grads)], np.float64)
        if norm_group is not None and norm_group.world_size > 1:
            local = allreduce(local, norm_group)
        norm = math.sqrt(float(local[0]))
        scale = float(max_norm) / (norm + 1e-6)
        if not scale >= 1.0:  # NaN too: NaN gradients come out NaN, as torch's
            for g in grads:
                g *= g.dtype.type(scale)
        return norm

    def __call__(self, x: Any) -> Any:
        return self.forward(x)

    def train(self, mode: bool = True):
        """``module.train(mode)``: set training mode on the wrapped module and its submodules (not
        collective; every rank should use the same mode).

        Parameters
        ----------
        mode : bool, default True
            True: training; False: evaluation.

        Returns
        -------
        ModuleWrapper
            ``self`` (the wrapper, not the module), for chaining.
        """
        self._module.train(mode)
        return self

    def eval(self):
        """Evaluation mode: ``train(False)``.

        Returns
        -------
        ModuleWrapper
            ``self``, for chaining.
        """
        return self.train(False)


__all__ = ["ModuleWrapper"]
