"""FSDP units: groups of parameters that are gathered, freed and reduced together.

An :class:`~ferro_fsdp.FSDP` holds a root unit (the parameters no other unit claims) and, with
``wrap=``, one unit per wrapped submodule. A unit's parameters share one :class:`FlatLayout`, so
gathering it is one all-gather and reducing its gradients one reduce-scatter (or allreduce);
where every parameter splits evenly over the sharding group, one all-gather and one
reduce-scatter per parameter instead, in place (``Unit.direct``: no packing, no copy out).
Every parameter is split by the same rule whatever unit it is in, so a rank's shards, and the
order in which each element's contributions are added, do not depend on how the model is
wrapped: ``wrap=`` changes when bytes move, never the results.

:class:`Unit` does the per-unit work that :class:`~ferro_fsdp.FSDP` schedules from module hooks;
which submodules are units is the wrap policy's (:mod:`ferro_fsdp.wrap_policy`), and the arrays a
unit works in come from the FSDP's :class:`~ferro_fsdp.buffer_pool.BufferPool`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferro_backend import pack, timeline
from ferro_collective import (
    ReduceOp,
    Work,
    all_gather,
    all_gather_async,
    allreduce,
    allreduce_async,
    reduce_scatter,
    reduce_scatter_async,
)
from ferro_collective.compressed import sent_values
from ferro_collective.wire import Feedback

from .background import start
from .flat import FlatLayout
from .inflight import DoneWork, Works, give_when_done, ready
from .module import Module
from .parameter import Parameter


def _wire(wire: str | None) -> dict[str, str]:
    """A collective's ``wire=`` keyword where one is set (none: the exact call as it was)."""
    return {} if wire is None else {"wire": wire}


def freed(dtype: np.dtype) -> np.ndarray:
    """The ``.data`` of a full parameter that is not held (an empty read-only array)."""
    out = np.empty(0, dtype=dtype)
    out.flags.writeable = False
    return out


class Unit:
    """One unit of an FSDP: parameter indices ``idx`` (into the FSDP's parameter list), their
    flat layout over the sharding group, the full parameters while held, the pending gather
    and the pending gradient reductions."""

    def __init__(self, owner: Any, name: str, module: Module | None, idx: list[int],
                 reshard: bool) -> None:
        self.owner = owner
        self.name = name
        self.module = module
        self.idx = idx
        shapes = [owner._layout.shapes[i] for i in idx]
        self.dtype = owner._layout.dtype
        self.layout = FlatLayout(shapes, self.dtype, owner._layout.world)
        self.full_layout = FlatLayout(shapes, self.dtype, 1)
        # every parameter splits evenly: rank r's chunk of parameter i is its r-th slice, so
        # the unit gathers and reduces parameter by parameter, straight from the shards into
        # the full buffer and from the full gradients into the result (no packing, no copy out)
        self.direct = self.layout.world > 1 and all(n % self.layout.world == 0
                                                    for n in self.layout.numels)
        self.reshard = reshard
        # secondary_shard (hpZ): this rank's part of its node's copy of the parameters the
        # forward gathered (packed as the world's gather lays them out), and whether the
        # backward may gather from it (set by the forward's gather, spent by the backward's)
        self.secondary: np.ndarray | None = None
        self.secondary_ready = False
        self.fps: list[Parameter] | None = None      # full parameters since the last forward
        # the pending gather: a future (or the per-parameter gathers) and what it sent (None:
        # gathered in place, nothing to give back)
        self.pending: tuple[Any, np.ndarray | None] | None = None
        self.reductions: list[Work] = []               # started, not yet waited for
        self.swapped: list[tuple[np.ndarray, Any]] | None = None
        self.checked = False  # the pending gather was the user's prefetch
        self.full_buf: np.ndarray | None = None    # backs fps[i].data while held (pooled)
        self.grad_buf: np.ndarray | None = None    # backs the full gradients (pooled)
        self.result: np.ndarray | None = None      # the reduced gradient .grad views (persistent)
        self.errors: dict[int, np.ndarray] | None = None  # grads_wire's error feedback, by array
        #: grads_wire's error feedback of the allreduces (NO_SHARD's, HYBRID_SHARD's across the
        #: replicas), by series: "allreduce<i>" (a step's i-th reduction), "replicas"
        self.feedbacks: dict[str, Feedback] | None = None

    def __repr__(self) -> str:
        return f"Unit({self.name or '<root>'!r}, {len(self.idx)} params, numel={self.layout.numel})"

    @property
    def params(self) -> list[Parameter]:
        return [self.owner._params[i] for i in self.idx]

    # -- parameters ---------------------------------------------------------------------------
    def _unchanged(self, sent: np.ndarray) -> bool:
        """This rank's shards still equal what a started gather sent."""
        return all(np.array_equal(p.data, sent[o:o + c], equal_nan=True) for p, o, c in zip(
            self.params, self.layout.shard_offsets, self.layout.chunks))

    def start_gather(self, *, checked: bool = False) -> None:
        """Start the all-gather of this unit's parameters in the background (a prefetch).

        ``checked``: the user asked for it (``prefetch_forward_params``), so the shards may
        still change before it is used; ``gather`` then checks they did not."""
        if self.pending is not None or not self.owner._spec.shards_params or self.is_full():
            return
        pool = self.owner._pool
        if self.secondary_ready and self.owner._phase == "backward":
            self.start_secondary_gather()
            return
        shards = [p.data for p in self.params]
        if self.direct and not self.owner._secondary and not checked and self.layout.numel and all(
                isinstance(d, np.ndarray) and d.dtype == self.dtype and d.size == c
                and d.flags.c_contiguous for d, c in zip(shards, self.layout.chunks)):
            full, works, acc = pool.take(self.layout.numel, self.dtype), [], 0
            for d, n in zip(shards, self.layout.numels):
                works.append(start(self.owner._background, all_gather_async, all_gather,
                                   d.reshape(-1), self.owner._shard_group,
                                   timeout=self.owner._timeout, out=full[acc:acc + n],
                                   **_wire(self.owner._weights_wire)))
                acc += n
            self.pending = Works(works, full), None  # nothing sent to give back
            self.checked = False
            return
        flat = self.layout.pack_shards(shards, out=pool.take(self.layout.shard_numel, self.dtype))
        out = pool.take(self.layout.padded_numel, self.dtype)
        if self.layout.world == 1 or not self.layout.numel:
            out[...] = flat
            self.pending = ready(out), flat
            self.checked = checked
        else:
            work = start(self.owner._background, all_gather_async, all_gather, flat,
                         self.owner._shard_group, timeout=self.owner._timeout, out=out,
                         **_wire(self.owner._weights_wire))
            self.pending = work.future, flat
            self.checked = checked

    def start_secondary_gather(self) -> None:
        """The backward's gather with ``secondary_shard``: the node's secondary shards,
        gathered inside the node into the same packed buffer the world's gather made (exact:
        they hold the forward's values, decoded where ``weights_wire`` was on)."""
        owner = self.owner
        self.secondary_ready = False
        out = owner._pool.take(self.layout.padded_numel, self.dtype)
        # sent from the secondary shard itself, not a pooled copy (gather does not give it to
        # the pool; the next forward's gather rewrites it only after this one is waited for)
        work = start(owner._background, all_gather_async, all_gather, self.secondary,
                     owner._intra, timeout=owner._timeout, out=out)
        self.pending = work.future, self.secondary
        self.checked = False

    def keep_secondary(self, gathered: np.ndarray) -> None:
        """After the forward's gather over the world: keep this rank's share of its node's
        copy (``secondary_shard``)."""
        group = self.owner._intra
        part = gathered.size // group.world_size
        if self.secondary is None or self.secondary.size != part:
            self.secondary = np.empty(part, self.dtype)
        self.secondary[...] = gathered[group.rank * part:(group.rank + 1) * part]
        self.secondary_ready = True

    def ensure_fps(self) -> list[Parameter]:
        if self.fps is None:
            self.fps = [Parameter(freed(self.dtype), p.requires_grad) for p in self.params]
        return self.fps

    def is_full(self) -> bool:
        """True while the full parameters are held (or the strategy keeps them full)."""
        return self.fps is not None and all(
            fp.data.size or not n for fp, n in zip(self.fps, self.layout.numels))

    def gather(self, op: str) -> None:
        """Make the full parameters available in ``fps[i].data`` (waiting for a prefetch)."""
        from .errors import FSDPStateError

        fps = self.ensure_fps()
        if not self.owner._spec.shards_params:
            for p, fp in zip(self.params, fps):
                fp.data = p.data
            return
        if self.pending is None and self.is_full():
            return
        prefetched = self.pending is not None and self.checked
        self.start_gather()
        future, sent = self.pending
        self.pending = None
        pool = self.owner._pool
        gathered = None
        try:
            with timeline.span("fsdp.gather", "fsdp", unit=self.name or "<root>",
                               numel=self.layout.numel, prefetched=prefetched):
                gathered = future.result()  # the collective's own deadline bounds the wait
            if prefetched and not self._unchanged(sent):
                raise FSDPStateError(
                    f"FSDP.{op}: this rank's parameters changed after their all-gather was "
                    "started (an optimizer step or update_shards after prefetch_forward_params()?)"
                    "; the prefetched parameters are stale. Prefetch after the update.")
            if (op == "forward" and self.owner._secondary and self.reshard and sent is not None
                    and self.layout.world > 1):
                self.keep_secondary(gathered)
            self.give_full()
            direct, self.full_buf = sent is None, gathered if sent is None else pool.take(
                self.layout.numel, self.dtype)
            outs, acc = [], 0
            for n, shape in zip(self.layout.numels, self.layout.shapes):
                outs.append(self.full_buf[acc:acc + n].reshape(shape))
                acc += n
            if direct:  # gathered in place: the full buffer is this unit's now
                gathered = None
            else:
                self.layout.gathered_to_full(gathered, outs)
            for fp, arr in zip(fps, outs):
                fp.data = arr
        finally:
            pool.give(gathered)
            if sent is not self.secondary:  # (the secondary shard is the unit's own)
                pool.give(sent)

    def give_full(self) -> None:
        self.owner._pool.give(self.full_buf)
        self.full_buf = None

    def free(self) -> None:
        if self.fps is not None and self.owner._spec.shards_params:
            for fp in self.fps:
                fp.data = freed(self.dtype)
            self.give_full()

    def swap_in(self, with_grads: bool) -> None:
        """The module's parameters show the full data (and the full gradients, in backward)."""
        if self.swapped is not None:
            return
        self.swapped = [(p.data, p.grad, p._slot) for p in self.params]
        if with_grads and self.grad_buf is None and all(fp.grad is None for fp in self.fps):
            self.grad_buf = self.owner._pool.take(self.layout.numel, self.dtype)
        acc = 0
        for p, fp, n, shape in zip(self.params, self.fps, self.layout.numels,
                                   self.layout.shapes):
            p.data = fp.data
            if with_grads:
                p.grad = fp.grad
                slot = None
                if self.grad_buf is not None and fp.grad is None:  # layers write in place
                    slot = self.grad_buf[acc:acc + n].reshape(shape)
                p.set_grad_slot(slot)
            acc += n

    def swap_out(self, with_grads: bool) -> None:
        """The module's parameters show this rank's shards again (gradients kept in ``fps``)."""
        if self.swapped is None:
            return
        for p, fp, (data, grad, slot) in zip(self.params, self.fps, self.swapped):
            if with_grads:
                fp.grad = p.grad
            p.data, p.grad = data, grad
            p.set_grad_slot(slot)
        self.swapped = None

    # -- gradients ----------------------------------------------------------------------------
    def full_grads(self, op: str) -> list[np.ndarray | None]:
        grads = []
        for i, fp, shape in zip(self.idx, self.fps or (), self.layout.shapes):
            g = fp.grad
            if g is not None:
                g = np.asarray(g)
                if g.size != int(np.prod(shape)):
                    raise ValueError(f"FSDP.{op}: gradient of {self.owner._names[i]!r} has "
                                     f"shape {g.shape}, expected {shape}")
                g = g.astype(self.dtype, copy=False)
            grads.append(g)
        return grads

    def start_reduce(self, op: str) -> None:
        """Start averaging this unit's full gradients over the sharding group in the background
        (a reduce-scatter, or an allreduce for NO_SHARD); the full gradients are released.

        The first reduction of a step lands in the unit's persistent result buffer (what
        ``.grad`` views after the sync); any further one (a second backward outside
        ``no_sync``) in a pooled buffer that ``finish_reduce`` adds in and gives back."""
        self.ensure_fps()
        grads = self.full_grads(op)
        owner, pool = self.owner, self.owner._pool
        first = not self.reductions
        if first and self.result is not None:
            # the last sync's .grad may view the result buffer this reduction writes into: a
            # copy of it is what the sync adds the new gradient to
            for p in self.params:
                if p.grad is not None and np.may_share_memory(p.grad, self.result):
                    p.grad = np.array(p.grad, copy=True)
        if owner._spec.grad_reduce == "allreduce":
            numel = self.full_layout.numel
            if first and self.result is None:
                self.result = np.empty(numel, self.dtype)
            flat = self.result if first else pool.take(numel, self.dtype)
            if grads:
                pack([np.zeros(s, self.dtype) if g is None else np.ascontiguousarray(g)
                      for g, s in zip(grads, self.layout.shapes)], out=flat.view(np.uint8))
            group = owner._backend
            if group.world_size > 1 and numel:
                work = start(owner._background, allreduce_async, allreduce, flat, group,
                             ReduceOp.MEAN, timeout=owner._timeout, out=flat,
                             **self.wired(f"allreduce{len(self.reductions)}"))
            else:
                work = DoneWork(flat)
        else:
            if first and self.result is None:
                self.result = np.empty(self.layout.shard_numel, self.dtype)
            out = self.result if first else pool.take(self.layout.shard_numel, self.dtype)
            group = owner._shard_group
            if self.direct and self.layout.numel:
                # the path is the layout's, the same on every rank (not whether this rank has
                # every gradient: the ranks issued different reduce-scatters); a parameter
                # without a gradient counts as zeros, as on the packed path
                grads = [np.zeros(n, self.dtype) if g is None else np.ascontiguousarray(g)
                         for g, n in zip(grads, self.layout.numels)]
                for k, g in enumerate(grads):
                    self.feed_back(g.reshape(-1), group.world_size, k)
                with timeline.span("fsdp.reduce_scatter", "fsdp", unit=self.name or "<root>",
                                   numel=self.layout.numel):
                    works = [start(owner._background, reduce_scatter_async, reduce_scatter,
                                   g.reshape(-1), group, ReduceOp.MEAN, timeout=owner._timeout,
                                   out=view, **_wire(owner._grads_wire))
                             for g, view in zip(grads, self.layout.shard_views(out))]
                # the reductions read the full gradients: their buffer goes back once every
                # one of them is done (a backend's workers run its calls side by side, so the
                # last started may end first)
                give_when_done([w.future for w in works], pool, self.grad_buf)
                self.grad_buf = None
                self.reductions.append(Works(works, out))
                for fp in self.fps:
                    fp.grad = None
                return
            send = self.layout.full_to_scatter(
                grads, out=pool.take(self.layout.padded_numel, self.dtype))
            if group is not None and group.world_size > 1 and self.layout.numel:
                self.feed_back(send, group.world_size, 0)
                with timeline.span("fsdp.reduce_scatter", "fsdp", unit=self.name or "<root>",
                                   numel=self.layout.numel):
                    work = start(owner._background, reduce_scatter_async, reduce_scatter,
                                 send, group, ReduceOp.MEAN, timeout=owner._timeout, out=out,
                                 **_wire(owner._grads_wire))
                work.future.add_done_callback(lambda _, send=send: pool.give(send))
            else:
                out[...] = send[:self.layout.shard_numel]
                pool.give(send)
                work = DoneWork(out)
        self.reductions.append(work)
        for fp in self.fps:
            fp.grad = None
        pool.give(self.grad_buf)
        self.grad_buf = None

    def feed_back(self, x: np.ndarray, n: int, k: int) -> None:
        """Error feedback of ``grads_wire`` int8 / int4 (else nothing): add to ``x`` (the
        ``k``-th array this unit sends to its reduce-scatter over ``n`` ranks, in place) what
        last step's encoding of it rounded away, and keep what this one's will. (Its result,
        the rank's own chunk, is not encoded again.)"""
        if self.owner._grads_wire not in ("int8", "int4"):
            return
        if self.errors is None:
            self.errors = {}
        error = self.errors.get(k)
        if error is None or error.shape != x.shape:
            error = self.errors[k] = np.zeros_like(x)
        np.add(x, error, out=x)
        np.subtract(x, sent_values(x, n, self.owner._grads_wire, "reduce_scatter"), out=error)

    def feeds_back(self, key: str, size: int) -> bool:
        """Whether this unit's steps feed back a saved residual ``key`` of ``size`` elements
        (``wire_state``'s name without the unit: an array index ``k`` of :meth:`feed_back`, or
        ``<series>-sent`` / ``-folded`` of :meth:`wired`), as :meth:`reduce` and
        :meth:`finish_reduce` call them: one they never call (of another strategy or wrap
        policy) would be carried, unchanged, into every later save."""
        owner = self.owner
        if owner._grads_wire not in ("int8", "int4") or not self.layout.numel:
            return False
        if key.isdigit():  # a reduce-scatter's array: the packed gradient, or parameter k's
            group, k = owner._shard_group, int(key)
            if (owner._spec.grad_reduce == "allreduce" or group is None
                    or group.world_size <= 1):
                return False
            return ((k == 0 and size == self.layout.padded_numel)
                    or (self.direct and k < len(self.layout.numels)
                        and size == self.layout.numels[k]))
        series = key.rpartition("-")[0]
        if series == "replicas":
            group = owner._replicate_group
            return group is not None and group.world_size > 1
        return (series.startswith("allreduce") and series[len("allreduce"):].isdigit()
                and owner._spec.grad_reduce == "allreduce" and owner._backend.world_size > 1)

    def finish_reduce(self) -> np.ndarray:
        """Wait for the started reductions; this rank's averaged flat gradient (chunk, or the
        full flat gradient for NO_SHARD), replicated over the replicate group if any."""
        owner = self.owner
        total = None
        try:
            for work in self.reductions:
                shard = work.wait(owner._timeout)
                if total is None:
                    total = shard
                else:
                    np.add(total, shard, out=total)
                    owner._pool.give(shard)
        finally:
            self.reductions = []
        group = owner._replicate_group
        if group is not None and group.world_size > 1 and self.layout.numel:
            total = allreduce(total, group, ReduceOp.MEAN, timeout=owner._timeout, out=total,
                              **self.wired("replicas"))
        return total

    def wired(self, series: str) -> dict[str, Any]:
        """An allreduce's ``wire=`` keyword (none: exact) and, for int8 / int4, its error
        feedback: the unit's ``series`` of calls (a :class:`~ferro_collective.wire.Feedback`
        each: the call feeds back both its encodings, this rank's contribution and the chunk
        it folds; a step's second reduction, outside ``no_sync``, is a series of its own, as
        it may run beside the first)."""
        wire = self.owner._grads_wire
        kw = _wire(wire)
        if wire in ("int8", "int4"):
            if self.feedbacks is None:
                self.feedbacks = {}
            kw["feedback"] = self.feedbacks.setdefault(series, Feedback())
        return kw


__all__ = ["Unit", "freed"]
