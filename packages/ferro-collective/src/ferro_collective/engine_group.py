"""ferro-collective's side of the same-host engine: the door's calls, its errors, Python's steps.

The engine is ferro-backend's (:class:`ferro_backend.engine.Engine`); its door
(``ferro/engine.h``, :attr:`Engine.comm`, a ``_comm.Comm``) runs whole collectives and keeps
the order of calls: every call takes a ticket (its sequence number, the same on every rank) and
runs when every earlier ticket's call has finished, whichever thread or client (a C++ torch
backend, a JAX handler) made it. :class:`EngineGroup` is what the collectives keep with each
engine (as ``engine.client``):

- the collectives the door has (allreduce, reduce_scatter, all_gather, broadcast, barrier,
  reduce, gather) go through it, from the compiled one-call paths (:mod:`._onecall`, the
  group's base class) or from their plan's engine body (:meth:`door`), which hands it a
  contiguous copy where the call's arrays are not;
- the collectives only ferro's Python has (uneven sizes, objects, the scatter whose non-roots
  pass nothing) run as Python steps (:meth:`exchange`, :meth:`sync`...) inside their ticket's
  turn (:meth:`run`); scatter and the all-to-alls run the same steps from C in their common
  case (:attr:`twin`, :mod:`._metacall`, :mod:`._exchange_twin`);
- a refusal becomes ferro's error (a mismatch naming what every rank called, a timeout naming
  the ranks not arrived, a dead peer's failure); after a timeout or a dead peer the group refuses
  further calls: the steps of the ranks no longer agree. A stall is logged once half a call's
  timeout has passed (the door reports it while it waits).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ferro_backend import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ForkedBackendError,
    PeerClosedError,
)
from ferro_backend import engine as host_engine

from . import p2p
from ._metacall import Twin
from ._onecall import (
    ALL_GATHER,
    ALLREDUCE,
    GATHER,
    NOT_TAKEN,
    REDUCE_SCATTER,
    SCATTER,
    Core,
    overlaps,
)
from .per_backend import check_headers

if TYPE_CHECKING:
    from .plan import Plan

if host_engine.AVAILABLE:
    from ferro_backend.engine import _calls as door_calls
    from ferro_backend.engine._comm import (
        BUSY,
        CLOSED,
        FAILED,
        INVALID,
        MISMATCH,
        OK,
        TIMEOUT,
        UNSUPPORTED,
        last_error,
        status_name,
    )
else:  # no engine: no step runs, but the paths that would name its results still import
    door_calls = None
    OK = 0

log = logging.getLogger("ferro_collective")

#: seconds a failed step waits to learn of a peer's death before it reports a clean close
CLEAN_CLOSE_GRACE = 0.25
_monotonic = time.monotonic


class Step:
    """One call in progress on the engine: names and deadlines for its steps and errors."""

    __slots__ = ("name", "seq", "timeout", "start", "soft", "hard", "reported", "span",
                 "whole")

    def __init__(self, name: str, seq: int, timeout: float, start: float | None = None,
                 span: int = 0, whole: Any = None) -> None:
        self.name, self.seq, self.timeout, self.span = name, seq, timeout, span
        #: what the door's header names instead of the call itself (a hierarchical call's
        #: first node stage names the whole call: :class:`.stage_check.Whole`), or None
        self.whole = whole
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


def _overlapping(kind: int, send, recv, me: int) -> np.ndarray | None:
    """A new array for the door to write where ``recv`` shares bytes with ``send`` otherwise
    than the door takes them (the same buffer; all_gather's and gather's block at this rank's
    place in ``recv``; reduce_scatter's and scatter's ``recv`` at this rank's place in
    ``send``), copied into ``recv`` after the call; else None. The door refuses such a call on
    this rank alone, after its turn was taken, which left its peers waiting for it; every
    other transport gives the result as if the input were read first, and so does this."""
    if send is None or recv is None or not overlaps(_KINDS.get(kind, ALLREDUCE), send, recv, me):
        return None
    return np.empty_like(recv)


#: the door's collectives by this package's numbers, where :func:`._onecall.overlaps` tells
#: them apart (the others: the same buffer or none)
_KINDS = {} if door_calls is None else {
    door_calls.ALL_GATHER: ALL_GATHER, door_calls.GATHER: GATHER,
    door_calls.REDUCE_SCATTER: REDUCE_SCATTER, door_calls.SCATTER: SCATTER}


class EngineGroup(Core):
    """The collectives' state for one backend's engine (see the module docstring); the
    one-call paths are its compiled base's (:class:`._onecall.Core`)."""

    def __init__(self, backend: Any, engine: Any) -> None:
        self.backend, self.engine = backend, engine
        #: the engine's door (``_comm.Comm``): collectives, the order of calls
        self.comm = engine.comm
        #: this rank's steps one by one (``_steps.Steps``), for the collectives only Python runs
        self.steps = engine.steps
        self.slot_bytes = engine.slot_bytes
        self.cma_ok = engine.cma_ok
        self._scratch: dict[tuple[str, np.dtype], np.ndarray] = {}
        self._bind(backend, self.comm)
        #: the one-call path of scatter and the all-to-alls (the twin of their engine path)
        self.twin = Twin(self, Step)
        self.comm.set_stall_report(_log_stall)
        engine.client = self

    @property
    def step(self) -> int:
        return self.steps.step

    def scratch(self, key: str, dtype: np.dtype, count: int) -> np.ndarray:
        """A persistent 1-d buffer of at least ``count`` items (no allocation per call)."""
        buf = self._scratch.get((key, dtype))
        if buf is None or buf.size < count:
            buf = self._scratch[(key, dtype)] = np.empty(max(count, 1), dtype=dtype)
        return buf[:count]

    # ------------------------------------------------------------------ running a call
    def run(self, plan: Plan) -> Any:
        """Run ``plan`` (its ticket taken) on the engine in its ticket's turn."""
        call = Step(plan.name, plan.seq, plan.timeout, span=plan.span, whole=plan.whole)
        try:
            if self.broken is not None:
                raise self.still_broken(plan.name, plan.seq)
            rc = self.comm.begin(plan.seq, plan.timeout, plan.name)
            if rc != OK:
                self._raise(rc, plan.name, plan.seq, plan.timeout)
            return plan.run_engine(self, call)
        except (CollectiveTimeoutError, PeerClosedError) as exc:
            if self.broken is None:  # (the first failure: later calls name it after theirs)
                self.broken = exc
            raise
        finally:
            self.comm.end(plan.seq)  # nothing if the door ended its turn already

    def door(self, call: Step, kind: int, send: Any, recv: Any, code: int, op: int = 0,
             root: int = 0, shape: tuple[int, ...] | None = None,
             type_name: bytes | None = None) -> None:
        """One of the door's collectives (``kind``: ``_comm.ALLREDUCE``...) as ``call``, on
        contiguous arrays (``send``/``recv`` None where a rank passes nothing); ``shape``: the
        one its header names (every rank's must agree); where ``call`` publishes a whole call
        (:attr:`Step.whole`), its header names that call instead."""
        whole = call.whole
        if whole is None:
            door_call = door_calls.Call(self.comm, kind, code, op, root, shape, type_name,
                                        call.span)
        else:
            door_call = door_calls.Call(self.comm, kind, code, op, root, whole.shape,
                                        whole.type_name, call.span, whole.code, whole.op)
        staged = _overlapping(kind, send, recv, self.me)
        rc = door_call.run(send, recv if staged is None else staged, call.seq, call.timeout)
        if rc != OK:
            self._raise(rc, call.name, call.seq, call.timeout)
        if staged is not None:
            np.copyto(recv, staged)

    def _resolve(self, timeout: float | None, name: str) -> float:
        """The call's timeout, checked before it takes a ticket."""
        if timeout is None:
            return self.backend.timeout
        return self.backend.resolve_timeout(timeout, f"{name}: timeout")

    def _raise(self, rc: int, name: str, seq: int, timeout: float) -> None:
        """The error of a door call that returned ``rc`` (its message is this thread's last);
        a timeout or a dead peer breaks the group."""
        msg = last_error()
        if rc == MISMATCH:
            exc = CollectiveMismatchError(msg)
            exc.headers = self.steps.headers()  # (the step's: every rank's, their spans)
            raise exc
        if rc == TIMEOUT or rc == FAILED:
            exc: BaseException = (CollectiveTimeoutError(msg) if rc == TIMEOUT else
                                  self._failure(Step(name, seq, timeout), self.steps.missing()))
            if self.broken is None:
                self.broken = exc
            raise exc
        if rc == CLOSED:
            # (a forked child's copy of the engine is closed there: the backend says so)
            forked = self.backend.peer_failure(name, self.me)
            if isinstance(forked, ForkedBackendError):
                raise forked
            raise PeerClosedError(msg, peer=self.me)
        if rc == INVALID:
            raise ValueError(msg)
        if rc == UNSUPPORTED:
            raise TypeError(msg)
        if rc == BUSY:
            raise RuntimeError(msg)
        raise RuntimeError(f"{name} (seq {seq}): {status_name(rc)}: {msg}")

    # ------------------------------------------------------------------ Python's steps
    def exchange(self, call: Step, header: bytes, src: np.ndarray | None = None,
                 extra: tuple[int, int, int] | None = None, prefilled: int = 0,
                 span: int = 0) -> int:
        """One step: ``header``, optional slot data (``src``, C-contiguous, at most a slot, or
        ``prefilled`` bytes already written into :meth:`slot_for_writing`) and this rank's
        cross-memory addresses ``extra`` (pid, input, output); returns the step. ``span``: the
        call's bytes per rank (its data then moves through the slot from call to call, and
        :meth:`data` must be given the same span)."""
        rc = self.steps.exchange(header, src, prefilled, extra,
                                call.hard if call.reported else call.soft, span)
        if rc != OK:
            self._settle(rc, call)
        return self.comm.step

    def sync(self, call: Step) -> None:
        """A step without data: nobody goes on before everyone has finished the last one."""
        rc = self.steps.sync(call.hard if call.reported else call.soft)
        if rc != OK:
            try:
                self._settle(rc, call)
            except BaseException:
                # Withdraw this step before giving up: a peer still copying from our buffers
                # must not find us arrived once we return and the caller may free them; it
                # waits for a step that never comes and raises instead.
                self.steps.withdraw()
                raise

    def data(self, rank: int, step: int, nbytes: int, dtype: np.dtype,
             span: int = 0) -> np.ndarray:
        """``rank``'s slot data of ``step`` (of a call of ``span`` bytes per rank, as given to
        :meth:`exchange`): ``nbytes`` as ``dtype``."""
        at = self.steps.rot(step, span) if span else 0
        return self.engine.slot_data(rank, step)[at:at + nbytes].view(dtype)

    def slot_for_writing(self, nbytes: int, dtype: np.dtype, span: int = 0) -> np.ndarray:
        """This rank's slot data for the next step (to fill before :meth:`exchange`)."""
        return self.data(self.me, self.step + 1, nbytes, dtype, span)

    def extras(self) -> list[tuple[int, int, int]]:
        """Every rank's (pid, input address, output address) of the last step."""
        return self.steps.extras()

    def read(self, rank: int, addr: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``addr`` in ``rank``'s memory into ``out``."""
        self.engine.read(rank, addr, out)

    def write(self, rank: int, addr: int, data: np.ndarray) -> None:
        """Copy ``data`` to ``addr`` in ``rank``'s memory."""
        self.engine.write(rank, addr, data)

    # ------------------------------------------------------------------ Python steps' errors
    def _settle(self, rc: int, call: Step) -> None:
        """After a step's first wait that did not end well: the stall report and the wait up
        to the hard deadline (then the header check), or the error."""
        if rc == TIMEOUT and not call.reported:
            call.reported = True
            log.warning("%s (seq %d) on rank %d: still waiting for ranks %s after %.1fs "
                        "(shared-memory engine, step %d)", call.name, call.seq, self.me,
                        self.steps.missing(), _monotonic() - call.start, self.step)
            rc = self.steps.wait(call.hard)
            if rc == OK and not self.steps.headers_agree():
                rc = MISMATCH
        if rc == MISMATCH:
            check_headers(call.name, self.me, self.steps.headers(), self.backend, call.seq)
        elif rc == FAILED:
            raise self._failure(call, self.steps.missing())
        elif rc != OK:
            raise CollectiveTimeoutError(
                f"{call.name} (seq {call.seq}) on rank {self.me}: timed out after "
                f"{call.timeout:g}s waiting for ranks {self.steps.missing()} (shared-memory "
                "engine)")

    def _failure(self, call: Step, missing: list[int]) -> BaseException:
        """The error for a step the failure flag ended: the failure of a peer that died (or
        aborted) in preference to one that closed its backend in order, which is usually a
        peer giving up because of the same death; a close alone is reported after a short
        grace for this process to learn of a death its peers saw first."""
        if self.comm.closed:
            return PeerClosedError(f"{call.name} (seq {call.seq}) on rank {self.me}: this "
                                   "backend was closed", peer=self.me)
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


def _log_stall(message: str) -> None:
    """The door's stall report (once per call, from the thread that waits)."""
    log.warning("%s", message)


__all__ = ["NOT_TAKEN", "EngineGroup", "Step", "door_calls", "group_of"]
