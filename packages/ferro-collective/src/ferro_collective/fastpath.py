"""The same-host fast path: collectives over the shared segment of a ``ShmBackend``.

When every rank of a backend shares one host (``ShmBackend`` with its engine on), each collective
runs on the segment instead of the Python algorithms over sockets. A collective is a short
sequence of *steps* (see ``_shmcoll.pyx``): in its first step every rank writes the mismatch
header (and, for messages up to the slot size, its data) into its slot, publishes, and waits for
everyone, so the header check costs no extra round. Then:

- **small** (data fits a slot): every rank folds or copies the slots it needs, in rank order
  (``_reduce.fold``): one step in all, the same bits on every rank;
- **large**, where ranks may read each other's memory (cross-memory attach): the first step
  carries each rank's pid and buffer addresses; reductions are a reduce-scatter (each rank folds
  its chunk of every rank's input in rank order, piece by piece, reading peers' pieces straight
  from their memory) and an all-gather (each rank copies the other chunks from their owners'
  outputs); broadcast and all_gather copy straight from the owner. A last step keeps every buffer
  alive until nobody reads it any more;
- **large**, without cross-memory reads: the data goes through the slots in slot-sized pieces.

Reductions fold in rank order, exactly as the star algorithm does, so results are the same bits
on every rank and equal to ``algorithm="star"``'s. Calls on one backend run one at a time in the
order they were issued (the same order on every rank, as the collectives require); async calls
queue behind earlier ones. After a timeout or a dead peer the engine refuses further calls: the
steps of the ranks no longer agree.
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
from ferro_backend.partition import split_bounds

from . import _reduce, _shmcoll
from . import algorithms as alg
from .header import HEADER_SIZE, check_all, encode
from .ops import OPS, ReduceOp

log = logging.getLogger("ferro_collective")

#: bytes of each peer's input read and folded at once by the large reduction
PIECE_BYTES = 512 << 10
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
            self.run("barrier", seq, timeout, lambda call: barrier(
                self, call, encode("barrier", None, (), seq=seq)))
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
            key = (step & 1, nbytes, x.dtype)
            inputs = self._views.get(key)
            if inputs is None:
                if len(self._views) > 256:
                    self._views.clear()
                inputs = self._views[key] = [d[step & 1][:nbytes].view(x.dtype)
                                             for d in self._data]
            _reduce.fold(out.reshape(-1), inputs, OPS[op].kernel,
                         float(self.n) if op is ReduceOp.MEAN else 0.0)
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
            self._settle(rc, call, step)

    def data(self, rank: int, step: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """``rank``'s slot data of ``step``: its first ``nbytes`` as ``dtype``."""
        return self._data[rank][step & 1][:nbytes].view(dtype)

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


# ----------------------------------------------------------------------------- the collectives
def allreduce(g: EngineGroup, call: Step, header: bytes, x: np.ndarray, out: np.ndarray,
              wd: np.dtype, op: ReduceOp) -> None:
    """``out`` (1-d, x's dtype) = the rank-order fold of every rank's ``x`` (1-d)."""
    mean = g.n if op is ReduceOp.MEAN else None
    nbytes = x.size * wd.itemsize
    if nbytes <= g.slot_bytes:
        _fold_through_slots(g, call, header, x, out, wd, op, mean)
    elif g.cma_ok:
        bounds = split_bounds(x.size, g.n)
        step = g.exchange(call, header, extra=(os.getpid(), x.ctypes.data, out.ctypes.data))
        extras = g.extras(step)
        s, e = bounds[g.me]
        _fold_from_peers(g, x, out[s:e], wd, op, mean, extras, s, e)
        g.sync(call)  # every chunk is reduced
        for r, (rs, re) in enumerate(bounds):
            if r != g.me and re > rs:
                g.read(r, extras[r][2] + rs * out.itemsize, out[rs:re])
        g.sync(call)  # nobody reads our buffers any more
    else:
        per = max(1, g.slot_bytes // wd.itemsize)
        for s in range(0, x.size, per):
            e = min(x.size, s + per)
            _fold_through_slots(g, call, header, x[s:e], out[s:e], wd, op, mean)


def reduce_scatter(g: EngineGroup, call: Step, header: bytes, x: np.ndarray, out: np.ndarray,
                   wd: np.dtype, op: ReduceOp) -> None:
    """``out`` = this rank's ``1/n`` of the rank-order fold of every rank's ``x``."""
    mean = g.n if op is ReduceOp.MEAN else None
    size = x.size // g.n
    s, e = g.me * size, (g.me + 1) * size
    if x.size * wd.itemsize <= g.slot_bytes:
        _fold_through_slots(g, call, header, x, out, wd, op, mean, (s, e))
    elif g.cma_ok:
        step = g.exchange(call, header, extra=(os.getpid(), x.ctypes.data, 0))
        _fold_from_peers(g, x, out, wd, op, mean, g.extras(step), s, e)
        g.sync(call)
    else:
        full = g.scratch("reduce_scatter", out.dtype, x.size)
        allreduce(g, call, header, x, full, wd, op)
        out[...] = full[s:e]


def broadcast(g: EngineGroup, call: Step, header: bytes, buf: np.ndarray, root: int) -> None:
    """Every rank's ``buf`` (1-d bytes) becomes ``root``'s."""
    if buf.size <= g.slot_bytes:
        step = g.exchange(call, header, buf if g.me == root else None)
        if g.me != root:
            buf[...] = g.data(root, step, buf.size, buf.dtype)
    elif g.cma_ok:
        step = g.exchange(call, header, extra=(os.getpid(), buf.ctypes.data, 0))
        if g.me != root:
            g.read(root, g.extras(step)[root][1], buf)
        g.sync(call)
    else:
        for s in range(0, buf.size, g.slot_bytes):
            broadcast(g, call, header, buf[s:s + g.slot_bytes], root)


def all_gather(g: EngineGroup, call: Step, header: bytes, block: np.ndarray,
               out: np.ndarray) -> None:
    """``out`` (1-d bytes) = every rank's ``block`` (1-d bytes), in rank order."""
    size = block.size
    if size <= g.slot_bytes:
        step = g.exchange(call, header, block)
        for r in range(g.n):
            out[r * size:(r + 1) * size] = block if r == g.me else g.data(r, step, size,
                                                                          block.dtype)
    elif g.cma_ok:
        step = g.exchange(call, header, extra=(os.getpid(), block.ctypes.data, 0))
        extras = g.extras(step)
        for r in range(g.n):
            if r == g.me:
                out[r * size:(r + 1) * size] = block
            else:
                g.read(r, extras[r][1], out[r * size:(r + 1) * size])
        g.sync(call)
    else:
        gathered = out.reshape(g.n, size)
        for s in range(0, size, g.slot_bytes):
            e = min(size, s + g.slot_bytes)
            piece = g.scratch("all_gather", np.dtype(np.uint8), g.n * (e - s))
            all_gather(g, call, header, block[s:e], piece)
            gathered[:, s:e] = piece.reshape(g.n, e - s)


def barrier(g: EngineGroup, call: Step, header: bytes) -> None:
    g.exchange(call, header)


# ----------------------------------------------------------------------------- folding
def _fold_through_slots(g: EngineGroup, call: Step, header: bytes, x: np.ndarray,
                        out: np.ndarray, wd: np.dtype, op: ReduceOp, mean: int | None,
                        part: tuple[int, int] | None = None) -> None:
    """One step: every rank's ``x`` through its slot, then ``out`` = the fold of
    ``[s:e]`` (``part``; default all) of every slot."""
    if x.dtype == wd:
        step = g.exchange(call, header, x)
    else:  # widened: the slot holds the work dtype, so peers need not convert
        np.copyto(g.slot_for_writing(x.size * wd.itemsize, wd), x, casting="unsafe")
        g.seg.sent += x.size * wd.itemsize
        step = g.exchange(call, header)
    s, e = part if part is not None else (0, x.size)
    inputs = [g.data(r, step, x.size * wd.itemsize, wd)[s:e] for r in range(g.n)]
    if out.dtype == wd:
        _fold(out, inputs, op, mean)
    else:
        acc = g.scratch("fold", wd, e - s)
        _fold(acc, inputs, op, mean)
        np.copyto(out, acc, casting="unsafe")


def _fold_from_peers(g: EngineGroup, x: np.ndarray, target: np.ndarray, wd: np.dtype,
                     op: ReduceOp, mean: int | None, extras: list[tuple[int, int, int]],
                     s: int, e: int) -> None:
    """``target`` (``e - s`` items) = the rank-order fold of every rank's ``x[s:e]``, read piece
    by piece from the peers' memory (``extras``: their input addresses). ``target`` may be
    ``x[s:e]`` itself (an in-place allreduce): this rank's piece is then copied first."""
    per = max(1, PIECE_BYTES // max(x.itemsize, wd.itemsize))
    count = min(per, e - s)
    aliased = np.may_share_memory(x, target)
    bufs = [g.scratch(f"piece{r}", x.dtype, count) for r in range(g.n)]
    convert = wd != x.dtype
    conv = [g.scratch(f"conv{r}", wd, count) for r in range(g.n)] if convert else None
    acc = g.scratch("acc", wd, count) if wd != target.dtype else None
    for ps in range(s, e, per):
        pe = min(e, ps + per)
        k = pe - ps
        inputs = []
        for r in range(g.n):
            if r != g.me:
                piece = bufs[r][:k]
                g.read(r, extras[r][1] + ps * x.itemsize, piece)
            elif aliased and not convert:
                piece = bufs[r][:k]
                piece[...] = x[ps:pe]
            else:
                piece = x[ps:pe]
            if conv is not None:
                np.copyto(conv[r][:k], piece, casting="unsafe")
                piece = conv[r][:k]
            inputs.append(piece)
        dest = target[ps - s:pe - s]
        if acc is None:
            _fold(dest, inputs, op, mean)
        else:
            _fold(acc[:k], inputs, op, mean)
            np.copyto(dest, acc[:k], casting="unsafe")


def _fold(out: np.ndarray, inputs: list[np.ndarray], op: ReduceOp, mean: int | None) -> None:
    """``ops.fold`` without its checks: every view here is built with out's dtype and length."""
    _reduce.fold(out, inputs, OPS[op].kernel, float(mean or 0))


# ----------------------------------------------------------------------------- groups
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


__all__ = ["EngineGroup", "all_gather", "allreduce", "barrier", "broadcast", "group_for",
           "reduce_scatter"]
