"""``ProcessGroupFerro``: torch.distributed's collectives and messages over a ferro transport.

Every operation hands torch's CPU tensors to ferro-collective as numpy views of their memory
(no copy) and has results written straight into torch's output tensors (``out=``); a staging
copy is made only where torch's arguments cannot be one array (a list of separate output
tensors, a non-contiguous tensor).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

import ferro_collective as fc
from ferro_backend import Backend, SubBackend
from ferro_backend.base import USER_TAG_LIMIT
from ferro_collective import ReduceOp

from ._connect import connect
from ._convert import check_cpu, flat, readable, span, writable
from ._work import FerroWork, RequestWork, Runner, seconds
from .errors import as_torch_error

RedOpType = dist.ReduceOp.RedOpType

#: torch's send/recv tags must stay below ferro's user tag limit
TAG_LIMIT = USER_TAG_LIMIT

_OPS: dict = {
    RedOpType.SUM: ReduceOp.SUM,
    RedOpType.AVG: ReduceOp.MEAN,
    RedOpType.MIN: ReduceOp.MIN,
    RedOpType.MAX: ReduceOp.MAX,
    RedOpType.PRODUCT: ReduceOp.PRODUCT,
    RedOpType.BAND: ReduceOp.BAND,
    RedOpType.BOR: ReduceOp.BOR,
    RedOpType.BXOR: ReduceOp.BXOR,
}
#: torch reduces bool tensors as logical or/and for SUM/PRODUCT: on bytes, MAX/MIN
_BOOL_OPS = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PRODUCT: ReduceOp.MIN}


def _ferro_op(name: str, op) -> ReduceOp | str:
    kind = getattr(op, "op", op)
    try:
        return _OPS[kind]
    except KeyError:
        raise ValueError(f"{name}: backend 'ferro' does not support reduce op {kind}; "
                         f"supported: {[k.name for k in _OPS]}") from None


class ProcessGroupFerro(dist.ProcessGroup):
    """A torch ProcessGroup whose operations run on a ferro :class:`~ferro_backend.Backend`.

    Made by ``torch.distributed.init_process_group("ferro")`` / ``new_group(backend="ferro")``
    through :func:`ferro_torch.create_process_group`, not by hand.
    """

    def __init__(self, backend: Backend, group_name: str, *, owns_transport: bool) -> None:
        super().__init__(backend.rank, backend.world_size)
        self._b = backend
        self._name = str(group_name)
        self._owns = owns_transport
        self._runner = Runner(self._name)
        self._closed = False

    # -- identity ---------------------------------------------------------------------------
    @property
    def ferro_backend(self) -> Backend:
        """The ferro transport (a ShmBackend/TcpBackend, or a SubBackend of the world's)."""
        return self._b

    @property
    def group_name(self) -> str:
        # torch sets the name on the C++ backends it registers, which a Python group has
        # none of; DeviceMesh resolves groups by this name.
        return self._name

    def getBackendName(self) -> str:
        return "ferro"

    def __repr__(self) -> str:
        return (f"<ProcessGroupFerro {self._name!r} rank={self.rank()} size={self.size()} "
                f"{type(self._b).__name__}>")

    # -- plumbing ---------------------------------------------------------------------------
    def _run(self, name: str, outputs: list[torch.Tensor], opts, fn: Callable[[], None]
             ) -> FerroWork:
        if self._closed:
            raise RuntimeError(f"ferro {name}: process group {self._name!r} was shut down")
        work = FerroWork(name, outputs)
        return self._runner.submit(work, fn, inline=not getattr(opts, "asyncOp", True))

    @staticmethod
    def _timeout(opts) -> float | None:
        return seconds(getattr(opts, "timeout", None))

    @staticmethod
    def _check(name: str, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            check_cpu(name, t)

    @staticmethod
    def _as_reducible(name: str, a: np.ndarray, op, out: np.ndarray | None):
        """bool tensors reduce as bytes (SUM/PRODUCT as torch's or/and)."""
        if a.dtype != np.bool_:
            return a, op, out
        if op is ReduceOp.MEAN:
            raise TypeError(f"{name}: ReduceOp.AVG is not defined on bool tensors")
        return a.view(np.uint8), _BOOL_OPS.get(op, op), None if out is None else out.view(np.uint8)

    def _reduce_into(self, a: np.ndarray, op, timeout, out: np.ndarray) -> None:
        """allreduce of the 1-d ``a`` into ``out`` (may be ``a``)."""
        a, op, out = self._as_reducible("allreduce", a, op, out)
        fc.allreduce(a, self._b, op, timeout=timeout, out=out)

    # -- allreduce ----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = AllreduceOptions() if opts is None else opts
        if isinstance(opts, dist.ReduceOp | RedOpType):  # allreduce(tensors, op)
            opts, op = AllreduceOptions(), opts
            opts.reduceOp = op
        self._check("allreduce", tensors)
        op, timeout = _ferro_op("allreduce", opts.reduceOp), self._timeout(opts)

        def run() -> None:
            for t in tensors:
                with writable(t) as a:
                    self._reduce_into(a, op, timeout, a)

        return self._run("allreduce", list(tensors), opts, run)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = AllreduceCoalescedOptions() if opts is None else opts
        return self.allreduce(tensors, opts)

    # -- broadcast ----------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        opts = BroadcastOptions() if opts is None else opts
        self._check("broadcast", tensors)
        root, timeout = opts.rootRank, self._timeout(opts)

        def run() -> None:
            for t in tensors:
                with writable(t) as a:
                    fc.broadcast(a, self._b, root, timeout=timeout, out=a)

        return self._run("broadcast", list(tensors), opts, run)

    # -- all_gather ---------------------------------------------------------------------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = AllgatherOptions() if opts is None else opts
        n = self._b.world_size
        for outs, inp in zip(output_tensors, input_tensors):
            self._check("allgather", [inp, *outs])
            if len(outs) != n:
                raise ValueError(f"allgather: {len(outs)} output tensors, expected {n}")
            for o in outs:
                if o.numel() != inp.numel() or o.dtype != inp.dtype:
                    raise ValueError(f"allgather: output {o.dtype}{list(o.shape)} does not match "
                                     f"the input {inp.dtype}{list(inp.shape)}")
        timeout = self._timeout(opts)

        def run() -> None:
            for outs, inp in zip(output_tensors, input_tensors):
                x = readable(inp)
                whole = span(outs)
                if whole is not None:
                    fc.all_gather(x, self._b, timeout=timeout, out=flat(whole))
                    continue
                result = fc.all_gather(x, self._b, timeout=timeout)
                for i, o in enumerate(outs):
                    with writable(o) as dst:
                        dst[...] = result[i * x.size:(i + 1) * x.size]

        return self._run("allgather", [o for outs in output_tensors for o in outs], opts, run)

    def all_gather_single(self, output, input, opts=None):
        opts = AllgatherOptions() if opts is None else opts
        self._check("all_gather_into_tensor", [output, input])
        n = self._b.world_size
        if output.numel() != n * input.numel() or output.dtype != input.dtype:
            raise ValueError(f"all_gather_into_tensor: output {output.dtype}{list(output.shape)}, "
                             f"expected {n} x {input.dtype}{list(input.shape)}")
        timeout = self._timeout(opts)

        def run() -> None:
            with writable(output) as out:
                fc.all_gather(readable(input), self._b, timeout=timeout, out=out)

        return self._run("all_gather_into_tensor", [output], opts, run)

    _allgather_base = all_gather_single

    def _coalesced(self, name: str, one: Callable, outputs, inputs, opts):
        """One op per (output, input) pair, in order on this group's worker; the last Work
        completes after all of them."""
        works = [one(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self._run(name, [], opts, lambda: None)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = AllgatherOptions() if opts is None else opts
        return self._coalesced("allgather", self.all_gather_single, outputs, inputs, opts)

    # -- reduce_scatter -----------------------------------------------------------------------
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = ReduceScatterOptions() if opts is None else opts
        n = self._b.world_size
        for out, ins in zip(output_tensors, input_tensors):
            self._check("reduce_scatter", [out, *ins])
            if len(ins) != n or any(i.numel() != out.numel() or i.dtype != out.dtype for i in ins):
                raise ValueError(f"reduce_scatter: expected {n} inputs of "
                                 f"{out.dtype}{list(out.shape)}")
        op, timeout = _ferro_op("reduce_scatter", opts.reduceOp), self._timeout(opts)

        def run() -> None:
            for out, ins in zip(output_tensors, input_tensors):
                whole = span(ins)
                x = flat(whole) if whole is not None else readable(torch.cat([i.reshape(-1)
                                                                              for i in ins]))
                with writable(out) as dst:
                    self._reduce_scatter_into(x, op, timeout, dst)

        return self._run("reduce_scatter", list(output_tensors), opts, run)

    def _reduce_scatter_into(self, x: np.ndarray, op, timeout, out: np.ndarray) -> None:
        if x.dtype == np.bool_ or isinstance(op, str):  # via allreduce: rare dtypes and ops
            full = np.empty_like(x)
            self._reduce_into(x, op, timeout, full)
            out[...] = full.reshape(self._b.world_size, -1)[self._b.rank]
            return
        fc.reduce_scatter(x, self._b, op, timeout=timeout, out=out)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = ReduceScatterOptions() if opts is None else opts
        self._check("reduce_scatter_tensor", [output, input])
        n = self._b.world_size
        if input.numel() != n * output.numel() or output.dtype != input.dtype:
            raise ValueError(f"reduce_scatter_tensor: input {input.dtype}{list(input.shape)}, "
                             f"expected {n} x {output.dtype}{list(output.shape)}")
        op, timeout = _ferro_op("reduce_scatter_tensor", opts.reduceOp), self._timeout(opts)

        def run() -> None:
            with writable(output) as out:
                self._reduce_scatter_into(readable(input), op, timeout, out)

        return self._run("reduce_scatter_tensor", [output], opts, run)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = ReduceScatterOptions() if opts is None else opts
        return self._coalesced("reduce_scatter", self.reduce_scatter_single, outputs, inputs,
                               opts)

    # -- all_to_all ---------------------------------------------------------------------------
    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = AllToAllOptions() if opts is None else opts
        n = self._b.world_size
        self._check("all_to_all", [*output_tensors, *input_tensors])
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(f"all_to_all: {len(input_tensors)} inputs and {len(output_tensors)} "
                             f"outputs, expected {n} of each")
        timeout = self._timeout(opts)

        def run() -> None:
            xs = [readable(t) for t in input_tensors]
            for o, r in zip(output_tensors, fc.all_to_all(xs, self._b, timeout=timeout)):
                with writable(o) as dst:
                    dst[...] = r.reshape(-1)

        return self._run("all_to_all", list(output_tensors), opts, run)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        opts = AllToAllOptions() if opts is None else opts
        self._check("all_to_all_single", [output, input])
        n = self._b.world_size
        send = list(input_split_sizes) or None
        recv = list(output_split_sizes) or None
        for what, t, splits in (("input", input, send), ("output", output, recv)):
            rows = t.shape[0] if t.dim() else 1
            if splits is None and rows % n:
                raise ValueError(f"all_to_all_single: {what} dim 0 ({rows}) is not divisible by "
                                 f"world_size {n}")
            if splits is not None and (len(splits) != n or sum(splits) != rows):
                raise ValueError(f"all_to_all_single: {what} splits {splits} do not split dim 0 "
                                 f"({rows}) in {n}")
        timeout = self._timeout(opts)

        def run() -> None:
            with writable(output) as out:
                x = readable(input)
                fc.all_to_all_single(x.reshape(input.shape) if input.dim() else x, self._b,
                                     send_splits=send, recv_splits=recv, timeout=timeout,
                                     out=out.reshape(output.shape) if output.dim() else out)

        return self._run("all_to_all_single", [output], opts, run)

    alltoall_base = all_to_all_single

    # -- barrier ------------------------------------------------------------------------------
    def barrier(self, opts=None):
        opts = BarrierOptions() if opts is None else opts
        timeout = self._timeout(opts)
        return self._run("barrier", [], opts, lambda: fc.barrier(self._b, timeout=timeout))

    # -- rooted collectives -------------------------------------------------------------------
    def reduce(self, tensors, opts=None):
        opts = ReduceOptions() if opts is None else opts
        self._check("reduce", tensors)
        op, timeout, root = _ferro_op("reduce", opts.reduceOp), self._timeout(opts), opts.rootRank

        def run() -> None:
            for t in tensors:
                with writable(t) as dst:
                    a, rop, out = self._as_reducible("reduce", dst, op, dst)
                    fc.reduce(a, self._b, root, rop, timeout=timeout,
                              out=out if self._b.rank == root else None)

        return self._run("reduce", list(tensors), opts, run)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = GatherOptions() if opts is None else opts
        root, timeout = opts.rootRank, self._timeout(opts)
        self._check("gather", [*input_tensors, *(o for outs in output_tensors for o in outs)])

        def run() -> None:
            for i, inp in enumerate(input_tensors):
                x = readable(inp)
                result = fc.gather(x, self._b, root, timeout=timeout)
                if self._b.rank == root:
                    for r, o in enumerate(output_tensors[i]):
                        with writable(o) as dst:
                            dst[...] = result[r * x.size:(r + 1) * x.size]

        return self._run("gather", [o for outs in output_tensors for o in outs], opts, run)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = ScatterOptions() if opts is None else opts
        root, timeout = opts.rootRank, self._timeout(opts)
        n, me = self._b.world_size, self._b.rank
        self._check("scatter", [*output_tensors, *(i for ins in input_tensors for i in ins)])

        def run() -> None:
            for k, out in enumerate(output_tensors):
                with writable(out) as dst:
                    src = None
                    if me == root:
                        ins = input_tensors[k]
                        whole = span(ins)
                        src = flat(whole) if whole is not None else readable(
                            torch.cat([i.reshape(-1) for i in ins]))
                        src = src.reshape(n, dst.size)
                    fc.scatter(src, self._b, root, timeout=timeout, out=dst.reshape(1, -1))

        return self._run("scatter", list(output_tensors), opts, run)

    # -- point to point -----------------------------------------------------------------------
    def _check_tag(self, name: str, tag: int) -> int:
        if not 0 <= tag < TAG_LIMIT:
            raise ValueError(f"{name}: tag {tag} is outside [0, {TAG_LIMIT})")
        return tag

    def send(self, tensors, dstRank, tag=0):
        self._check("send", tensors)
        self._check_tag("send", tag)
        work = FerroWork("send", list(tensors))
        try:
            for t in tensors:
                x = readable(t)
                self._b.send(x.view(np.uint8), dstRank, tag=tag)
        except BaseException as exc:
            work._finish(as_torch_error(exc, "ferro send"))
        else:
            work._finish()
        return work

    def recv(self, tensors, srcRank, tag=0):
        self._check("recv", tensors)
        self._check_tag("recv", tag)
        if len(tensors) != 1:
            raise ValueError(f"recv: {len(tensors)} tensors, expected 1")
        (t,) = tensors
        staged = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
        req = self._b.irecv(flat(staged).view(np.uint8), srcRank, tag=tag)

        def after() -> None:
            if staged is not t:
                with torch.no_grad():
                    t.copy_(staged)

        return RequestWork("recv", [t], req, self._b.timeout, after)

    def recv_anysource(self, tensors, tag=0):
        raise ValueError("recv: backend 'ferro' needs a source rank (no receive from any source)")

    # -- lifetime -----------------------------------------------------------------------------
    def _stop(self, end_transport: Callable[[], None]) -> None:
        """Once: stop the worker, then (when this group owns the transport) end it."""
        if self._closed:
            return
        self._closed = True
        self._runner.stop()
        if self._owns:
            _forget_root(self)
            end_transport()

    def shutdown(self) -> None:
        """Stop the worker; close the transport if this group owns it."""
        self._stop(self._b.close)

    def abort(self) -> None:
        """Abort: every peer's pending operations fail (with ferro's PeerAbortedError)."""
        self._stop(lambda: self._b.abort("torch.distributed aborted the process group"))


#: the world's ferro group, if any (a subgroup of it is a SubBackend of its transport)
_root: weakref.ref | None = None
_root_lock = threading.Lock()


def _forget_root(pg: ProcessGroupFerro) -> None:
    global _root
    with _root_lock:
        if _root is not None and _root() is pg:
            _root = None


def _world_group() -> ProcessGroupFerro | None:
    """The default group when it is a live ferro group."""
    with _root_lock:
        pg = _root() if _root is not None else None
    if pg is None or pg._closed:
        return None
    try:
        if dist.group.WORLD is not pg:
            return None
    except Exception:
        return None
    return pg


def create_process_group(opts, backend_options=None) -> ProcessGroupFerro:
    """torch's creator for backend "ferro" (``register_backend(..., extended_api=True)``).

    The default group builds the job's ferro transport through torch's store; a subgroup of a
    ferro default group is a :class:`~ferro_backend.SubBackend` of it (no new connections); a
    ferro group under another default backend builds a transport of its own.
    """
    global _root
    timeout = opts.timeout.total_seconds() if isinstance(opts.timeout, timedelta) else float(
        opts.timeout)
    ranks = list(opts.global_ranks_in_group)
    world = _world_group() if ranks else None
    if world is not None and all(0 <= r < world.size() for r in ranks):
        sub = SubBackend(world.ferro_backend, ranks, name=str(opts.group_id))
        sub.timeout = timeout
        if sub.rank != opts.group_rank or sub.world_size != opts.group_size:
            raise RuntimeError(f"ferro new_group: torch made this rank {opts.group_rank} of "
                               f"{opts.group_size}, ferro {sub.rank} of {sub.world_size}")
        return ProcessGroupFerro(sub, opts.group_id, owns_transport=False)
    try:
        transport = connect(opts.store, opts.group_rank, opts.group_size, timeout)
    except BaseException as exc:
        raise as_torch_error(exc, f"ferro: rank {opts.group_rank} of {opts.group_size} could "
                                  "not join the group") from exc
    pg = ProcessGroupFerro(transport, opts.group_id, owns_transport=True)
    if not ranks:
        with _root_lock:
            _root = weakref.ref(pg)
    return pg


__all__ = ["TAG_LIMIT", "ProcessGroupFerro", "create_process_group"]
