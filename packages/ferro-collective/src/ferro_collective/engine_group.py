"""The same-host engine's per-backend state: slot views, the step counter, call order, errors.

:class:`EngineGroup` is what :mod:`.fastpath`'s collectives run on: it takes the steps of the
protocol (``_shmcoll.SlotEngine``), turns their status into ferro's errors (mismatch, timeout
naming the missing ranks, a dead peer), logs stall reports, keeps calls in issue order and
persistent scratch buffers. ``lean_barrier``/``lean_allreduce`` are the common small calls with
as little Python as possible.
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

from ferro_backend import CollectiveTimeoutError, PeerClosedError

from . import _reduce, _shmcoll
from . import algorithms as alg
from .header import HEADER_SIZE, check_all, encode
from .ops import OPS, ReduceOp

#: all_gather blocks of at least this many bytes are read straight from the peers' memory
#: (when cross-memory reads work), smaller ones go through the slots
DIRECT_COPY_BYTES = int(os.environ.get("FERRO_SHM_DIRECT_COPY_BYTES", 256 << 10))

log = logging.getLogger("ferro_collective")

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
        spin = 4000 if self.n <= cores else 0  # oversubscribed: never spin on a core a peer needs
        self.eng = _shmcoll.SlotEngine(
            seg.address, self.n, self.me, lay["ctrl_off"], lay["ctrl_stride"], lay["slot_off"],
            lay["slot_stride"], lay["parity_stride"], lay["head_bytes"], lay["slot_bytes"],
            seg.failed_address, spin)
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
        self._views: dict[tuple[int, int, np.dtype], list[np.ndarray]] = {}

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

    # ------------------------------------------------------------------ lean paths
    def lean_barrier(self, seq: int, timeout: float) -> None:
        """The barrier with nothing but the step: no call object unless something is wrong."""
        if self._next_seq != seq or self.broken is not None:
            self.run("barrier", seq, timeout, lambda call: self.exchange(
                call, encode("barrier", None, (), seq=seq)))
            return
        try:
            self._lean_step("barrier", seq, timeout, encode("barrier", None, (), seq=seq), 0, 0)
        finally:
            self._done(seq)

    def lean_allreduce(self, seq: int, x: np.ndarray, out: np.ndarray, op: ReduceOp,
                       timeout: float) -> bool:
        """A small allreduce of a kernel dtype in one step and one fold; False (nothing done)
        when it is not that case or not this call's turn, so the general path runs it."""
        nbytes = x.nbytes
        if nbytes > self.slot_bytes or self._next_seq != seq or self.broken is not None:
            return False
        try:
            step = self._lean_step("allreduce", seq, timeout,
                                   encode("allreduce", x.dtype, x.shape, op, -1, seq),
                                   x.ctypes.data, nbytes)
            inputs = self._slot_views(step, nbytes, x.dtype)
            _reduce.fold(out.reshape(-1), inputs, OPS[op].kernel,
                         float(self.n) if op is ReduceOp.MEAN else 0.0)
        finally:
            self._done(seq)
        return True

    def _slot_views(self, step: int, nbytes: int, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's slot data of ``step`` as ``nbytes`` of ``dtype`` (cached views)."""
        key = (step & 1, nbytes, dtype)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 256:
                self._views.clear()
            views = self._views[key] = [d[step & 1][:nbytes].view(dtype) for d in self._data]
        return views

    def lean_reduce_scatter(self, seq: int, x: np.ndarray, out: np.ndarray, op: ReduceOp,
                            timeout: float) -> bool:
        """A small reduce_scatter of a kernel dtype: one step, then the fold of this rank's
        part of every slot (what the general path's slot fold computes); False as above."""
        nbytes = x.nbytes
        if nbytes > self.slot_bytes or self._next_seq != seq or self.broken is not None:
            return False
        try:
            step = self._lean_step("reduce_scatter", seq, timeout,
                                   encode("reduce_scatter", x.dtype, x.shape, op, -1, seq),
                                   x.ctypes.data, nbytes)
            part = x.size // self.n
            s = self.me * part
            inputs = [v[s:s + part] for v in self._slot_views(step, nbytes, x.dtype)]
            _reduce.fold(out.reshape(-1), inputs, OPS[op].kernel,
                         float(self.n) if op is ReduceOp.MEAN else 0.0)
        finally:
            self._done(seq)
        return True

    def lean_broadcast(self, seq: int, x: np.ndarray, out: np.ndarray, root: int,
                       timeout: float) -> bool:
        """A broadcast that fits a slot, in one step (the root's data in its slot); False
        (nothing done) when not that case or not this call's turn."""
        nbytes = x.nbytes
        if nbytes > self.slot_bytes or self._next_seq != seq or self.broken is not None:
            return False
        try:
            mine = self.me == root
            step = self._lean_step("broadcast", seq, timeout,
                                   encode("broadcast", x.dtype, x.shape, None, root, seq),
                                   x.ctypes.data if mine else 0, nbytes if mine else 0)
            flat = out.reshape(-1)
            if mine:
                if not np.may_share_memory(out, x):
                    flat[...] = x.reshape(-1)
            else:
                flat[...] = self._slot_views(step, nbytes, x.dtype)[root]
        finally:
            self._done(seq)
        return True

    def lean_all_gather(self, seq: int, x: np.ndarray, out: np.ndarray,
                        timeout: float) -> bool:
        """An all_gather whose block goes through the slots (the general path's rule for
        small blocks), in one step; False (nothing done) otherwise."""
        nbytes = x.nbytes
        if (nbytes > self.slot_bytes or (self.cma_ok and nbytes >= DIRECT_COPY_BYTES)
                or self._next_seq != seq or self.broken is not None):
            return False
        try:
            step = self._lean_step("all_gather", seq, timeout,
                                   encode("all_gather", x.dtype, x.shape, None, -1, seq),
                                   x.ctypes.data, nbytes)
            rows = out.reshape(self.n, -1)
            for r, view in enumerate(self._slot_views(step, nbytes, x.dtype)):
                rows[r] = x.reshape(-1) if r == self.me else view
        finally:
            self._done(seq)
        return True

    def _lean_step(self, name: str, seq: int, timeout: float, header: bytes, addr: int,
                   nbytes: int) -> int:
        """One exchange step with no call object unless it does not end well; the step."""
        start = time.monotonic()
        step = self.step + 1
        rc = self.eng.exchange(step, header, addr, nbytes, start + timeout * alg.STALL_FRACTION)
        self.seg.sent += nbytes
        self.step = step
        if rc != _shmcoll.STATUS_OK:
            try:
                self._settle(rc, Step(name, seq, timeout, start), step)
            except (CollectiveTimeoutError, PeerClosedError) as exc:
                self.broken = exc
                raise
        return step

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
            for peer in missing + [r for r in range(self.n) if r != self.me]:
                failure = self.backend.peer_failure(call.name, peer)
                if failure is not None:
                    raise failure
            raise PeerClosedError(f"{call.name} (seq {call.seq}) on rank {self.me}: the "
                                  "engine was shut down")
        raise CollectiveTimeoutError(
            f"{call.name} (seq {call.seq}) on rank {self.me}: timed out after "
            f"{call.timeout:g}s waiting for ranks {missing} (shared-memory engine)")

    # ------------------------------------------------------------------ cross-memory reads
    def read(self, rank: int, addr: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``addr`` in ``rank``'s memory into ``out``."""
        from ferro_backend import _shm

        try:
            _shm.cma_read(self.pids[rank], addr, out.reshape(-1).view(np.uint8))
            self.seg.received += out.nbytes
        except OSError as exc:
            raise PeerClosedError(f"rank {self.me}: cannot read rank {rank}'s memory ({exc})",
                                  peer=rank) from exc


_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_groups_lock = threading.Lock()


def group_for(backend: Any) -> EngineGroup | None:
    """The fast path of ``backend`` when it has a live engine, else None."""
    if getattr(backend, "engine", None) is None:
        return None
    group = _groups.get(backend)  # the common case needs no lock
    if group is None:
        with _groups_lock:
            group = _groups.get(backend)
            if group is None:
                group = _groups[backend] = EngineGroup(backend)
    return group


__all__ = ["EngineGroup", "Step", "group_for"]
