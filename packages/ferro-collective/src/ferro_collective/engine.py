"""ferro-collective's side of the same-host engine: call order, deadlines, errors, scratch.

The engine itself (its segment, the step protocol, the waits) is ferro-backend's
(:class:`ferro_backend.engine.Engine`); :class:`EngineGroup` is what the collectives keep with
each engine (as ``engine.client``): calls run one at a time in the order they were issued (the
same order on every rank, as the collectives require), async calls queue behind earlier ones;
each step's status becomes ferro's error (a mismatch naming what every rank called, a timeout
naming the ranks not arrived, a dead peer's failure), with a stall report half-way; scratch
buffers and the one-call paths' plans persist between calls. The collectives' engine paths
(each in its collective's module) run their steps through it. After a timeout or a dead peer
the group refuses further calls: the steps of the ranks no longer agree.

The one-call paths (``allreduce_now``, ``reduce_scatter_now``, ``broadcast_now``,
``all_gather_now``, ``barrier_now``) are compiled (:mod:`._fastcall`, the group's base class):
a whole small collective as one engine call with no Python in between for the common case, on
plans the collectives' modules make once per call signature. They answer :data:`NOT_TAKEN`
(nothing taken, no sequence number used) for a call that is not their case, so that the general
path runs it and raises whatever its arguments deserve; a step that does not end well comes
back here (:meth:`EngineGroup._recover`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ferro_backend import CollectiveTimeoutError, PeerClosedError, settings
from ferro_backend import engine as host_engine

from . import _reduce, p2p
from ._fastcall import NOT_TAKEN, Core
from ._fastplan import FastPlan
from ._state import state
from .header import check_all, encode

if TYPE_CHECKING:
    from .plan import Plan

if host_engine.AVAILABLE:
    from ferro_backend.engine import FAILED, MISMATCH, OK, TIMEOUT, header_hash
else:  # no engine: no step runs, but the paths that would name its results still import
    OK = 0

log = logging.getLogger("ferro_collective")

#: seconds a failed step waits to learn of a peer's death before it reports a clean close
CLEAN_CLOSE_GRACE = 0.25
_monotonic = time.monotonic


class Step:
    """One call in progress on the engine: names and deadlines for its steps and errors."""

    __slots__ = ("name", "seq", "timeout", "start", "soft", "hard", "reported")

    def __init__(self, name: str, seq: int, timeout: float, start: float | None = None) -> None:
        self.name, self.seq, self.timeout = name, seq, timeout
        self.start = _monotonic() if start is None else start
        self.hard = self.start + timeout
        self.soft = self.start + timeout * p2p.STALL_FRACTION
        self.reported = False


def group_of(backend: Any) -> EngineGroup | None:
    """The collectives' state for ``backend``'s engine, made at its first collective; None
    where the backend has no engine."""
    engine = getattr(backend, "engine", None)
    if engine is None:
        return None
    group = engine.client
    return group if group is not None else EngineGroup(backend, engine)


class EngineGroup(Core):
    """The collectives' state for one backend's engine (see the module docstring); the call
    order and the one-call paths are its compiled base's (:class:`._fastcall.Core`)."""

    def __init__(self, backend: Any, engine: Any) -> None:
        self.backend, self.engine = backend, engine
        self.slots = engine.slots
        self.slots.set_fold(_reduce.FOLD)
        self.n, self.me = engine.nranks, engine.rank
        self.slot_bytes = engine.slot_bytes
        self.cma_ok = engine.cma_ok
        #: all_gather blocks / broadcasts of at least these many bytes move by cross-memory
        #: copies (where those work) even when they fit a slot (default: only beyond a slot)
        self.direct_copy_bytes = settings.SHM_DIRECT_COPY_BYTES.get()
        self.broadcast_direct_bytes = settings.SHM_BROADCAST_DIRECT_BYTES.get()
        self._cond = threading.Condition()
        self._scratch: dict[tuple[str, np.dtype], np.ndarray] = {}
        barrier = encode("barrier", None, (), seq=0)
        self._bind(backend, self.slots, state(backend).counter, barrier, header_hash(barrier))
        engine.client = self

    @property
    def step(self) -> int:
        return self.slots.step

    def scratch(self, key: str, dtype: np.dtype, count: int) -> np.ndarray:
        """A persistent 1-d buffer of at least ``count`` items (no allocation per call)."""
        buf = self._scratch.get((key, dtype))
        if buf is None or buf.size < count:
            buf = self._scratch[(key, dtype)] = np.empty(max(count, 1), dtype=dtype)
        return buf[:count]

    # ------------------------------------------------------------------ running a call
    def run(self, plan: Plan) -> Any:
        """Run ``plan`` (its sequence number taken) on the engine, after every earlier call."""
        call = Step(plan.name, plan.seq, plan.timeout)
        if self._next_seq != plan.seq:
            self._wait_turn(call)
        try:
            if self.broken is not None:
                raise self.broken
            return plan.run_engine(self, call)
        except (CollectiveTimeoutError, PeerClosedError) as exc:
            self.broken = exc
            raise
        finally:
            self._done(plan.seq)

    def _wait_turn(self, call: Step) -> None:
        """Block until every call issued before ``call`` has finished (calls run in order)."""
        with self._cond:
            if self._next_seq < 0:
                self._next_seq = call.seq
            self._waiting += 1
            try:
                while self._next_seq != call.seq:
                    left = call.hard - _monotonic()
                    if left <= 0:
                        raise CollectiveTimeoutError(
                            f"{call.name} (seq {call.seq}) on rank {self.me}: timed out after "
                            f"{call.timeout:g}s waiting for earlier collectives on this backend")
                    # short slices: a finishing call notifies without the lock when nobody
                    # was waiting yet, so a waiter that just arrived re-checks soon
                    self._cond.wait(min(left, 0.005))
            finally:
                self._waiting -= 1

    def _resolve(self, timeout: float | None, name: str) -> float:
        """The call's timeout, checked before it takes a sequence number."""
        if timeout is None:
            return self.backend.timeout
        return self.backend.resolve_timeout(timeout, f"{name}: timeout")

    # ------------------------------------------------------------------ steps
    def exchange(self, call: Step, header: bytes, src: np.ndarray | None = None,
                 extra: tuple[int, int, int] | None = None, prefilled: int = 0,
                 span: int = 0) -> int:
        """One step: ``header``, optional slot data (``src``, C-contiguous, at most a slot, or
        ``prefilled`` bytes already written into :meth:`slot_for_writing`) and this rank's
        cross-memory addresses ``extra`` (pid, input, output); returns the step. ``span``: the
        call's bytes per rank, where the compiled path runs the same call (its data then moves
        through the slot from call to call, and :meth:`data` must be given the same span)."""
        rc = self.slots.exchange(header, src, prefilled, extra,
                                 call.hard if call.reported else call.soft, span)
        if rc != OK:
            self._settle(rc, call)
        return self.slots.step

    def sync(self, call: Step) -> None:
        """A step without data: nobody goes on before everyone has finished the last one."""
        rc = self.slots.sync(call.hard if call.reported else call.soft)
        if rc != OK:
            try:
                self._settle(rc, call)
            except BaseException:
                # Withdraw this step before giving up: a peer still copying from our buffers
                # must not find us arrived once we return and the caller may free them; it
                # waits for a step that never comes and raises instead.
                self.slots.withdraw()
                raise

    def data(self, rank: int, step: int, nbytes: int, dtype: np.dtype,
             span: int = 0) -> np.ndarray:
        """``rank``'s slot data of ``step`` (of a call of ``span`` bytes per rank, as given to
        :meth:`exchange`): ``nbytes`` as ``dtype``."""
        at = self.slots.rot(step, span) if span else 0
        return self.engine.slot_data(rank, step)[at:at + nbytes].view(dtype)

    def slot_for_writing(self, nbytes: int, dtype: np.dtype, span: int = 0) -> np.ndarray:
        """This rank's slot data for the next step (to fill before :meth:`exchange`)."""
        return self.data(self.me, self.step + 1, nbytes, dtype, span)

    def extras(self) -> list[tuple[int, int, int]]:
        """Every rank's (pid, input address, output address) of the last step."""
        return self.slots.extras()

    def read(self, rank: int, addr: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``addr`` in ``rank``'s memory into ``out``."""
        self.engine.read(rank, addr, out)

    def write(self, rank: int, addr: int, data: np.ndarray) -> None:
        """Copy ``data`` to ``addr`` in ``rank``'s memory."""
        self.engine.write(rank, addr, data)

    # ------------------------------------------------------------------ errors
    def _settle(self, rc: int, call: Step) -> None:
        """After a first wait that did not end well: the stall report and the wait up to the
        hard deadline (then the header check), or the error."""
        if rc == TIMEOUT and not call.reported:
            self._stall_report(call)
            rc = self.slots.wait(call.hard)
            if rc == OK and not self.slots.headers_agree():
                rc = MISMATCH
        if rc == MISMATCH:
            check_all(call.name, self.me, self.slots.headers())
        elif rc == FAILED:
            raise self._failure(call, self.slots.missing())
        elif rc != OK:
            raise CollectiveTimeoutError(
                f"{call.name} (seq {call.seq}) on rank {self.me}: timed out after "
                f"{call.timeout:g}s waiting for ranks {self.slots.missing()} (shared-memory "
                "engine)")

    def _stall_report(self, call: Step) -> None:
        call.reported = True
        log.warning("%s (seq %d) on rank %d: still waiting for ranks %s after %.1fs "
                    "(shared-memory engine, step %d)", call.name, call.seq, self.me,
                    self.slots.missing(), _monotonic() - call.start, self.step)

    def _failure(self, call: Step, missing: list[int]) -> BaseException:
        """The error for a step the failure flag ended: the failure of a peer that died (or
        aborted) in preference to one that closed its backend in order, which is usually a
        peer giving up because of the same death; a close alone is reported after a short
        grace for this process to learn of a death its peers saw first."""
        order = missing + [r for r in range(self.n) if r != self.me and r not in missing]
        grace = _monotonic() + CLEAN_CLOSE_GRACE
        while True:
            failures = [f for f in (self.backend.peer_failure(call.name, p) for p in order)
                        if f is not None]
            for failure in failures:
                if not getattr(failure, "clean", False):
                    return failure
            if _monotonic() >= grace:
                break
            time.sleep(0.005)
        if failures:
            return failures[0]
        return PeerClosedError(f"{call.name} (seq {call.seq}) on rank {self.me}: the engine "
                               "was shut down")

    def _recover(self, rc: int, name: str, seq: int, timeout: float, start: float) -> None:
        """After a one-call step that did not end OK: the stall report and the wait up to the
        hard deadline, or the error (which breaks the group for a timeout or a dead peer)."""
        try:
            self._settle(rc, Step(name, seq, timeout, start))
        except (CollectiveTimeoutError, PeerClosedError) as exc:
            self.broken = exc
            raise

    def _late(self, rc: int, name: str, seq: int, timeout: float, start: float) -> None:
        """A pipelined step's rest (split allreduce, streamed all_gather) that did not end by
        the hard deadline (after the stall report): the error, which breaks the group."""
        call = Step(name, seq, timeout, start)
        try:
            if rc == FAILED:
                raise self._failure(call, self.slots.missing())
            raise CollectiveTimeoutError(
                f"{name} (seq {seq}) on rank {self.me}: timed out after {timeout:g}s waiting "
                "for the peers' chunks of a pipelined step (shared-memory engine)")
        except (CollectiveTimeoutError, PeerClosedError) as exc:
            self.broken = exc
            raise

    # ------------------------------------------------------------------ one-call paths
    def _wait_turn_for(self, name: str, seq: int, timeout: float, start: float) -> None:
        self._wait_turn(Step(name, seq, timeout, start))

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _staged(self, plan: FastPlan, x: np.ndarray, out: np.ndarray, seq: int, timeout: float,
                start: float) -> None:
        """A one-call copy beyond one step: the plan's staged engine path, without the general
        path's checks (the compiled path made them)."""
        call = Step(plan.name, seq, timeout, start)
        try:
            plan.staged(self, call, encode(plan.name, x.dtype, x.shape, None, plan.root, seq),
                        x, out, plan.root)
        except (CollectiveTimeoutError, PeerClosedError) as exc:
            self.broken = exc
            raise


def one_call_header(name: str, dtype: np.dtype, shape: tuple[int, ...], op=None,
                    root: int = -1) -> tuple[bytes, int]:
    """A one-call plan's header (sequence number 0) and the hash the engine publishes with it."""
    header = encode(name, dtype, shape, op, root, 0)
    return header, header_hash(header)


__all__ = ["NOT_TAKEN", "EngineGroup", "FastPlan", "Step", "group_of", "one_call_header"]
