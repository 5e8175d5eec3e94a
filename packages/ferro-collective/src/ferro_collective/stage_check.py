"""The whole-call check of a multi-node job's hierarchical calls.

A hierarchical call runs as stages on two groups, this rank's node and its cross group (the
ranks of its local index on every node), each stage a collective of its own with its own
header. Checked stage by stage, a disagreement seen inside one node would leave the other
nodes' ranks waiting for it in a cross-node stage until their deadline, and the stages'
numbers out of step after it. So the call checks itself whole, on both groups, before any
stage that could meet a disagreement (:class:`StageSet`):

1. on the node, before any stage, every rank publishes the call's own header (what the user
   called: collective, dtype, shape, op, root) with its span there, the numbers the call takes
   on the node (one step on the node's engine);
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
costs a call one engine step on the node; it is off with the mismatch check
(:func:`.header.set_mismatch_check`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ferro_backend import CollectiveMismatchError, CollectiveTimeoutError, DistributedError

from .engine_group import group_of
from .header import check_all, encode, refusal, span_of
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


class StageSet:
    """A hierarchical call of ``plan`` on hierarchy ``h``, numbered now: its check's number on
    the node, its stages' (``plan.stages(h)``, run by ``execute``), and on the cross group a
    check of its own where no stage carries it (the stages take no cross-node number here, as
    a broadcast's ranks of other local indexes than the root's, or the group has an engine)."""

    def __init__(self, plan: Plan, h, execute) -> None:
        self.plan = plan
        node, cross = self.groups = (h.node, h.cross)
        first = reserve(node)
        ahead = reserve(cross) if group_of(cross) is not None else []  # (in its ticket order)
        with recorded() as taken:
            self.stages = plan.stages(h)
        crossing = ahead + taken.get(cross, [])
        #: the first cross-node stage exchanges the whole call's header (its own skipped)
        self.carried = not ahead and bool(crossing)
        #: every number the call takes on each group, in order (the checks' first)
        self.numbers = [first + taken.get(node, []), crossing or reserve(cross)]
        self.started: set[tuple[int, int]] = {(0, first[0])}
        self.failed: dict[int, BaseException] = {}
        #: set once the first cross-node exchange has run (the later cross-node stages wait)
        self.decided = threading.Event()
        self.execute = _Checked(self, execute)

    def __call__(self) -> Any:
        self.check()
        try:
            return self.stages(self.execute)
        except CollectiveMismatchError as exc:
            if isinstance(self.failed.get(1), CollectiveMismatchError):
                self.abandon()
                raise _named(exc, self.plan.name, self.groups[1]) from None
            raise

    def header(self, group: int) -> Callable[[int], bytes]:
        """The whole call's header on group ``group`` (0: node, 1: cross), by number."""
        plan, span = self.plan, len(self.numbers[group])
        return lambda seq: encode(plan.name, *plan.header, seq=seq, span=span)

    def check(self) -> None:
        """The whole call's header on the node, then across nodes (here, where no stage
        carries it; a refusal where the node disagreed); after a disagreement no stage runs,
        their numbers are given back and the mismatch raised."""
        name, timeout = self.plan.name, self.plan.timeout
        node, cross = self.groups
        try:
            Check(name, node, timeout, self.header(0), self.numbers[0][0]).run()
            if self.carried:
                return
            cross_header = self.header(1)
        except CollectiveMismatchError as exc:
            self.failed[0] = exc
            why = CollectiveMismatchError(f"ranks {list(node.global_ranks)} of its node "
                                          "disagree")
            span = len(self.numbers[1])

            def cross_header(seq: int) -> bytes:
                return refusal(name, seq, why, span)
        self.started.add((1, self.numbers[1][0]))
        try:
            Check(name, cross, timeout, cross_header, self.numbers[1][0]).run()
        except CollectiveMismatchError as exc:
            self.failed[1] = exc
        if self.failed:
            self.abandon()
            group, exc = min(self.failed.items())
            raise _named(exc, name, self.groups[group]) from None

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
    exchanges over point-to-point messages (the whole call's check covered them); the first
    cross-node stage, where it carries the check, first exchanges the whole call's header on
    its number (its body's messages follow on the same number's tags), and the later
    cross-node stages start only once that exchange passed (they keep their own exchange)."""

    __slots__ = ("calls", "execute")

    def __init__(self, calls: StageSet, execute) -> None:
        self.calls, self.execute = calls, execute

    def __call__(self, plan: Plan) -> Any:
        calls = self.calls
        i = 1 if plan.backend is calls.groups[1] else 0
        if i == 1 and calls.carried:
            if plan.seq == calls.numbers[1][0]:
                calls.started.add((1, plan.seq))
                try:
                    Check(calls.plan.name, plan.backend, plan.timeout, calls.header(1),
                          plan.seq).run()
                except BaseException as exc:
                    calls.failed[1] = exc
                    raise
                finally:
                    calls.decided.set()
            else:
                calls.decided.wait(plan.timeout)
                failed = calls.failed.get(1)
                if failed is not None or not calls.decided.is_set():
                    raise CollectiveMismatchError(
                        f"{calls.plan.name}: the call's first cross-node exchange failed") \
                        if isinstance(failed, CollectiveMismatchError) else \
                        CollectiveTimeoutError(f"{calls.plan.name} (seq {plan.seq}): its first "
                                               "cross-node exchange did not end")
        calls.started.add((i, plan.seq))
        # (a pipelined call's later cross-node pieces keep their headers' round trip: it paces
        # their data onto the link, 16 MiB at 2 x 2 and 1 Gbit/s 2% faster than without)
        plan.checked = i == 0 or not calls.carried or plan.seq == calls.numbers[1][0]
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
        waits for the peers at most until the call's deadline)."""
        state(self.backend).next_seq()
        done = threading.Event()
        for check, seq in zip(self.checks, reserve(*(c.backend for c in self.checks)),
                              strict=True):
            check.seq = seq
            state(check.backend).hold(done)
        threading.Thread(target=self.publish, args=(done,), daemon=True,
                         name=f"ferro-refusal-{self.checks[0].name}").start()

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
