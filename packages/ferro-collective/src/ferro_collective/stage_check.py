"""The whole-call check of a multi-node job's hierarchical calls.

A hierarchical call runs as stages on two groups, this rank's node and its cross group (the
ranks of its local index on every node), each stage a collective of its own with its own
header. Checked stage by stage, a disagreement seen inside one node would leave the other
nodes' ranks waiting for it in a cross-node stage until their deadline, and the stages'
numbers out of step after it. So the call checks itself whole, on both groups, before any
stage that could meet a disagreement (:class:`StageSet`):

1. on the node, before any cross-node stage, every rank publishes the call's own header (what
   the user called: collective, dtype, shape, op, root) with its span there, the numbers the
   call takes on the node: in its first node stage's place where the call starts on the node
   (:data:`.costmodel.NODE_FIRST`; on an engine the door's header names the user's call,
   ``FERRO_OPTS_CALL``/``FERRO_OPTS_OP``: no step of its own), else (a broadcast) in a step
   of its own first;
2. across nodes, the same with the span there, or, where its node disagreed, a refusal that
   says so: as the first cross-node stage's header exchange (that stage's body follows on its
   tags, and the call's later cross-node stages start once it passed), or as a check of its
   own where this rank's stages take no cross-node number (a broadcast's ranks of another local
   index than the root's). Every cross group holds a rank of every node, so every rank learns
   of any disagreement, inside a node or between nodes, and raises
   :class:`~ferro_backend.CollectiveMismatchError` there.

After a disagreement no further stage starts: every rank gives back the numbers no stage took
(the node stages that ran before it, every rank of a node alike, are the same on all of them)
and, on a group whose ranks' spans differ (the same collective at another size takes another
number of pieces), the ranks whose call took fewer skip the difference, so the next call is
the next call on every rank (unless this rank numbered a call after it: then, as on a flat
job, that call meets its peers' calls apart). The stages' own header exchanges over
point-to-point messages are skipped (the whole call agrees, so every stage does), but a
pipelined call's later cross-node pieces', whose round trips pace their data. The check
costs an allreduce, reduce_scatter, all_gather or barrier no message or step of its own, a
broadcast one engine step and, on the ranks of other local indexes than the root's, one
cross-node exchange; it is off with the mismatch check (:func:`.header.set_mismatch_check`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from ferro_backend import CollectiveMismatchError, CollectiveTimeoutError, DistributedError

from .costmodel import NODE_FIRST
from .engine_group import group_of
from .header import check_all, collective_code, dtype_code, encode, refusal, span_of
from .ops import OPS
from .p2p import header_exchange
from .per_backend import recorded, reserve, state
from .plan import Plan


class Check(Plan):
    """One header exchange on one group in the call's place (``header(seq)``: what this rank
    publishes): every rank learns every rank's header, and all raise where they disagree."""

    __slots__ = ("header_of",)

    def __init__(self, name: str, backend, timeout: float | None,
                 header_of: Callable[[int], bytes], seq: int | None = None) -> None:
        super().__init__(name, backend, timeout, (None, (), None, -1), lambda ctx: None,
                         seq=seq)
        self.header_of = header_of

    def encoded(self) -> bytes:
        return self.header_of(self.seq)

    def run_python(self) -> None:
        header_exchange(self.context(), self.encoded())

    def run_engine(self, group, call) -> None:
        group.exchange(call, self.encoded())

    def run(self) -> None:
        """Run it now (its number taken): on the group's engine in its turn, else over
        point-to-point messages."""
        group = group_of(self.backend)
        if group is not None:
            group.run(self)
        else:
            self.run_python()


class Whole(NamedTuple):
    """What a hierarchical call's first node stage publishes in its own place on an engine:
    ``header(seq)``, the whole call's header (Python's steps), and for the door's header the
    collective and op codes and the shape and element type it names instead of its own."""

    header: Callable[[int], bytes]
    code: int
    op: int
    shape: tuple
    type_name: bytes | None


class StageSet:
    """A hierarchical call of ``plan`` on hierarchy ``h``, numbered now: its stages' numbers
    (``plan.stages(h)``, run by ``execute``), and on a group where no stage carries the check
    (:data:`NODE_FIRST`; the cross group's first stage, unless this rank's stages take no
    cross-node number there, as a broadcast's ranks of other local indexes than the root's, or
    the group has an engine) a number for a check of its own, taken first."""

    def __init__(self, plan: Plan, h, execute) -> None:
        self.plan = plan
        node, cross = self.groups = (h.node, h.cross)
        # (a cross group on an engine checks in a step of its own, first: the node then does
        # too, so that its verdict comes before any cross-node exchange)
        engine_across = group_of(cross) is not None
        ahead = reserve(node) if plan.name not in NODE_FIRST or engine_across else []
        across = reserve(cross) if engine_across else []  # (in ticket order)
        with recorded() as taken:
            self.stages = plan.stages(h)
        #: every number the call takes on each group, in order (a check of its own first)
        self.numbers = [ahead + taken.get(node, []), across + taken.get(cross, [])]
        #: the group's first stage exchanges the whole call's header (node: in its own place)
        self.carried = [not ahead and bool(self.numbers[0]), not across and bool(self.numbers[1])]
        if not self.numbers[1]:
            self.numbers[1] = reserve(cross)
        self.started: set[tuple[int, int]] = set()
        self.failed: dict[int, BaseException] = {}
        #: set once the first cross-node exchange has run (the later cross-node stages wait)
        self.decided = threading.Event()
        self.execute = _Checked(self, execute)

    def __call__(self) -> Any:
        self.check()
        try:
            return self.stages(self.execute)
        except CollectiveMismatchError as exc:
            if isinstance(self.failed.get(0), CollectiveMismatchError):
                self.refuse_across(self.failed[0])  # (the node's first stage met it)
            if not any(isinstance(e, CollectiveMismatchError) for e in self.failed.values()):
                raise
            self.abandon()
            group, first = min(self.failed.items())
            raise _named(first if isinstance(first, CollectiveMismatchError) else exc,
                         self.plan.name, self.groups[group]) from None

    def header(self, group: int) -> Callable[[int], bytes]:
        """The whole call's header on group ``group`` (0: node, 1: cross), by number."""
        plan, span = self.plan, len(self.numbers[group])
        return lambda seq: encode(plan.name, *plan.header, seq=seq, span=span)

    def whole(self, group: int = 0) -> Whole:
        """What group ``group``'s first stage publishes in its own place (:class:`Whole`)."""
        dtype, shape, op = (*self.plan.header, None)[:3]  # (a barrier's names no op)
        return Whole(self.header(group), collective_code(self.plan.name),
                     0 if op is None else OPS[op].wire, tuple(shape),
                     None if dtype is None else dtype_code(dtype))

    def check(self) -> None:
        """The whole call's header on the node, then across nodes, where no stage carries it
        (a refusal across nodes where the node disagreed); after a disagreement no stage runs,
        their numbers are given back and the mismatch raised."""
        if all(self.carried):
            return
        name, timeout = self.plan.name, self.plan.timeout
        node = self.groups[0]
        if not self.carried[0]:
            self.started.add((0, self.numbers[0][0]))
            try:
                Check(name, node, timeout, self.header(0), self.numbers[0][0]).run()
            except CollectiveMismatchError as exc:
                self.failed[0] = exc
                self.refuse_across(exc)
        if not self.failed and not self.carried[1]:
            self.started.add((1, self.numbers[1][0]))
            try:
                Check(name, self.groups[1], timeout, self.header(1), self.numbers[1][0]).run()
            except CollectiveMismatchError as exc:
                self.failed[1] = exc
        if self.failed:
            self.abandon()
            group, exc = min(self.failed.items())
            raise _named(exc, name, self.groups[group]) from None

    def refuse_across(self, exc: CollectiveMismatchError) -> None:
        """The node disagreed (``exc``): say so in the call's first cross-node exchange (its
        peers there raise; what they called may owe this rank numbers: their spans)."""
        name, node, span = self.plan.name, self.groups[0], len(self.numbers[1])
        why = CollectiveMismatchError(f"ranks {list(node.global_ranks)} of its node disagree")

        def header(seq: int) -> bytes:
            return refusal(name, seq, why, span)

        self.started.add((1, self.numbers[1][0]))
        try:
            Check(name, self.groups[1], self.plan.timeout, header, self.numbers[1][0]).run()
        except CollectiveMismatchError as theirs:
            self.failed[1] = theirs

    def abandon(self) -> None:
        """No more stage starts: give back every number no stage started, and skip, where a
        peer's call took more numbers on a group whose check failed, the difference (a group
        where the call takes one number caught up in its check's exchange already)."""
        for i, group in enumerate(self.groups):
            numbers, exc = self.numbers[i], self.failed.get(i)
            headers = getattr(exc, "headers", None)
            most = max(map(span_of, headers)) if headers else len(numbers)
            count = most - len(numbers) if len(numbers) > 1 else 0
            unrun = [s for s in numbers if (i, s) not in self.started]
            state(group).abandon(unrun, count, self.plan.timeout)


class _Checked:
    """``execute`` for the stages of a :class:`StageSet`: their plans skip their own header
    exchanges over point-to-point messages (the whole call's check covered them). A group's
    first stage, where it carries the check, publishes the whole call's header in its own place
    (:class:`Whole`; the door's header on an engine, its header exchange over point-to-point
    messages), but a pipelined allreduce's first cross-node piece, whose later pieces wait for
    its exchange alone: that exchange runs first on its number (its body's messages follow on
    the same number's tags), and the later pieces keep their own."""

    __slots__ = ("calls", "execute")

    def __init__(self, calls: StageSet, execute) -> None:
        self.calls, self.execute = calls, execute

    def __call__(self, plan: Plan) -> Any:
        calls = self.calls
        i = 1 if plan.backend is calls.groups[1] else 0
        first = calls.carried[i] and plan.seq == calls.numbers[i][0]
        calls.started.add((i, plan.seq))
        if first:
            return self._first(i, plan)
        if i == 1 and calls.carried[1]:
            calls.decided.wait(plan.timeout)
            failed = calls.failed.get(1)
            if failed is not None or not calls.decided.is_set():
                raise CollectiveMismatchError(
                    f"{calls.plan.name}: the call's first cross-node exchange failed") \
                    if isinstance(failed, CollectiveMismatchError) else \
                    CollectiveTimeoutError(f"{calls.plan.name} (seq {plan.seq}): its first "
                                           "cross-node exchange did not end")
        # (a pipelined call's later cross-node pieces keep their headers' round trip: it paces
        # their data onto the link, 16 MiB at 2 x 2 and 1 Gbit/s 2% faster than without)
        plan.checked = i == 0 or not calls.carried[1]
        return self.execute(plan)

    def _first(self, i: int, plan: Plan) -> Any:
        """Group ``i``'s first stage, carrying the whole call's check."""
        calls = self.calls
        try:
            if i == 0 or len(calls.numbers[1]) == 1:  # (no later stage waits for its exchange
                # alone: its own exchange publishes the whole call's header)
                plan.whole, plan.span = calls.whole(i), len(calls.numbers[i])
                return self.execute(plan)
            Check(calls.plan.name, plan.backend, plan.timeout, calls.header(i), plan.seq).run()
        except BaseException as exc:
            calls.failed[i] = exc
            raise
        finally:
            if i == 1:
                calls.decided.set()
        plan.checked = True
        return self.execute(plan)

    def prepare(self, name: str, *args) -> Plan:
        return self.execute.prepare(name, *args)


class Refused:
    """A hierarchical call this rank refused (its own arguments were wrong: ``exc``): it takes
    the call's places (one among the job's calls, its check's on the node and across nodes) and
    publishes there, in the background, a refusal saying why, so that every peer's check raises
    :class:`~ferro_backend.CollectiveMismatchError` naming this rank and the reason, and this
    rank's numbers catch up with its peers' (their spans) in the same exchanges: its next call
    on either group takes its numbers after that (:meth:`.per_backend.BackendState.hold`).
    ``span`` is there for :class:`.executors.Refusal`'s callers (unused: one a group)."""

    def __init__(self, name: str, backend, h, timeout: float | None,
                 exc: BaseException) -> None:
        self.backend, self.exc, self.span = backend, exc, 0

        def header(seq: int) -> bytes:
            return refusal(name, seq, exc, 1)

        self.checks = [Check(name, g, timeout, header) for g in (h.node, h.cross)]

    def start(self) -> None:
        """Take the call's places now, publish the refusal on a daemon thread (each exchange
        waits for the peers at most until the call's deadline), which closing or aborting the
        backend first waits for a short while (as :meth:`.executors.Refusal.start`'s)."""
        state(self.backend).next_seq()
        done = threading.Event()
        for check, seq in zip(self.checks, reserve(*(c.backend for c in self.checks)),
                              strict=True):
            check.seq = seq
            state(check.backend).hold(done)
        thread = threading.Thread(target=self.publish, args=(done,), daemon=True,
                                  name=f"ferro-refusal-{self.checks[0].name}")
        thread.start()
        self.backend.publish_before_close(thread)

    def publish(self, done: threading.Event) -> None:
        """Both exchanges, then the groups' next calls may take their numbers."""
        try:
            for check in self.checks:
                try:
                    check.run()
                except DistributedError:
                    pass  # (this rank raises its own argument error)
        finally:
            for check in self.checks:
                st = state(check.backend)
                if st.held is done:
                    st.held = None
            done.set()


def _named(exc: CollectiveMismatchError, name: str, group) -> CollectiveMismatchError:
    """``exc`` (a check's mismatch on ``group``) with the job's ranks named, not the group's."""
    headers = getattr(exc, "headers", None)
    if headers is None:
        return exc
    try:
        check_all(name, group.rank, headers, tuple(group.global_ranks))
    except CollectiveMismatchError as named:
        named.headers = headers
        return named
    return exc


__all__ = ["Check", "Refused", "StageSet"]
