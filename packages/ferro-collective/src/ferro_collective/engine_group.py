"""The same-host engine's per-backend state: slot views, the step counter, call order, errors.

:class:`EngineGroup` is what :mod:`.fastpath`'s collectives run on: it takes the steps of the
protocol (``_shmcoll.SlotEngine``), turns their status into ferro's errors (mismatch, timeout
naming the missing ranks, a dead peer), logs stall reports, keeps calls in issue order and
persistent scratch buffers. Its ``*_now`` methods run the common small calls (barrier and slot-sized
allreduce, reduce_scatter, broadcast, all_gather) as one engine call each, with as little Python
as possible.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ferro_backend import CollectiveTimeoutError, PeerClosedError, settings

from . import _reduce, _shmcoll
from . import algorithms as alg
from ._state import state
from .header import HEADER_SIZE, check_all, encode
from .ops import BITWISE, OPS, ReduceOp

log = logging.getLogger("ferro_collective")

#: kernel dtype -> the engine's dtype code (float codes first, then the integers)
_CODES = {np.dtype(name): code for name, code in _reduce.DTYPE_CODES.items()}
_FIRST_INT_CODE = _reduce.DTYPE_CODES["int8"]

_monotonic = time.monotonic
#: seconds a failed step waits to learn of a peer's death before it reports a clean close
CLEAN_CLOSE_GRACE = 0.25

_EXTRA = struct.Struct("<QQQ")  # pid, input address, output address
_EXTRA_OFF = 128  # in the slot header, after the collective header


class Step:
    """One call in progress on the engine: names and deadlines for its steps and errors."""

    __slots__ = ("name", "seq", "timeout", "start", "soft", "hard", "reported")

    def __init__(self, name: str, seq: int, timeout: float, start: float | None = None) -> None:
        self.name, self.seq, self.timeout = name, seq, timeout
        self.start = time.monotonic() if start is None else start
        self.hard = self.start + timeout
        self.soft = self.start + timeout * alg.STALL_FRACTION
        self.reported = False


class EngineGroup:
    """The fast path's state for one backend: slot views, the step counter, scratch buffers."""

    def __init__(self, backend: Any) -> None:
        seg = backend.engine
        lay = seg.layout
        self.backend = backend
        self.seg = seg
        self.n, self.me = seg.nranks, seg.rank
        self.slot_bytes = lay["slot_bytes"]
        self.cma_ok = seg.cma_ok
        self.pids = seg.pids
        cores = os.cpu_count() or 1
        # oversubscribed: never spin on a core a peer needs; yield it a bounded number of
        # times (FERRO_SHM_YIELDS) before sleeping, so a waiting rank lets its peers run
        spin = 4000 if self.n <= cores else 0
        yields = 0 if self.n <= cores else settings.SHM_YIELDS.get()
        #: all_gather blocks / broadcasts of at least these many bytes move by cross-memory
        #: copies (where those work) even when they fit a slot (FERRO_SHM_DIRECT_COPY_BYTES,
        #: FERRO_SHM_BROADCAST_DIRECT_BYTES; default: only what exceeds a slot)
        self.direct_copy_bytes = settings.SHM_DIRECT_COPY_BYTES.get()
        self.broadcast_direct_bytes = settings.SHM_BROADCAST_DIRECT_BYTES.get()
        self.eng = _shmcoll.SlotEngine(
            seg.address, self.n, self.me, lay["ctrl_off"], lay["ctrl_stride"], lay["slot_off"],
            lay["slot_stride"], lay["parity_stride"], lay["head_bytes"], lay["slot_bytes"],
            seg.failed_address, spin, yields)
        mem = np.frombuffer(seg._mem, dtype=np.uint8)
        self._heads = [[mem[a:a + lay["head_bytes"]] for a in self._slots(lay, r)]
                       for r in range(self.n)]
        self._data = [[mem[a + lay["head_bytes"]:a + lay["head_bytes"] + self.slot_bytes]
                       for a in self._slots(lay, r)] for r in range(self.n)]
        self.step = 0
        self.broken: BaseException | None = None
        self._cond = threading.Condition()
        self._next_seq: int | None = None
        self._waiting = 0
        self._scratch: dict[tuple[str, np.dtype], np.ndarray] = {}
        self._plans: dict[tuple, tuple | bool] = {}
        self._barrier_header = encode("barrier", None, (), seq=0)
        # the backend's sequence numbers (shared with every other call on it)
        self._next = state(backend).counter

    @staticmethod
    def _slots(lay: dict[str, int], rank: int) -> list[int]:
        base = lay["slot_off"] + rank * lay["slot_stride"]
        return [base, base + lay["parity_stride"]]

    # ------------------------------------------------------------------ running a call
    def run(self, name: str, seq: int, timeout: float, fn: Callable[[Step], Any]) -> Any:
        """Run ``fn`` as call ``seq`` on this backend, after every earlier call."""
        call = Step(name, seq, timeout)
        if self._next_seq != seq:
            self._wait_turn(call)
        try:
            if self.broken is not None:
                raise self.broken
            return fn(call)
        except (CollectiveTimeoutError, PeerClosedError) as exc:
            self.broken = exc
            raise
        finally:
            self._done(seq)

    def _wait_turn(self, call: Step) -> None:
        """Block until every call issued before ``call`` has finished (calls run in order)."""
        with self._cond:
            if self._next_seq is None:
                self._next_seq = call.seq
            self._waiting += 1
            try:
                while self._next_seq != call.seq:
                    left = call.hard - time.monotonic()
                    if left <= 0:
                        raise CollectiveTimeoutError(
                            f"{call.name} (seq {call.seq}) on rank {self.me}: timed out after "
                            f"{call.timeout:g}s waiting for earlier collectives on this backend")
                    # short slices: a finishing call notifies without the lock when nobody
                    # was waiting yet, so a waiter that just arrived re-checks soon
                    self._cond.wait(min(left, 0.005))
            finally:
                self._waiting -= 1

    def scratch(self, key: str, dtype: np.dtype, count: int) -> np.ndarray:
        """A persistent 1-d buffer of at least ``count`` items (no allocation per call)."""
        buf = self._scratch.get((key, dtype))
        if buf is None or buf.size < count:
            buf = self._scratch[(key, dtype)] = np.empty(max(count, 1), dtype=dtype)
        return buf[:count]

    # ------------------------------------------------------------------ steps
    def exchange(self, call: Step, header: bytes, src: np.ndarray | None = None,
                 extra: tuple[int, int, int] | None = None) -> int:
        """Step 1 of a call (and every piece of a sliced one): header, optional slot data
        (``src``, C-contiguous, at most a slot) and extra addresses; returns the step."""
        step = self.step + 1
        if extra is not None:
            _EXTRA.pack_into(self._heads[self.me][step & 1], _EXTRA_OFF, *extra)
        if src is None:
            addr, nbytes = 0, 0
        else:
            addr, nbytes = src.ctypes.data, src.nbytes
        rc = self.eng.exchange(step, header, addr, nbytes,
                               call.hard if call.reported else call.soft)
        self.seg.sent += nbytes
        self.step = step
        if rc != _shmcoll.STATUS_OK:
            self._settle(rc, call, step)
        return step

    def _settle(self, rc: int, call: Step, step: int) -> None:
        """After a first wait that did not end well: the stall report and the wait up to the
        hard deadline (then the header check), or the error."""
        if rc == _shmcoll.STATUS_TIMEOUT and not call.reported:
            self._stall_report(call, step)
            rc = self.eng.wait(step, call.hard)
            if rc == _shmcoll.STATUS_OK and not self._headers_agree(step):
                rc = _shmcoll.STATUS_MISMATCH
        self._check(rc, call, step)

    # ------------------------------------------------------------------ one-call paths
    # The common small collectives with as little Python as possible: the checks a one-step
    # call needs, this backend's next sequence number, then one engine call that exchanges the
    # header and data and folds or copies every rank's slot without the GIL. Each returns None
    # (nothing taken, no sequence number used) when the call is not that case, so that the
    # general path runs it and raises whatever error its arguments deserve.

    def barrier_now(self, timeout: float | None) -> None:
        """The barrier: one step with the barrier's header (the common case inline: its turn,
        the backend's timeout, nothing broken)."""
        t = self._resolve(timeout, "barrier")
        seq = self._next()
        start = self._enter("barrier", seq, t)
        try:
            step = self.step + 1
            rc = self.eng.step(step, self._barrier_header, seq, start + t * alg.STALL_FRACTION)
            self.step = step
            if rc != _shmcoll.STATUS_OK:
                self._recover(rc, "barrier", seq, t, start, step)
        finally:
            self._done(seq)

    def allreduce_now(self, x: np.ndarray, out: np.ndarray | None, op: ReduceOp,
                      timeout: float | None) -> np.ndarray | None:
        """A slot-sized allreduce of a kernel dtype in one engine call, or None."""
        plan = self._plans.get(("allreduce", x.dtype, x.shape, op))
        if plan is None:
            plan = self._plan_reduce("allreduce", x, op)
        return self._reduce_now(plan, x, out, timeout) if plan else None

    def reduce_scatter_now(self, x: np.ndarray, out: np.ndarray | None, op: ReduceOp,
                           timeout: float | None) -> np.ndarray | None:
        """A slot-sized reduce_scatter (dim 0 divisible by the world size) in one engine call:
        this rank's part of every slot folded (the general path's slot fold), or None."""
        plan = self._plans.get(("reduce_scatter", x.dtype, x.shape, op))
        if plan is None:
            plan = self._plan_reduce("reduce_scatter", x, op)
        return self._reduce_now(plan, x, out, timeout) if plan else None

    def broadcast_now(self, x: np.ndarray, out: np.ndarray | None, root: int,
                      timeout: float | None) -> np.ndarray | None:
        """A slot-sized broadcast in one engine call (the root's data through its slot), or
        None."""
        plan = self._plans.get(("broadcast", x.dtype, x.shape, root))
        if plan is None:
            plan = self._plan_copy("broadcast", x, root)
        return self._copy_now(plan, x, out, root, timeout) if plan else None

    def all_gather_now(self, x: np.ndarray, out: np.ndarray | None,
                       timeout: float | None) -> np.ndarray | None:
        """An all_gather whose block goes through the slots (the general path's rule for
        small blocks) in one engine call, or None."""
        plan = self._plans.get(("all_gather", x.dtype, x.shape, -1))
        if plan is None:
            plan = self._plan_copy("all_gather", x, -1)
        return self._copy_now(plan, x, out, -1, timeout) if plan else None

    # A plan is what a call signature needs, worked out once: (name, header with sequence
    # number 0 (the engine patches it in), result shape, and for reductions the dtype code,
    # kernel op, MEAN divisor, fold offset and item count), or False when a one-call path
    # does not take that signature.

    def _plan_reduce(self, name: str, x: np.ndarray, op: ReduceOp) -> tuple | bool:
        code, n = _CODES.get(x.dtype), self.n
        plan: tuple | bool = False
        if (code is not None and x.nbytes <= self.slot_bytes
                and not (op is ReduceOp.MEAN and code >= _FIRST_INT_CODE)
                and not (op in BITWISE and code < _FIRST_INT_CODE)):
            if name == "allreduce":
                plan = (name, encode(name, x.dtype, x.shape, op, -1, 0), x.shape, code,
                        OPS[op].kernel, float(n) if op is ReduceOp.MEAN else 0.0, 0, x.size)
            elif x.ndim and x.shape[0] % n == 0:
                part = x.size // n
                plan = (name, encode(name, x.dtype, x.shape, op, -1, 0),
                        (x.shape[0] // n, *x.shape[1:]), code, OPS[op].kernel,
                        float(n) if op is ReduceOp.MEAN else 0.0, self.me * part * x.itemsize,
                        part)
        return self._keep((name, x.dtype, x.shape, op), plan)

    def _plan_copy(self, name: str, x: np.ndarray, root: int) -> tuple | bool:
        plan: tuple | bool = False
        nbytes = x.nbytes
        if not x.dtype.hasobject:
            # the last item: one step through the slots (else the staged engine path, with
            # cross-memory reads where they work, still without a call object)
            if name == "broadcast" and 0 <= root < self.n:
                plan = (name, encode(name, x.dtype, x.shape, None, root, 0), x.shape,
                        nbytes <= self.slot_bytes
                        and not (self.cma_ok and nbytes >= self.broadcast_direct_bytes))
            elif name == "all_gather":
                shape = (self.n,) if x.ndim == 0 else (x.shape[0] * self.n, *x.shape[1:])
                plan = (name, encode(name, x.dtype, x.shape, None, -1, 0), shape,
                        nbytes <= self.slot_bytes
                        and not (self.cma_ok and nbytes >= self.direct_copy_bytes))
        return self._keep((name, x.dtype, x.shape, root), plan)

    def _keep(self, key: tuple, plan: tuple | bool) -> tuple | bool:
        if len(self._plans) > 4096:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _reduce_now(self, plan: tuple, x: np.ndarray, out: np.ndarray | None,
                    timeout: float | None) -> np.ndarray | None:
        name, header, shape, code, kernel, div, offset, count = plan
        if not x.flags.c_contiguous:
            return None
        if out is None:
            out = np.empty(shape, x.dtype)
        elif not _usable_out(out, shape, x.dtype):
            return None
        t = self._resolve(timeout, name)
        seq = self._next()
        start = self._enter(name, seq, t)
        try:
            step = self.step + 1
            rc = self.eng.step_fold(step, header, seq, x, out, offset, count, code, kernel,
                                    div, start + t * alg.STALL_FRACTION)
            self.step = step
            self.seg.sent += x.nbytes
            if rc != _shmcoll.STATUS_OK:
                self._recover(rc, name, seq, t, start, step)
                self.eng.fold(step, out, x.nbytes, offset, count, code, kernel, div)
        finally:
            self._done(seq)
        return out

    def _copy_now(self, plan: tuple, x: np.ndarray, out: np.ndarray | None, root: int,
                  timeout: float | None) -> np.ndarray | None:
        name, header, shape, one_step = plan
        if not x.flags.c_contiguous:
            return None
        if out is None:
            out = np.empty(shape, x.dtype)
        elif not _usable_out(out, shape, x.dtype):
            return None
        t = self._resolve(timeout, name)
        seq = self._next()
        start = self._enter(name, seq, t)
        if not one_step:
            # byte views: the staged path copies bytes, whatever the dtype (bool, float16, ...)
            return self._staged_copy(name, x, x.reshape(-1).view(np.uint8),
                                     out.reshape(-1).view(np.uint8), out, root, seq, t, start)
        try:
            step = self.step + 1
            # the engine takes the arrays' bytes as they are (C-contiguous, any dtype): no
            # byte views to build (two of those cost about 1 us, a quarter of a small call)
            rc = self.eng.step_copy(step, header, seq, x, out, root,
                                    start + t * alg.STALL_FRACTION)
            self.step = step
            self.seg.sent += x.nbytes if root < 0 or root == self.me else 0
            if rc != _shmcoll.STATUS_OK:
                self._recover(rc, name, seq, t, start, step)
                self.eng.copy(step, x, out, root)
        finally:
            self._done(seq)
        return out

    def _staged_copy(self, name: str, x: np.ndarray, src: np.ndarray, dst: np.ndarray,
                     out: np.ndarray, root: int, seq: int, t: float, start: float
                     ) -> np.ndarray:
        """A large broadcast or all_gather on the engine's staged path (``fastpath``: cross-
        memory reads, or slot-sized pieces), with no call object."""
        from . import fastpath

        call = Step(name, seq, t, start)
        header = encode(name, x.dtype, x.shape, None, root, seq)
        try:
            if name == "broadcast":
                if self.me == root and not np.may_share_memory(dst, src):
                    dst[...] = src
                fastpath.broadcast(self, call, header, dst, root)
            else:
                fastpath.all_gather(self, call, header, src, dst)
        except (CollectiveTimeoutError, PeerClosedError) as exc:
            self.broken = exc
            raise
        finally:
            self._done(seq)
        return out

    def _resolve(self, timeout: float | None, name: str) -> float:
        """The call's timeout, checked before it takes a sequence number (a bad one raises
        with nothing taken)."""
        if timeout is None:
            return self.backend.timeout
        return self.backend.resolve_timeout(timeout, f"{name}: timeout")

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

    def _recover(self, rc: int, name: str, seq: int, timeout: float, start: float,
                 step: int) -> None:
        """After a one-call step that did not end OK: the stall report and the wait up to the
        hard deadline, or the error (which breaks the group for a timeout or a dead peer)."""
        try:
            self._settle(rc, Step(name, seq, timeout, start), step)
        except (CollectiveTimeoutError, PeerClosedError) as exc:
            self.broken = exc
            raise

    def _done(self, seq: int) -> None:
        self._next_seq = seq + 1
        if self._waiting:
            with self._cond:
                self._cond.notify_all()

    def sync(self, call: Step) -> None:
        """A step without data: nobody goes on before everyone has finished the last one."""
        step = self.step + 1
        self.eng.publish(step)
        rc = self.eng.wait(step, call.hard if call.reported else call.soft)
        self.step = step
        if rc != _shmcoll.STATUS_OK:
            try:
                self._settle(rc, call, step)
            except BaseException:
                # Withdraw this step before giving up: a peer still copying from our buffers
                # (a direct read) must not find us arrived once we return and the caller may
                # free them; it waits for a step that never comes and raises instead of
                # returning what it copied.
                self.eng.publish(step - 1)
                raise

    def data(self, rank: int, step: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """``rank``'s slot data of ``step``: its first ``nbytes`` as ``dtype``."""
        return self._data[rank][step & 1][:nbytes].view(dtype)

    def slot_bytes_of(self, rank: int, step: int, nbytes: int) -> bytes:
        """A copy of the first ``nbytes`` of ``rank``'s slot data of ``step``."""
        return self._data[rank][step & 1][:nbytes].tobytes()

    def raw_slot(self, rank: int, step: int) -> np.ndarray:
        """``rank``'s whole slot data of ``step`` (bytes; the next step's for writing when
        ``rank`` is this rank and ``step`` is ``self.step + 1``)."""
        return self._data[rank][step & 1]

    def slot_for_writing(self, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """This rank's slot data for the next step (to fill before :meth:`exchange`)."""
        return self.data(self.me, self.step + 1, nbytes, dtype)

    def extras(self, step: int) -> list[tuple[int, int, int]]:
        """Every rank's (pid, input address, output address) of ``step``."""
        return [_EXTRA.unpack_from(self._heads[r][step & 1], _EXTRA_OFF) for r in range(self.n)]

    def _headers_agree(self, step: int) -> bool:
        mine = bytes(self._heads[self.me][step & 1][:HEADER_SIZE])
        return all(bytes(self._heads[r][step & 1][:HEADER_SIZE]) == mine for r in range(self.n))

    def _stall_report(self, call: Step, step: int) -> None:
        call.reported = True
        waiting = self._missing(step)
        log.warning("%s (seq %d) on rank %d: still waiting for ranks %s after %.1fs "
                    "(shared-memory engine, step %d)", call.name, call.seq, self.me, waiting,
                    time.monotonic() - call.start, step)

    def _missing(self, step: int) -> list[int]:
        return [r for r in range(self.n)
                if r != self.me and (self.eng.published(r) - step) % (1 << 32) >= 1 << 31]

    def _check(self, rc: int, call: Step, step: int) -> None:
        if rc == _shmcoll.STATUS_OK:
            return
        if rc == _shmcoll.STATUS_MISMATCH:
            check_all(call.name, self.me,
                      [bytes(self._heads[r][step & 1][:HEADER_SIZE]) for r in range(self.n)])
            return  # pragma: no cover - check_all raised
        missing = self._missing(step)
        if rc == _shmcoll.STATUS_FAILED:
            raise self._failure(call, missing)
        raise CollectiveTimeoutError(
            f"{call.name} (seq {call.seq}) on rank {self.me}: timed out after "
            f"{call.timeout:g}s waiting for ranks {missing} (shared-memory engine)")

    def _failure(self, call: Step, missing: list[int]) -> BaseException:
        """The error for a step the failure flag ended: the failure of a peer that died (or
        aborted) in preference to one that closed its backend in order, which is usually a
        peer giving up because of the same death; a close alone is reported after a short
        grace for this process to learn of a death its peers saw first."""
        order = missing + [r for r in range(self.n) if r != self.me and r not in missing]
        grace = time.monotonic() + CLEAN_CLOSE_GRACE
        while True:
            failures = [f for f in (self.backend.peer_failure(call.name, p) for p in order)
                        if f is not None]
            for failure in failures:
                if not getattr(failure, "clean", False):
                    return failure
            if time.monotonic() >= grace:
                break
            time.sleep(0.005)
        if failures:
            return failures[0]
        return PeerClosedError(f"{call.name} (seq {call.seq}) on rank {self.me}: the engine "
                               "was shut down")

    # ------------------------------------------------------------------ cross-memory copies
    def write(self, rank: int, addr: int, data: np.ndarray) -> None:
        """Copy ``data`` to ``addr`` in ``rank``'s memory."""
        from ferro_backend import _shm

        try:
            _shm.cma_write(self.pids[rank], addr, data.reshape(-1).view(np.uint8))
            self.seg.sent += data.nbytes
        except OSError as exc:
            raise PeerClosedError(f"rank {self.me}: cannot write to rank {rank}'s memory "
                                  f"({exc})", peer=rank) from exc

    def read(self, rank: int, addr: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``addr`` in ``rank``'s memory into ``out``."""
        from ferro_backend import _shm

        try:
            _shm.cma_read(self.pids[rank], addr, out.reshape(-1).view(np.uint8))
            self.seg.received += out.nbytes
        except OSError as exc:
            raise PeerClosedError(f"rank {self.me}: cannot read rank {rank}'s memory ({exc})",
                                  peer=rank) from exc


def _usable_out(out, shape: tuple[int, ...], dtype: np.dtype) -> bool:
    """``out`` is what a one-call path can write into (else the general path checks it)."""
    return (type(out) is np.ndarray and out.shape == shape and out.dtype == dtype
            and out.flags.c_contiguous and out.flags.writeable)


_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_groups_lock = threading.Lock()


def group_for(backend: Any) -> EngineGroup | None:
    """The fast path of ``backend`` when it has a live engine, else None."""
    seg = getattr(backend, "engine", None)
    if seg is None:
        return None
    group = getattr(backend, "_ferro_engine_group", None)  # the common case: one lookup
    if group is not None and group.seg is seg:
        return group
    with _groups_lock:
        group = _groups.get(backend)
        if group is None or group.seg is not seg:
            group = _groups[backend] = EngineGroup(backend)
    try:
        backend._ferro_engine_group = group
    except AttributeError:  # a backend that takes no attributes: the weak map alone
        pass
    return group


__all__ = ["EngineGroup", "Step", "group_for"]
