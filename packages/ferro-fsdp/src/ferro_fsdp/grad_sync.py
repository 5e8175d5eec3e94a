"""FSDP's gradient and update side: averaging gradients, re-syncing updated parameters.

A mixin of :class:`~ferro_fsdp.FSDP`: what each step does is read from the strategy's
:class:`~ferro_fsdp.strategy.StrategySpec` (``grad_reduce``, ``replicate_group``, ``grad_form``,
``regather_after_step``), not from branches on the strategy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferro_backend import unpack
from ferro_collective import all_gather

from .errors import FSDPStateError


class GradientSync:
    """``sync_gradients``, ``broadcast_updated_params`` and ``update_shards`` of FSDP."""

    def sync_gradients(self) -> None:
        """Average the full gradients of ``backward`` across ranks into ``module.<p>.grad``
        (added to a ``.grad`` that an earlier sync left there, as torch accumulates: call the
        optimizer's ``zero_grad`` between steps).

        Per unit (one for ``wrap=None``): FULL_SHARD: one reduce-scatter (MEAN) of the unit's
        flat gradient, ``.grad`` = this rank's chunk. HYBRID_SHARD: intra-node reduce-scatter,
        then inter-node allreduce of the chunk. SHARD_GRAD_OP: one reduce-scatter; ``.grad``
        full-shape, zero outside this rank's chunk. NO_SHARD: one allreduce (MEAN) of the packed
        gradients. Reductions the backward already started are only waited for. A parameter
        without a gradient counts as zeros. Nested FSDPs sync first. Collective; clears
        ``full_params``.

        Raises
        ------
        FSDPStateError
            No forward since the last sync.
        """
        if self._root.fps is None:
            raise FSDPStateError("FSDP.sync_gradients: no forward() since the last "
                                 "sync_gradients(); call forward and backward first")
        for inner in self._nested:
            inner.sync_gradients()
        spec = self._spec
        try:
            # decided the same on every rank (not from this rank's gradients: a unit whose
            # backward ran on some ranks only was reduced on those, and paired with another
            # unit's reduction on the others): every unit again where a backward inside
            # no_sync() left gradients, or no backward outside it started the reductions
            if self._unreduced or any(not unit.reductions for unit in self._units):
                for unit in self._units:
                    unit.start_reduce("sync_gradients")
            for unit in self._units:
                flat = unit.finish_reduce()
                layout = unit.full_layout if spec.grad_reduce == "allreduce" else unit.layout
                for i, view in zip(unit.idx, layout.shard_views(flat)):
                    p = self._params[i]
                    if not p.requires_grad:
                        p.grad = None
                        continue
                    grad = self._grad_as(spec.grad_form, i, view)
                    # a gradient a sync left (and no zero_grad cleared): add to it, as torch;
                    # start_reduce copied it out of the result buffer this one is written to
                    p.grad = grad if p.grad is None or np.shape(p.grad) != grad.shape \
                        else p.grad + grad
        finally:
            for unit in self._units:
                unit.reductions = []
                unit.fps = None
                if unit.pending is not None:  # a prefetch nobody used: let it finish, drop it
                    future, _ = unit.pending
                    unit.pending = None
                    future.result()
            self._unreduced = False

    def _grad_as(self, form: str, i: int, view: np.ndarray) -> np.ndarray:
        """Parameter ``i``'s reduced gradient in the strategy's ``grad_form``."""
        if form == "full":
            return view.reshape(self._layout.shapes[i])
        if form == "chunk":
            return view
        start, length = self._layout.region(i, self._shard_rank)  # "scattered"
        full = np.zeros(self._layout.shapes[i], self._layout.dtype)
        full.reshape(-1)[start:start + length] = view[:length]
        return full

    def clip_grad_norm_(self, max_norm: float) -> float:
        """After :meth:`sync_gradients`: clip the gradients to a global L2 norm of at most
        ``max_norm`` (as torch's ``clip_grad_norm_``) and return the norm before clipping.

        The norm is over the whole model: sharded gradients (FULL_SHARD, SHARD_GRAD_OP, a node
        of HYBRID_SHARD) add their squared sums over the sharding group; full ones (NO_SHARD)
        are the same on every rank. Every rank gets the same norm and scales the same way.
        Collective for the sharded strategies.

        Parameters
        ----------
        max_norm : float
            The largest global L2 norm (> 0).

        Returns
        -------
        float
            The global norm before clipping, the same on every rank.

        Raises
        ------
        ValueError
            ``max_norm`` is not a number > 0.
        """
        group = None if self._spec.grad_form == "full" else self._shard_group
        return self._clip(max_norm, "FSDP.clip_grad_norm_", group)

    def broadcast_updated_params(self) -> None:
        """SHARD_GRAD_OP: after the optimizer step, rebuild every full parameter from each rank's
        updated chunk (one all-gather). A no-op for the other strategies. Collective."""
        if not self._spec.regather_after_step or self._layout.world == 1 \
                or not self._layout.numel:
            return
        r = self._shard_rank
        chunks = [self._layout.shard_of(i, p.data, r) for i, p in enumerate(self._params)]
        flat = all_gather(self._layout.pack_shards(chunks), self._shard_group,
                          timeout=self._timeout)
        for p, full in zip(self._params, self._layout.gathered_to_full(flat)):
            if p.data.flags.c_contiguous and p.data.flags.writeable and p.data.shape == full.shape:
                p.data[...] = full
            else:
                p.data = np.array(full, copy=True)

    def update_shards(self, flat: Any) -> None:
        """Overwrite this rank's parameter data (shards, or full parameters) from one flat array.

        ``flat`` holds ``sum(p.data.size)`` elements in ``named_parameters`` order (for
        FULL_SHARD the padded chunks back to back, ``layout.shard_numel`` elements).

        Parameters
        ----------
        flat : array_like
            The new values (any shape; flattened, cast to the parameters' dtype).

        Raises
        ------
        ValueError
            ``flat`` has another number of elements.
        """
        flat = np.asarray(flat).reshape(-1)
        total = sum(p.data.size for p in self._params)
        if flat.size != total:
            raise ValueError(f"FSDP.update_shards: expected {total} elements but got {flat.size}")
        flat = np.ascontiguousarray(flat, dtype=self._layout.dtype)
        outs = []
        for p in self._params:
            if not (p.data.flags.c_contiguous and p.data.flags.writeable
                    and p.data.dtype == self._layout.dtype):
                p.data = np.array(p.data, dtype=self._layout.dtype, copy=True)
            outs.append(p.data)
        if outs:
            unpack(flat, outs)


__all__ = ["GradientSync"]
