"""Fully sharded data parallel for numpy models: the :class:`FSDP` wrapper, flattened and padded.

One :class:`FSDP` wraps one module as one unit: its parameters share one :class:`FlatLayout`,
so a forward is one all-gather and a gradient sync one reduce-scatter (or one allreduce), never
one per parameter. FSDP never replaces a Parameter object; it swaps ``.data`` and ``.grad``.
What each strategy does is read from its :class:`~ferro_fsdp.strategy.StrategySpec`; what
``.data`` and ``.grad`` hold under each strategy, and the padding of chunks, are in the package
README. This module gathers and runs forward/backward; :mod:`ferro_fsdp.grad_sync` averages the
gradients and :mod:`ferro_fsdp._state` saves and loads sharded state dicts.

A training step::

    out = fsdp(x)                         # all-gather, run, free the gathered parameters
    loss = loss_fn(out, y)
    fsdp.backward(loss_fn.backward())     # all-gather again, run module.backward, keep full grads
    fsdp.sync_gradients()                 # one reduce-scatter / allreduce of the flat gradient
    opt.step(); opt.zero_grad()           # on fsdp.module.parameters(): the shards
    fsdp.broadcast_updated_params()       # SHARD_GRAD_OP only (a no-op otherwise)
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import numpy as np

from ferro_backend import Backend, InvalidWorldSizeError, SubBackend, pack
from ferro_collective import all_gather, all_gather_async, broadcast

from ._state import ShardedStateDicts
from .errors import FSDPStateError
from .flat import FlatLayout
from .grad_sync import GradientSync
from .module import Module, ModuleWrapper, Parameter
from .strategy import ShardingStrategy


def _ready(value: np.ndarray) -> concurrent.futures.Future:
    """A finished all-gather (a group of one) as a future like an async one's."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


def _freed(dtype: np.dtype) -> np.ndarray:
    out = np.empty(0, dtype=dtype)
    out.flags.writeable = False
    return out


class FSDP(ModuleWrapper, GradientSync, ShardedStateDicts):
    """Shard ``module``'s parameters over ``backend``'s ranks with ``strategy``.

    Parameters
    ----------
    module
        A :class:`~ferro_fsdp.Module`; all its parameters must share one floating dtype. Every
        rank must pass a module with the same parameter shapes (use ``sync_module_states=True``
        when their values may differ).
    backend
        The ranks to shard over (any ``ferro_backend.Backend``).
    strategy
        A :class:`ShardingStrategy` (or its name, ``"full_shard"``...).
    intra_node_size
        HYBRID_SHARD only: ranks per node; the world size must be a positive multiple of it.
    reshard_after_forward
        Free the gathered parameters after ``forward`` (FULL_SHARD / HYBRID_SHARD; default True,
        as torch). ``backward`` then gathers them again. With False they stay until ``backward``.
    sync_module_states
        Broadcast rank 0's parameters before sharding.
    timeout
        Passed to every collective; None (the default) leaves each collective the
        backend's own ``backend.timeout``.

    Raises
    ------
    InvalidWorldSizeError
        HYBRID_SHARD without a valid ``intra_node_size`` (a divisor of the world size).
    ValueError
        ``intra_node_size`` with another strategy, an unknown strategy.
    TypeError
        Not a Module, or parameters of mixed or non-floating dtypes.
    """

    def __init__(self, module: Module, backend: Backend,
                 strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD, *,
                 intra_node_size: int | None = None, reshard_after_forward: bool | None = None,
                 sync_module_states: bool = False, timeout: float | None = None) -> None:
        if not isinstance(module, Module):
            raise TypeError(f"FSDP: module is a {type(module).__name__}, expected a ferro_fsdp.Module")
        strategy = ShardingStrategy.coerce(strategy)
        self._module = module
        self._backend = backend
        self._strategy = strategy
        self._timeout = timeout
        spec = strategy.spec
        self._spec = spec
        world, rank = backend.world_size, backend.rank
        self._intra: Backend | None = None
        self._inter: Backend | None = None
        if spec.shard_group == "intra":
            if intra_node_size is None or isinstance(intra_node_size, bool) or \
                    not isinstance(intra_node_size, int) or intra_node_size <= 0 or \
                    world % intra_node_size:
                raise InvalidWorldSizeError(
                    f"FSDP {strategy.name}: world_size {world} must be a positive multiple of "
                    f"intra_node_size {intra_node_size}")
            node, local = divmod(rank, intra_node_size)
            self._intra = SubBackend(backend, range(node * intra_node_size,
                                                    (node + 1) * intra_node_size), name="fsdp-intra")
            self._inter = SubBackend(backend, range(local, world, intra_node_size), name="fsdp-inter")
        elif intra_node_size is not None:
            raise ValueError(f"FSDP: intra_node_size {intra_node_size} is only valid for HYBRID_SHARD, "
                             f"got {strategy.name}")
        self._intra_node_size = intra_node_size

        named = module.named_parameters()
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        dtypes = {p.data.dtype for p in self._params}
        if len(dtypes) > 1:
            raise TypeError(f"FSDP: parameters have dtypes {sorted(map(str, dtypes))}; one flat "
                            "buffer needs a single dtype")
        dtype = dtypes.pop() if dtypes else np.dtype(np.float32)
        if dtype.kind not in "fc":
            raise TypeError(f"FSDP: parameter dtype {dtype} is not floating")
        shapes = [p.data.shape for p in self._params]
        groups = {"world": backend, "intra": self._intra, "inter": self._inter, None: None}
        self._shard_group: Backend | None = groups[spec.shard_group]
        self._replicate_group: Backend | None = groups[spec.replicate_group]
        shard_world = self._shard_group.world_size if self._shard_group is not None else 1
        self._shard_rank = self._shard_group.rank if self._shard_group is not None else 0
        self._layout = FlatLayout(shapes, dtype, shard_world)
        self._full_layout = FlatLayout(shapes, dtype, 1)
        self._reshard = spec.shards_params if reshard_after_forward is None else \
            bool(reshard_after_forward) and spec.shards_params
        self._full_params: list[Parameter] | None = None
        self._pending: Any = None

        if sync_module_states and world > 1 and self._params:
            flat = self._pack_full([p.data for p in self._params])
            flat = broadcast(flat, backend, 0, timeout=timeout)
            for p, value in zip(self._params, self._full_layout.gathered_to_full(flat)):
                p.data = np.array(value, copy=True)
        if spec.shards_params:
            for i, p in enumerate(self._params):
                p.data = self._layout.shard_of(i, p.data, self._shard_rank)
                p.grad = None

    # -- accessors --------------------------------------------------------------------------
    @property
    def strategy(self) -> ShardingStrategy:
        return self._strategy

    @property
    def intra_node_size(self) -> int | None:
        return self._intra_node_size

    @property
    def intra_node_group(self) -> Backend | None:
        """HYBRID_SHARD: this rank's node (the ranks it shards with); else None."""
        return self._intra

    @property
    def inter_node_group(self) -> Backend | None:
        """HYBRID_SHARD: the ranks holding the same chunk on other nodes; else None."""
        return self._inter

    @property
    def layout(self) -> FlatLayout:
        """The flat layout: shapes, chunk sizes, padding (its ``world`` is the sharding group's size)."""
        return self._layout

    @property
    def param_names(self) -> list[str]:
        return list(self._names)

    @property
    def full_params(self) -> list[Parameter]:
        """Full parameters of the last forward, in ``named_parameters`` order (empty after a sync).

        Their ``.grad`` collects the full gradients of ``backward`` until ``sync_gradients``.
        Under FULL_SHARD / HYBRID_SHARD their ``.data`` is freed (an empty array) outside
        ``forward`` and ``backward`` unless ``reshard_after_forward=False``.
        """
        return list(self._full_params) if self._full_params is not None else []

    @property
    def has_pending_prefetch(self) -> bool:
        return self._pending is not None

    def local_param_bytes(self) -> int:
        """Bytes of parameter data this rank holds now (its shards, plus full parameters if held)."""
        held = {id(_root(p.data)): _root(p.data).nbytes for p in self._params}
        for fp in self._full_params or ():
            held.setdefault(id(_root(fp.data)), _root(fp.data).nbytes)
        return sum(held.values())

    def __repr__(self) -> str:
        return (f"FSDP(strategy={self._strategy.name}, rank={self._backend.rank}, "
                f"world_size={self._backend.world_size}, {self._layout!r})")

    # -- gathering --------------------------------------------------------------------------
    def _pack_full(self, arrays: list[np.ndarray | None]) -> np.ndarray:
        out = np.empty(self._full_layout.numel, dtype=self._layout.dtype)
        if arrays:
            pack([np.zeros(s, self._layout.dtype) if a is None else
                  np.ascontiguousarray(a, dtype=self._layout.dtype)
                  for a, s in zip(arrays, self._layout.shapes)], out=out.view(np.uint8))
        return out

    def _local_flat_shard(self) -> np.ndarray:
        return self._layout.pack_shards([p.data for p in self._params])

    def _start_gather(self) -> tuple[concurrent.futures.Future, np.ndarray]:
        flat = self._local_flat_shard()
        if self._layout.world == 1 or not self._layout.numel:
            return _ready(flat.copy()), flat
        return all_gather_async(flat, self._shard_group, timeout=self._timeout).future, flat

    def _gather(self) -> list[np.ndarray]:
        """The full parameters (views into one new buffer) from this rank's shards."""
        flat = self._local_flat_shard()
        if self._layout.world > 1 and self._layout.numel:
            flat = all_gather(flat, self._shard_group, timeout=self._timeout)
        return self._layout.gathered_to_full(flat)

    def _ensure_full_params(self) -> list[Parameter]:
        if self._full_params is None:
            self._full_params = [Parameter(_freed(self._layout.dtype), p.requires_grad)
                                 for p in self._params]
        return self._full_params

    def prefetch_forward_params(self) -> None:
        """Start the all-gather of the next ``forward`` now (async); ``forward`` waits for it.

        Call it after the optimizer step (the gather snapshots the shards when it starts; a
        ``forward`` that finds this rank's shards changed since then raises FSDPStateError instead
        of running on stale parameters) and do other work before ``forward``. Valid for
        FULL_SHARD and HYBRID_SHARD (intra-node gather).

        Raises
        ------
        FSDPStateError
            A prefetch is already pending, or the strategy keeps full parameters (nothing to gather).
        """
        if not self._spec.shards_params:
            raise FSDPStateError(
                f"FSDP.prefetch_forward_params: prefetch is only valid for FULL_SHARD and "
                f"HYBRID_SHARD, got {self._strategy.name}: its parameters are already full on "
                "every rank, there is nothing to gather")
        if self._pending is not None:
            raise FSDPStateError("FSDP.prefetch_forward_params: called twice without an "
                                 "intervening forward()")
        self._pending = self._start_gather()

    # -- forward / backward -----------------------------------------------------------------
    def forward(self, x: Any) -> Any:
        """Run the module on full parameters; FULL_SHARD / HYBRID_SHARD gather them first.

        Collective for FULL_SHARD / HYBRID_SHARD: every rank of the sharding group must call it.
        A pending prefetch is consumed (and waited for) here.
        """
        fps = self._ensure_full_params()
        if not self._spec.shards_params:
            for p, fp in zip(self._params, fps):
                fp.data = p.data
            return self._module.forward(x)
        pending, self._pending = self._pending, None
        if pending is not None:
            future, sent = pending
            gathered = future.result()  # the collective's own deadline bounds the wait
            if not np.array_equal(self._local_flat_shard(), sent, equal_nan=True):
                raise FSDPStateError(
                    "FSDP.forward: this rank's parameters changed after prefetch_forward_params() "
                    "(an optimizer step or update_shards in between?); the prefetched parameters "
                    "are stale. Prefetch after the update.")
            full = self._layout.gathered_to_full(gathered)
        else:
            full = self._gather()
        for fp, arr in zip(fps, full):
            fp.data = arr
        saved = [p.data for p in self._params]
        try:
            for p, arr in zip(self._params, full):
                p.data = arr
            return self._module.forward(x)
        finally:
            for p, s in zip(self._params, saved):
                p.data = s
            if self._reshard:
                for fp in fps:
                    fp.data = _freed(self._layout.dtype)

    def backward(self, grad_output: Any) -> Any:
        """Run ``module.backward(grad_output)`` on full parameters; keep the gradients for sync.

        FULL_SHARD / HYBRID_SHARD all-gather the parameters again (unless kept by
        ``reshard_after_forward=False``) and free them afterwards. The gradients go to
        ``full_params[i].grad`` (adding to what an earlier backward left there); the module's
        own ``.grad`` is untouched until ``sync_gradients``. Returns the module's return value.
        """
        if self._full_params is None:
            raise FSDPStateError("FSDP.backward: no forward() since the last sync_gradients()")
        fps = self._full_params
        if self._spec.shards_params and any(
                fp.data.size == 0 and n for fp, n in zip(fps, self._layout.numels)):
            for fp, arr in zip(fps, self._gather()):
                fp.data = arr
        saved = [(p.data, p.grad) for p in self._params]
        try:
            for p, fp in zip(self._params, fps):
                p.data, p.grad = fp.data, fp.grad
            return self._module.backward(grad_output)
        finally:
            for p, fp, (data, grad) in zip(self._params, fps, saved):
                fp.grad = p.grad
                p.data, p.grad = data, grad
            if self._spec.shards_params:
                for fp in fps:
                    fp.data = _freed(self._layout.dtype)


def _root(arr: np.ndarray) -> np.ndarray:
    while isinstance(getattr(arr, "base", None), np.ndarray):
        arr = arr.base
    return arr


__all__ = ["FSDP"]
