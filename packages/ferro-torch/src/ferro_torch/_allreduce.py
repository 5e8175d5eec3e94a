"""torch's all_reduce on a ferro group: the one-frame synchronous call, the general path (any
tensors, op and options), sparse COO tensors (as gloo reduces them) and allreduce_coalesced.

Tensors are handed to ferro-collective as numpy views of their memory and reduced in place
(``out=``); a non-contiguous tensor through a contiguous copy written back.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceCoalescedOptions, AllreduceOptions

import ferro_collective as fc
from ferro_collective import ReduceOp

from ._convert import flat, update
from ._group_core import GroupCore
from ._reduce_ops import RedOpType, as_reducible, ferro_op
from ._sparse import sparse_allreduce
from ._work import DoneWork, seconds

#: what ``allreduce(tensors, op)`` may pass in place of options
_OP_TYPES = (dist.ReduceOp, RedOpType)
_STRIDED = torch.strided
#: the dtypes whose tensors are their numpy arrays as they are (no bool bytes, no bfloat16 view)
_PLAIN = frozenset({torch.float32, torch.float64, torch.float16, torch.int8, torch.uint8,
                    torch.int16, torch.int32, torch.int64})


class Allreduce(GroupCore):
    """all_reduce of :class:`~ferro_torch.ProcessGroupFerro` (the base of its collectives)."""

    def _reduce_into(self, a: np.ndarray, op, timeout, out: np.ndarray) -> None:
        """allreduce of the 1-d ``a`` into ``out`` (may be ``a``)."""
        a, op, out = as_reducible("allreduce", a, op, out)
        fc.allreduce(a, self._b, op, timeout=timeout, out=out)

    def allreduce(self, tensors, opts=None):
        """torch's ``all_reduce``: every tensor of ``tensors`` replaced in place by the reduction
        (``opts.reduceOp``) over the ranks, the same bits on every rank (sparse COO: SUM, as
        gloo); a Work."""
        if (type(opts) is AllreduceOptions and not getattr(opts, "asyncOp", True)
                and len(tensors) == 1
                and self._coalescing is None and not self._closed):
            t = tensors[0]
            if (isinstance(t, torch.Tensor) and t.is_cpu and t.layout is _STRIDED
                    and t.dtype in _PLAIN and t.is_contiguous()):
                done = self._allreduce_now(t, tensors, opts)
                if done is not None:
                    return done
        return self._allreduce(tensors, opts)

    def _allreduce_now(self, t: torch.Tensor, tensors, opts) -> DoneWork | None:
        """torch's common call (``dist.all_reduce`` of one contiguous CPU tensor of a plain
        dtype, synchronous) in one frame, at once in this thread; None when something of the
        group is pending (then :meth:`_allreduce` queues it behind)."""
        op, timeout = ferro_op("allreduce", opts.reduceOp), seconds(opts.timeout)
        try:
            a = t.numpy().reshape(-1)
        except RuntimeError:  # a tensor that requires grad, or with a conjugate/negative bit
            a = flat(t)
        if not self._runner.run_now("allreduce", lambda: timeout or self._b.timeout,
                                    lambda: fc.allreduce(a, self._b, op, timeout=timeout,
                                                         out=a)):
            return None
        return DoneWork("allreduce", tensors)

    def _allreduce(self, tensors, opts):
        if opts is None:
            opts = AllreduceOptions()
        elif isinstance(opts, _OP_TYPES):  # allreduce(tensors, op)
            opts, op = AllreduceOptions(), opts
            opts.reduceOp = op
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.layout is torch.sparse_coo:
                return self._sparse_allreduce(tensors, opts)
        self._check("allreduce", tensors)
        op, timeout = ferro_op("allreduce", opts.reduceOp), self._timeout(opts)

        def run() -> None:
            for t in tensors:
                update(t, lambda a: self._reduce_into(a, op, timeout, a))

        return self._run("allreduce", list(tensors), opts, run)

    def _sparse_allreduce(self, tensors, opts):
        """gloo's allreduce of sparse COO tensors (SUM only, as gloo's)."""
        if ferro_op("allreduce", opts.reduceOp) is not ReduceOp.SUM:
            raise ValueError("allreduce: sparse tensors are reduced with ReduceOp.SUM only")
        for t in tensors:
            if t.layout is not torch.sparse_coo or t.device.type != "cpu":
                raise ValueError(f"allreduce: sparse and dense tensors in one call ({t.layout} "
                                 f"on {t.device})")
        timeout = self._timeout(opts)

        def run() -> None:
            for t in tensors:
                sparse_allreduce(t, self._b, timeout)

        return self._run("allreduce", list(tensors), opts, run)

    def allreduce_coalesced(self, tensors, opts=None):
        """torch's ``all_reduce_coalesced``: every tensor of ``tensors`` reduced in place as one
        call; a Work."""
        opts = AllreduceCoalescedOptions() if opts is None else opts
        return self.allreduce(tensors, opts)


__all__ = ["Allreduce"]
