"""DistributedDataParallel: replicated parameters, gradients averaged in fused buckets.

At construction rank 0's parameters are broadcast (one fused message per bucket). After
``backward`` the gradients are mean-allreduced bucket by bucket: parameters are assigned to
buckets in reverse ``named_parameters`` order (the order a backward pass produces gradients, as
in torch), each bucket holds parameters of one dtype and at most ``bucket_cap_mb`` (a larger
parameter gets a bucket of its own), and each bucket is one packed message. All buckets' async
allreduces are started before the first is waited for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from ferro_backend import Backend, pack, unpack
from ferro_collective import ReduceOp, allreduce_async, broadcast

from . import _state
from .flat import FlatLayout
from .module import Module, ModuleWrapper, Parameter


class DistributedDataParallel(ModuleWrapper):
    """Data parallel training of ``module`` over ``backend`` (every rank holds the full model).

    Parameters
    ----------
    module
        The model; every rank passes one with the same parameter shapes.
    backend
        The ranks.
    bucket_cap_mb
        Largest bucket, in MiB (torch's default, 25).
    broadcast_parameters
        Broadcast rank 0's parameters at construction (default True).
    timeout
        Passed to every collective; None (the default) leaves each collective the
        backend's own ``backend.timeout``.

    ``backward(grad_output)`` runs ``module.backward`` and then ``sync_gradients()`` (unless
    inside ``no_sync()``); a model trained without ``backward`` calls ``sync_gradients()``
    itself. After the sync every rank's ``.grad`` is the mean over ranks, bit-identical.
    """

    def __init__(self, module: Module, backend: Backend, *, bucket_cap_mb: float = 25.0,
                 broadcast_parameters: bool = True, timeout: float | None = None) -> None:
        if not isinstance(module, Module):
            raise TypeError(f"DDP: module is a {type(module).__name__}, expected a ferro_fsdp.Module")
        if bucket_cap_mb <= 0:
            raise ValueError(f"DDP: bucket_cap_mb {bucket_cap_mb}, expected > 0")
        self._module = module
        self._backend = backend
        self._timeout = timeout
        self._cap = int(bucket_cap_mb * (1 << 20))
        self._sync = True
        named = module.named_parameters()
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._buckets = self._plan_buckets([i for i in reversed(range(len(named)))
                                            if self._params[i].requires_grad])
        if broadcast_parameters and backend.world_size > 1:
            every = self._plan_buckets(list(reversed(range(len(named)))))
            for bucket in every:
                arrays = [self._params[i].data for i in bucket]
                flat = self._pack(arrays)
                flat = broadcast(flat, backend, 0, timeout=timeout)
                self._unpack_into(flat, bucket, "data")

    def _plan_buckets(self, order: list[int]) -> list[list[int]]:
        buckets: list[list[int]] = []
        open_by_dtype: dict[np.dtype, tuple[list[int], int]] = {}
        for i in order:
            p = self._params[i]
            nbytes = p.data.nbytes
            bucket, size = open_by_dtype.get(p.data.dtype, (None, 0))
            if bucket is None or (size + nbytes > self._cap and bucket):
                bucket, size = [], 0
                buckets.append(bucket)
            bucket.append(i)
            open_by_dtype[p.data.dtype] = (bucket, size + nbytes)
        return buckets

    # -- accessors --------------------------------------------------------------------------
    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names per bucket, in the order the buckets are reduced."""
        return [[self._names[i] for i in b] for b in self._buckets]

    @property
    def bucket_cap_bytes(self) -> int:
        return self._cap

    def forward(self, x: Any) -> Any:
        return self._module.forward(x)

    def backward(self, grad_output: Any) -> Any:
        """``module.backward(grad_output)``, then ``sync_gradients()`` unless in ``no_sync()``."""
        out = self._module.backward(grad_output)
        if self._sync:
            self.sync_gradients()
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside syncs them all."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # -- gradients --------------------------------------------------------------------------
    def _pack(self, arrays: list[np.ndarray | None], like: list[Parameter] | None = None) -> np.ndarray:
        like = like or []
        dtype = next((a.dtype for a in arrays if a is not None), None) or like[0].data.dtype
        filled = [np.zeros(p.data.shape, dtype) if a is None else np.ascontiguousarray(a, dtype=dtype)
                  for a, p in zip(arrays, like)] if like else [np.ascontiguousarray(a) for a in arrays]
        out = np.empty(sum(a.size for a in filled), dtype=dtype)
        pack(filled, out=out.view(np.uint8))
        return out

    def _unpack_into(self, flat: np.ndarray, bucket: list[int], attr: str) -> None:
        outs = []
        for i in bucket:
            p = self._params[i]
            cur = getattr(p, attr)
            if not (isinstance(cur, np.ndarray) and cur.shape == p.data.shape and cur.dtype == flat.dtype
                    and cur.flags.c_contiguous and cur.flags.writeable):
                cur = np.empty(p.data.shape, flat.dtype)
                setattr(p, attr, cur)
            outs.append(cur)
        unpack(flat, outs)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """After the gradients are synced: clip them to a global L2 norm of at most
        ``max_norm`` (every rank holds the same averaged gradients, so no communication) and
        return the norm before clipping."""
        return self._clip(max_norm, "DDP.clip_grad_norm_", None)

    def sync_gradients(self) -> None:
        """Mean-allreduce every gradient, one fused async allreduce per bucket. Collective.

        A parameter without a gradient counts as zeros (and gets the averaged gradient).
        """
        if self._backend.world_size == 1 or not self._buckets:
            return
        works = []
        for bucket in self._buckets:
            params = [self._params[i] for i in bucket]
            for p in params:
                if p.grad is not None and p.grad.shape != p.data.shape:
                    raise ValueError(f"DDP.sync_gradients: gradient of shape {p.grad.shape} for a "
                                     f"parameter of shape {p.data.shape}")
            flat = self._pack([p.grad for p in params], like=params)
            works.append(allreduce_async(flat, self._backend, ReduceOp.MEAN, timeout=self._timeout))
        for bucket, work in zip(self._buckets, works):
            flat = work.wait(self._timeout)
            offset = 0
            for i in bucket:  # views into the reduced bucket: no copy
                p = self._params[i]
                p.grad = flat[offset:offset + p.data.size].reshape(p.data.shape)
                offset += p.data.size

    # -- state dicts ------------------------------------------------------------------------
    def _state_plan(self) -> _state.Plan:
        dtypes = {p.data.dtype for p in self._params}
        if len(dtypes) > 1:
            raise TypeError(f"DDP state dicts need one parameter dtype, got {sorted(map(str, dtypes))}")
        layout = FlatLayout([p.data.shape for p in self._params],
                            dtypes.pop() if dtypes else np.float32, 1)
        return _state.Plan(self._backend, self._names, self._params, layout, False,
                           self._backend.world_size, self._backend.rank, self._timeout)

    def sharded_state_dict(self, optimizer: Any = None
                           ) -> tuple[dict[str, np.ndarray], dict[str, tuple]]:
        """As :meth:`ferro_fsdp.FSDP.sharded_state_dict`: each rank saves its split of the replicas."""
        return _state.save(self._state_plan(), optimizer)

    def load_sharded_state_dict(self, tensors: dict[str, Any], optimizer: Any = None) -> None:
        """As :meth:`ferro_fsdp.FSDP.load_sharded_state_dict` (gathers the full tensors). Collective."""
        _state.load(self._state_plan(), tensors, optimizer)


DDP = DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel"]
