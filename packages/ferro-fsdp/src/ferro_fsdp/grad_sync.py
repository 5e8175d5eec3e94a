"""FSDP's gradient and update side: averaging gradients, re-syncing updated parameters.

A mixin of :class:`~ferro_fsdp.FSDP`: what each step does is read from the strategy's
:class:`~ferro_fsdp.strategy.StrategySpec` (``grad_reduce``, ``replicate_group``, ``grad_form``,
``regather_after_step``), not from branches on the strategy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferro_backend import unpack
from ferro_collective import ReduceOp, all_gather, allreduce, reduce_scatter

from .errors import FSDPStateError


class GradientSync:
    """``sync_gradients``, ``broadcast_updated_params`` and ``update_shards`` of FSDP."""

    def _full_grads(self, op: str) -> list[np.ndarray | None]:
        if self._full_params is None:
            raise FSDPStateError(f"FSDP.{op}: no forward() since the last sync_gradients(); "
                                 "call forward and backward first")
        grads = []
        for name, fp, shape in zip(self._names, self._full_params, self._layout.shapes):
            g = fp.grad
            if g is not None:
                g = np.asarray(g)
                if g.size != int(np.prod(shape)):
                    raise ValueError(f"FSDP.{op}: gradient of {name!r} has shape {g.shape}, "
                                     f"expected {shape}")
                g = g.astype(self._layout.dtype, copy=False)
            grads.append(g)
        return grads

    def sync_gradients(self) -> None:
        """Average the full gradients of ``backward`` across ranks into ``module.<p>.grad``.

        FULL_SHARD: one reduce-scatter (MEAN) of the flat gradient, ``.grad`` = this rank's chunk.
        HYBRID_SHARD: intra-node reduce-scatter, then inter-node allreduce of the chunk.
        SHARD_GRAD_OP: one reduce-scatter; ``.grad`` full-shape, zero outside this rank's chunk.
        NO_SHARD: one allreduce (MEAN) of the packed gradients. A parameter without a gradient
        counts as zeros. Collective; clears ``full_params``.

        Raises
        ------
        FSDPStateError
            No forward since the last sync.
        """
        grads = self._full_grads("sync_gradients")
        spec = self._spec
        if spec.grad_reduce == "allreduce":
            flat = self._pack_full(grads)
            if self._backend.world_size > 1 and self._layout.numel:
                flat = allreduce(flat, self._backend, ReduceOp.MEAN, timeout=self._timeout)
            # the reduced gradients are views into the one reduced buffer: no copy
            views = self._full_layout.shard_views(flat)
        else:
            send = self._layout.full_to_scatter(grads)
            if self._layout.world > 1 and self._layout.numel:
                shard = reduce_scatter(send, self._shard_group, ReduceOp.MEAN,
                                       timeout=self._timeout)
            else:
                shard = send
            group = self._replicate_group
            if group is not None and group.world_size > 1 and self._layout.numel:
                shard = allreduce(shard, group, ReduceOp.MEAN, timeout=self._timeout)
            views = self._layout.shard_views(shard)
        for i, (p, view) in enumerate(zip(self._params, views)):
            p.grad = self._grad_as(spec.grad_form, i, view) if p.requires_grad else None
        self._full_params = None

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
