"""The collectives of a ferro process group: torch's broadcast, all_gather, reduce_scatter,
all_to_all, barrier, reduce, gather and scatter (and their coalesced forms) on
ferro-collective, beside all_reduce (:mod:`._allreduce`).

Every collective hands torch's CPU tensors to ferro-collective as numpy views of their memory
(no copy) and has results written straight into torch's output tensors (``out=``); a staging
copy is made only where torch's arguments cannot be one array (a list of separate output
tensors, a non-contiguous tensor).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

import ferro_collective as fc

from ._allreduce import Allreduce
from ._convert import flat, readable, span, update, writable
from ._reduce_ops import as_reducible, ferro_op
from ._work import all_of


class Collectives(Allreduce):
    """The collectives of :class:`~ferro_torch.ProcessGroupFerro`, each run in issue order by
    the group's runner (at once in the caller's thread when synchronous and nothing is
    pending)."""

    def _check_single(self, name: str, output: torch.Tensor, input: torch.Tensor, *,
                      whole: str) -> None:
        """The checks of the one-tensor forms: both CPU tensors, and the ``whole`` one
        ("output" of all_gather_into_tensor, "input" of reduce_scatter_tensor) holds world_size
        times the other's elements, of the same dtype."""
        self._check(name, [output, input])
        big, part = (output, input) if whole == "output" else (input, output)
        n = self._b.world_size
        if big.numel() != n * part.numel() or big.dtype != part.dtype:
            raise ValueError(f"{name}: {whole} {big.dtype}{list(big.shape)}, "
                             f"expected {n} x {part.dtype}{list(part.shape)}")

    # -- broadcast ----------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        """torch's ``broadcast``: every tensor of ``tensors`` from ``opts.rootRank`` to every rank,
        in place; a Work."""
        opts = BroadcastOptions() if opts is None else opts
        self._check("broadcast", tensors)
        root, timeout = opts.rootRank, self._timeout(opts)

        def run() -> None:
            for t in tensors:
                update(t, lambda a: fc.broadcast(a, self._b, root, timeout=timeout, out=a))

        return self._run("broadcast", list(tensors), opts, run)

    # -- all_gather ---------------------------------------------------------------------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        """torch's ``all_gather`` (lists): ``output_tensors[0][r]`` gets rank r's
        ``input_tensors[0]``; a Work."""
        opts = AllgatherOptions() if opts is None else opts
        n = self._b.world_size
        for outs, inp in zip(output_tensors, input_tensors):
            self._check("allgather", [inp, *outs])
            if len(outs) != n:
                raise ValueError(f"allgather: {len(outs)} output tensors, expected {n}")
            for o in outs:
                if o.shape != inp.shape or o.dtype != inp.dtype:  # (as gloo: no reshaping)
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
        """torch's ``all_gather_into_tensor``: every rank's input concatenated along dim 0 into
        ``output``; a Work."""
        opts = AllgatherOptions() if opts is None else opts
        self._check_single("all_gather_into_tensor", output, input, whole="output")
        timeout = self._timeout(opts)

        def run() -> None:
            update(output, lambda out: fc.all_gather(readable(input), self._b, timeout=timeout,
                                                     out=out))

        return self._run("all_gather_into_tensor", [output], opts, run)

    _allgather_base = all_gather_single

    def _coalesced(self, name: str, one: Callable, outputs, inputs, opts):
        """One op per (output, input) pair, in order on this group's worker; one Work over
        all of them."""
        works = [one(o, i, opts) for o, i in zip(outputs, inputs)]
        if not works:
            return self._run(name, [], opts, lambda: None)
        return all_of(name, works, self._timeout(opts) or self._b.timeout)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """torch's all_gather_coalesced: ``output_lists[r][i]`` gets rank r's ``inputs[i]``.

        Parameters
        ----------
        output_lists : list of list of torch.Tensor
        inputs : list of torch.Tensor
        opts : torch.distributed.AllgatherOptions, optional

        Returns
        -------
        torch.distributed.Work
        """
        opts = AllgatherOptions() if opts is None else opts
        n = self._b.world_size
        if len(output_lists) != n or any(len(outs) != len(inputs) for outs in output_lists):
            raise ValueError(f"allgather_coalesced: expected {n} output lists of "
                             f"{len(inputs)} tensors")
        per_input = [[outs[i] for outs in output_lists] for i in range(len(inputs))]
        return self._coalesced("allgather_coalesced",
                               lambda outs, inp, o: self.allgather([outs], [inp], o),
                               per_input, inputs, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """torch's coalesced ``all_gather_into_tensor``: each pair of (output, input) as one call; a
        Work for them all."""
        opts = AllgatherOptions() if opts is None else opts
        return self._coalesced("allgather", self.all_gather_single, outputs, inputs, opts)

    # -- reduce_scatter -----------------------------------------------------------------------
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """torch's ``reduce_scatter`` (lists): rank r's output gets the reduction
        (``opts.reduceOp``) of every rank's ``input_tensors[0][r]``; a Work."""
        opts = ReduceScatterOptions() if opts is None else opts
        n = self._b.world_size
        for out, ins in zip(output_tensors, input_tensors):
            self._check("reduce_scatter", [out, *ins])
            if len(ins) != n or any(i.numel() != out.numel() or i.dtype != out.dtype for i in ins):
                raise ValueError(f"reduce_scatter: expected {n} inputs of "
                                 f"{out.dtype}{list(out.shape)}")
        op, timeout = ferro_op("reduce_scatter", opts.reduceOp), self._timeout(opts)

        def run() -> None:
            for out, ins in zip(output_tensors, input_tensors):
                whole = span(ins)
                x = flat(whole) if whole is not None else readable(torch.cat([i.reshape(-1)
                                                                              for i in ins]))
                with writable(out) as dst:
                    self._reduce_scatter_into(x, op, timeout, dst)

        return self._run("reduce_scatter", list(output_tensors), opts, run)

    def _reduce_scatter_into(self, x: np.ndarray, op, timeout, out: np.ndarray) -> None:
        if x.dtype.kind == "c":  # (its parts, each rank's block of them its block's)
            x, op, out = as_reducible("reduce_scatter", x, op, out)
        if x.dtype == np.bool_ or isinstance(op, str):  # via allreduce: rare dtypes and ops
            full = np.empty_like(x)
            self._reduce_into(x, op, timeout, full)
            out[...] = full.reshape(self._b.world_size, -1)[self._b.rank]
            return
        fc.reduce_scatter(x, self._b, op, timeout=timeout, out=out)

    def reduce_scatter_single(self, output, input, opts=None):
        """torch's ``reduce_scatter_tensor``: the reduction of every rank's input, its dim-0 block r
        to rank r's ``output``; a Work."""
        opts = ReduceScatterOptions() if opts is None else opts
        self._check_single("reduce_scatter_tensor", output, input, whole="input")
        op, timeout = ferro_op("reduce_scatter_tensor", opts.reduceOp), self._timeout(opts)

        def run() -> None:
            update(output, lambda out: self._reduce_scatter_into(readable(input), op, timeout,
                                                                 out))

        return self._run("reduce_scatter_tensor", [output], opts, run)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """torch's coalesced ``reduce_scatter_tensor``: each pair of (output, input) as one call; a
        Work for them all."""
        opts = ReduceScatterOptions() if opts is None else opts
        return self._coalesced("reduce_scatter", self.reduce_scatter_single, outputs, inputs,
                               opts)

    # -- all_to_all ---------------------------------------------------------------------------
    def alltoall(self, output_tensors, input_tensors, opts=None):
        """torch's ``all_to_all`` (lists): ``output_tensors[s]`` gets rank s's ``input_tensors[r]``
        on rank r; a Work."""
        opts = AllToAllOptions() if opts is None else opts
        n = self._b.world_size
        self._check("all_to_all", [*output_tensors, *input_tensors])
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(f"all_to_all: {len(input_tensors)} inputs and {len(output_tensors)} "
                             f"outputs, expected {n} of each")
        timeout = self._timeout(opts)

        def run() -> None:
            xs = [readable(t) for t in input_tensors]
            if len({t.dtype for t in (*input_tensors, *output_tensors)}) > 1:
                got = fc.all_to_all(xs, self._b, timeout=timeout)  # (its refusal: on every rank)
            else:  # every block's size checked against its receiver's output, on every rank
                sizes = [o.numel() for o in output_tensors]
                whole = fc.all_to_all_single(np.concatenate(xs), self._b,
                                             send_splits=[x.size for x in xs],
                                             recv_splits=sizes, timeout=timeout)
                got = np.split(whole, np.cumsum(sizes)[:-1])
            for o, r in zip(output_tensors, got):
                with writable(o) as dst:
                    dst[...] = r.reshape(-1)

        return self._run("all_to_all", list(output_tensors), opts, run)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        """torch's ``all_to_all_single``: dim-0 blocks of ``input`` to every rank (equal, or the
        given split sizes), received into ``output``; a Work."""
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
        """torch's ``barrier``: returns a Work that completes once every rank of the group has
        entered it."""
        opts = BarrierOptions() if opts is None else opts
        timeout = self._timeout(opts)
        return self._run("barrier", [], opts, lambda: fc.barrier(self._b, timeout=timeout))

    # -- rooted collectives -------------------------------------------------------------------
    def reduce(self, tensors, opts=None):
        """torch's ``reduce``: the reduction (``opts.reduceOp``) of every rank's tensor into
        ``opts.rootRank``'s, in place; a Work."""
        opts = ReduceOptions() if opts is None else opts
        self._check("reduce", tensors)
        op, timeout, root = ferro_op("reduce", opts.reduceOp), self._timeout(opts), opts.rootRank

        def run() -> None:
            for t in tensors:
                with writable(t) as dst:
                    a, rop, out = as_reducible("reduce", dst, op, dst)
                    fc.reduce(a, self._b, root, rop, timeout=timeout,
                              out=out if self._b.rank == root else None)

        return self._run("reduce", list(tensors), opts, run)

    def gather(self, output_tensors, input_tensors, opts=None):
        """torch's ``gather``: every rank's ``input_tensors[0]`` into ``output_tensors[0]`` on
        ``opts.rootRank``; a Work."""
        opts = GatherOptions() if opts is None else opts
        root, timeout = opts.rootRank, self._timeout(opts)
        self._check("gather", [*input_tensors, *(o for outs in output_tensors for o in outs)])

        def run() -> None:
            for i, inp in enumerate(input_tensors):
                x = readable(inp)
                result = fc.gather(x, self._b, root, timeout=timeout)
                if self._b.rank == root:  # (checked once the data moved: the others are done)
                    outs = output_tensors[i] if i < len(output_tensors) else []
                    bad = [r for r, o in enumerate(outs) if o.shape != inp.shape
                           or o.dtype != inp.dtype]
                    if len(outs) != self._b.world_size or bad:
                        raise ValueError(
                            f"gather: the root's outputs must be {self._b.world_size} tensors "
                            f"of {inp.dtype}{list(inp.shape)}: "
                            + (f"output {bad[0]} is {outs[bad[0]].dtype}"
                               f"{list(outs[bad[0]].shape)}" if bad else f"got {len(outs)}"))
                    for r, o in enumerate(outs):
                        with writable(o) as dst:
                            dst[...] = result[r * x.size:(r + 1) * x.size]

        return self._run("gather", [o for outs in output_tensors for o in outs], opts, run)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """torch's ``scatter``: ``opts.rootRank``'s ``input_tensors[0][r]`` into rank r's
        ``output_tensors[0]``; a Work."""
        opts = ScatterOptions() if opts is None else opts
        root, timeout = opts.rootRank, self._timeout(opts)
        n, me = self._b.world_size, self._b.rank
        self._check("scatter", [*output_tensors, *(i for ins in input_tensors for i in ins)])
        if me == root:  # (as gloo: every input of the output's shape, one a rank)
            for out, ins in zip(output_tensors, input_tensors):
                bad = [i for i in ins if i.shape != out.shape or i.dtype != out.dtype]
                if len(ins) != n or bad:
                    raise ValueError(f"scatter: the root's inputs must be {n} tensors of "
                                     f"{out.dtype}{list(out.shape)}: " + (
                                         f"one is {bad[0].dtype}{list(bad[0].shape)}" if bad
                                         else f"got {len(ins)}"))

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


__all__ = ["Collectives"]
