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

The one-call paths (:meth:`EngineGroup.fold_now`, :meth:`copy_now`, :meth:`barrier_now`) run
a whole small collective as one engine call with as little Python as possible: the checks a
one-step call needs, the backend's next sequence number, one compiled step. They answer
:data:`NOT_TAKEN` (nothing taken, no sequence number used) for a call that is not their case,
so that the general path runs it and raises whatever its arguments deserve.
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
from ._state import state
from .checks import usable_out
from .header import check_all, encode

if TYPE_CHECKING:
    from .plan import Plan

if host_engine.AVAILABLE:
    from ferro_backend.engine import FAILED, MISMATCH, OK, TIMEOUT

log = logging.getLogger("ferro_collective")

#: what a one-call path answers for a call it does not take
NOT_TAKEN = object()
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


class EngineGroup:
    """The collectives' state for one backend's engine (see the module docstring)."""

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
        self.broken: BaseException | None = None
        self._cond = threading.Condition()
        self._next_seq: int | None = None
        self._waiting = 0
        self._scratch: dict[tuple[str, np.dtype], np.ndarray] = {}
        #: the one-call paths' plans, by call signature (see the collectives' ``one_call``)
        self.plans: dict[tuple, tuple | bool] = {}
        self._barrier_header = encode("barrier", None, (), seq=0)
        self._next = state(backend).counter  # the backend's sequence numbers
        engine.client = self

    @property
    def step(self) -> int:
        return self.slots.step

    def keep(self, key: tuple, plan: tuple | bool) -> tuple | bool:
        """Remember a one-call path's ``plan`` (False: not taken) for the signature ``key``."""
        if len(self.plans) > 4096:
            self.plans.clear()
        self.plans[key] = plan
        return plan

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
            if self._next_seq is None:
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

    def _done(self, seq: int) -> None:
        self._next_seq = seq + 1
        if self._waiting:
            with self._cond:
                self._cond.notify_all()

    def _enter(self, name: str, seq: int, timeout: float) -> float:
        """The start of one-call collective ``seq`` once every call issued before it on this
        backend has finished (or the error that broke the group)."""
        start = _monotonic()
        if self._next_seq != seq:
            self._wait_turn(Step(name, seq, timeout, start))
        if self.broken is not None:
            self._done(seq)
            raise self.broken
        return start

    def _resolve(self, timeout: float | None, name: str) -> float:
        """The call's timeout, checked before it takes a sequence number."""
        if timeout is None:
            return self.backend.timeout
        return self.backend.resolve_timeout(timeout, f"{name}: timeout")

    # ------------------------------------------------------------------ steps
    def exchange(self, call: Step, header: bytes, src: np.ndarray | None = None,
                 extra: tuple[int, int, int] | None = None, prefilled: int = 0) -> int:
        """One step: ``header``, optional slot data (``src``, C-contiguous, at most a slot, or
        ``prefilled`` bytes already written into :meth:`slot_for_writing`) and this rank's
        cross-memory addresses ``extra`` (pid, input, output); returns the step."""
        rc = self.slots.exchange(header, src, prefilled, extra,
                                 call.hard if call.reported else call.soft)
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

    def data(self, rank: int, step: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """``rank``'s slot data of ``step``: its first ``nbytes`` as ``dtype``."""
        return self.engine.slot_data(rank, step)[:nbytes].view(dtype)

    def slot_for_writing(self, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """This rank's slot data for the next step (to fill before :meth:`exchange`)."""
        return self.data(self.me, self.step + 1, nbytes, dtype)

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

    # ------------------------------------------------------------------ one-call paths
    def barrier_now(self, timeout: float | None) -> None:
        """The barrier: one step with the barrier's header."""
        t = self._resolve(timeout, "barrier")
        seq = self._next()
        start = self._enter("barrier", seq, t)
        try:
            rc = self.slots.step_barrier(self._barrier_header, seq,
                                         start + t * p2p.STALL_FRACTION)
            if rc != OK:
                self._recover(rc, "barrier", seq, t, start)
        finally:
            self._done(seq)

    def _begin(self, name: str, timeout: float | None, x: np.ndarray, out: np.ndarray | None,
               shape: tuple[int, ...]) -> tuple | None:
        """A one-call path's start: where the result goes (a new array, or ``out`` as it is),
        the call's timeout, its sequence number and start once its turn came; None (nothing
        taken) when ``x`` or ``out`` are not what one engine call can use as they are."""
        if not x.flags.c_contiguous:
            return None
        if out is None:
            out = np.empty(shape, x.dtype)
        elif not usable_out(out, shape, x.dtype):
            return None
        t = self.backend.timeout if timeout is None else self._resolve(timeout, name)
        seq = self._next()
        return out, t, seq, self._enter(name, seq, t)

    def fold_now(self, plan: tuple, x: np.ndarray, out: np.ndarray | None,
                 timeout: float | None) -> Any:
        """A slot-sized reduction in one engine call. ``plan``: (name, header with sequence
        number 0 (the engine patches it in), result shape, dtype code, kernel op, MEAN divisor,
        fold offset in bytes, item count)."""
        name, header, shape, code, kernel, div, offset, count = plan
        begun = self._begin(name, timeout, x, out, shape)
        if begun is None:
            return NOT_TAKEN
        out, t, seq, start = begun
        try:
            rc = self.slots.step_fold(header, seq, x, out, offset, count, x.itemsize, code,
                                      kernel, div, start + t * p2p.STALL_FRACTION)
            if rc != OK:
                self._recover(rc, name, seq, t, start)
                self.slots.fold(out, x.nbytes, offset, count, x.itemsize, code, kernel, div)
        finally:
            self._done(seq)
        return out

    def copy_now(self, plan: tuple, x: np.ndarray, out: np.ndarray | None, root: int,
                 timeout: float | None, staged) -> Any:
        """A broadcast (``root`` >= 0) or all_gather (-1) in one engine call when its data fits
        a slot, else ``staged(group, call, header, x, out, root)`` (the staged engine path) with no
        call object. ``plan``: (name, header with sequence number 0, result shape, whether one
        step carries it)."""
        name, header, shape, one_step = plan
        begun = self._begin(name, timeout, x, out, shape)
        if begun is None:
            return NOT_TAKEN
        out, t, seq, start = begun
        try:
            if not one_step:
                call = Step(name, seq, t, start)
                try:
                    staged(self, call, encode(name, x.dtype, x.shape, None, root, seq), x, out,
                           root)
                except (CollectiveTimeoutError, PeerClosedError) as exc:
                    self.broken = exc
                    raise
                return out
            # the engine takes the arrays' bytes as they are (C-contiguous, any dtype)
            rc = self.slots.step_copy(header, seq, x, out, root,
                                      start + t * p2p.STALL_FRACTION)
            if rc != OK:
                self._recover(rc, name, seq, t, start)
                self.slots.copy(x, out, root)
        finally:
            self._done(seq)
        return out


__all__ = ["NOT_TAKEN", "EngineGroup", "Step", "group_of"]
