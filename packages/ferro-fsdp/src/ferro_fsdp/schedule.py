"""The schedule of an FSDP's units: when each one is gathered, run, freed and reduced.

``forward`` gathers the root unit and runs the module; every other unit is gathered by a module
hook just before it runs (the next unit's gather starting in the background, in the order the
first forward recorded) and freed right after it (FULL_SHARD / HYBRID_SHARD, unless
``reshard_after_forward=False``). ``backward`` walks that order in reverse: each unit is gathered
again just before its backward and, outside ``no_sync()``, the reduction of its gradients starts
as soon as its backward is done, while the rest of the backward runs.

The reductions are collectives, matched across ranks by the order they are issued in, so every
rank issues them in one order that no rank's execution decides: the units' order reversed (the
order of a backward through a model whose units run in module order), the root last. A unit
whose backward is done before its turn waits for it; a unit whose backward did not run on this
rank (a branch this rank's batch did not take) is reduced at its turn at the end of the backward,
its missing gradients as zeros. (Issued in each rank's own order, two units of equal size
reduced together the gradients of different parameters, silently.) What a unit does is
:class:`~ferro_fsdp.units.Unit`'s; waiting for the reductions is ``sync_gradients``'
(:mod:`ferro_fsdp.grad_sync`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .errors import FSDPStateError
from .module import Module
from .units import Unit


class UnitSchedule(Module):
    """``forward``, ``backward``, ``no_sync`` and ``prefetch_forward_params`` of FSDP (a mixin
    of :class:`~ferro_fsdp.FSDP`). A Module subclass so that its ``forward`` and ``backward``
    run the hooks registered on an FSDP, as every Module's do."""

    def _init_schedule(self) -> None:
        """No execution order recorded yet, reductions on, hooks on every unit but the root."""
        self._order: list[Unit] = []      # sub-units in the order the first forward ran them
        self._recording = True
        self._phase: str | None = None    # "forward" / "backward" while FSDP runs the module
        self._sync = True
        # the reductions' common order (sub-units; the root goes last), where a backward is in it
        self._reduce_order: list[Unit] = self._units[:0:-1]
        self._turn = {id(u): k for k, u in enumerate(self._reduce_order)}
        self._next_reduce = 0             # the next unit of _reduce_order to be issued
        self._done: set[int] = set()      # units whose backward is done, waiting for their turn
        #: a backward inside no_sync() left gradients no reduction holds (every unit is reduced
        #: again by sync_gradients: the same decision on every rank)
        self._unreduced = False
        self._hook_handles = []
        for unit in self._units[1:]:
            self._hook(unit)

    def prefetch_forward_params(self) -> None:
        """Start the all-gather of the next ``forward``'s first unit now (async); ``forward``
        waits for it. (Later units are prefetched by ``forward`` itself, one ahead.)

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
        if self.has_pending_prefetch:
            raise FSDPStateError("FSDP.prefetch_forward_params: called twice without an "
                                 "intervening forward()")
        first = self._root
        if not first.layout.numel and self._order:
            first = self._order[0]
        first.start_gather(checked=True)

    # -- unit hooks -------------------------------------------------------------------------
    def _hook(self, unit: Unit) -> None:
        m = unit.module
        self._hook_handles += [
            m.register_forward_pre_hook(lambda mod, args: self._pre_forward(unit)),
            m.register_forward_hook(lambda mod, args, out: self._post_forward(unit)),
            m.register_backward_pre_hook(lambda mod, args: self._pre_backward(unit)),
            m.register_backward_hook(lambda mod, args, out: self._post_backward(unit)),
        ]

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        if self._recording or unit not in self._order:
            return None
        k = self._order.index(unit) + step
        return self._order[k] if 0 <= k < len(self._order) else None

    def _pre_forward(self, unit: Unit) -> None:
        if self._phase != "forward":
            return
        if self._recording and unit not in self._order:
            self._order.append(unit)
        unit.gather("forward")
        unit.swap_in(with_grads=False)
        nxt = self._neighbour(unit, +1)
        if nxt is not None:
            nxt.start_gather()

    def _post_forward(self, unit: Unit) -> None:
        if self._phase != "forward":
            return
        unit.swap_out(with_grads=False)
        if unit.reshard:
            unit.free()

    def _pre_backward(self, unit: Unit) -> None:
        if self._phase != "backward":
            return
        unit.gather("backward")
        unit.swap_in(with_grads=True)
        prev = self._neighbour(unit, -1)
        if prev is not None and self._spec.shards_params:
            prev.start_gather()

    def _post_backward(self, unit: Unit) -> None:
        if self._phase != "backward":
            return
        unit.swap_out(with_grads=True)
        unit.free()
        if not self._sync:
            return
        if self._turn[id(unit)] < self._next_reduce:  # its turn passed: its backward ran again
            unit.start_reduce("backward")
            return
        self._done.add(id(unit))
        self._issue_reductions(last=False)

    def _issue_reductions(self, last: bool) -> None:
        """Start the reductions whose turn has come: those of units whose backward is done, in
        the common order, up to the first one still waiting for its backward (``last``: the
        backward is over, every unit left is reduced, and the root)."""
        order = self._reduce_order
        while self._next_reduce < len(order) and (
                last or id(order[self._next_reduce]) in self._done):
            order[self._next_reduce].start_reduce("backward")
            self._next_reduce += 1
        if last:
            self._root.start_reduce("backward")
            self._done = set()
            self._unreduced = False

    def _restore(self, with_grads: bool) -> None:
        """After the module ran (or raised): every unit shows its shards again."""
        for unit in self._units:
            unit.swap_out(with_grads)
            if unit.reshard or with_grads:
                unit.free()

    # -- forward / backward -----------------------------------------------------------------
    def forward(self, x: Any) -> Any:
        """Run the module on full parameters; FULL_SHARD / HYBRID_SHARD gather each unit just
        before it runs and free it right after (the next unit's gather runs meanwhile).

        Collective for FULL_SHARD / HYBRID_SHARD: every rank of the sharding group must call it.
        A pending prefetch is consumed (and waited for) here.

        Parameters
        ----------
        x : object
            The module's input.

        Returns
        -------
        object
            The module's output.

        Raises
        ------
        FSDPStateError
            Called inside this FSDP's own forward or backward, or a prefetch found the shards
            changed since it started.
        """
        for unit in self._units:
            unit.ensure_fps()
        if self._phase is not None:
            raise FSDPStateError(f"FSDP.forward: called inside this FSDP's own {self._phase}")
        self._phase = "forward"
        ok = False
        try:
            self._root.gather("forward")
            self._root.swap_in(with_grads=False)
            if not self._recording and self._order:
                self._order[0].start_gather()
            out = self._module(x)
            ok = True
            return out
        finally:
            self._phase = None
            self._restore(with_grads=False)
            if ok:
                self._recording = False

    def backward(self, grad_output: Any) -> Any:
        """Run ``module.backward(grad_output)`` on full parameters; each unit is gathered again
        just before its backward (unless kept by ``reshard_after_forward=False``; the previous
        unit's gather runs meanwhile) and freed right after.

        The gradients go to ``full_params[i].grad`` (adding to what an earlier backward left
        there) and, outside ``no_sync()``, each unit's reduction starts as soon as its backward
        is done and the units before it in the common order (the units' order reversed) are
        started, every rank issuing them in that order (a unit this rank's backward did not
        reach at the end, its gradients zeros); the module's own ``.grad`` is untouched until
        ``sync_gradients``. Returns the module's return value.

        Parameters
        ----------
        grad_output : array_like
            The gradient wrt the output of the last ``forward``.

        Returns
        -------
        object
            What ``module.backward`` returns (the gradient wrt the input).

        Raises
        ------
        FSDPStateError
            No forward since the last ``sync_gradients``, or called inside forward/backward.
        """
        if self._root.fps is None:
            raise FSDPStateError("FSDP.backward: no forward() since the last sync_gradients()")
        if self._phase is not None:
            raise FSDPStateError(f"FSDP.backward: called inside this FSDP's own {self._phase}")
        self._phase = "backward"
        self._next_reduce, self._done = 0, set()
        try:
            self._root.gather("backward")
            self._root.swap_in(with_grads=True)
            if self._order and self._spec.shards_params:
                self._order[-1].start_gather()
            out = self._module.backward(grad_output)
        finally:
            self._phase = None
            self._restore(with_grads=True)
        if self._sync:
            self._issue_reductions(last=True)
        else:
            self._unreduced = True
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep their full gradients (no reduction starts); the next
        backward outside adds to them and reduces the sum, as torch's ``no_sync``."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous


__all__ = ["UnitSchedule"]
