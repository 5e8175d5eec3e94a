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

scatter and the all-to-alls start with a metadata step (:class:`~.metadata.MetaCall`: the
sizes are not known to every rank in advance); each rank's data rides in that same step, after
the metadata, when it is small, or else the step carries the addresses its peers read it from,
and a last step keeps those buffers alive until every peer has read its piece
(:func:`placement` says which, from sizes every rank knows after the step). Without
cross-memory reads, data too large for a slot goes over point-to-point messages.

Reductions fold in rank order, exactly as the star algorithm does, so results are the same bits
on every rank and equal to ``algorithm="star"``'s. Calls on one backend run one at a time in the
order they were issued (the same order on every rank, as the collectives require); async calls
queue behind earlier ones. After a timeout or a dead peer the engine refuses further calls: the
steps of the ranks no longer agree.
"""

from __future__ import annotations

import os

import numpy as np

from ferro_backend.partition import split_bounds

from . import _reduce
from .engine_group import EngineGroup, Step
from .ops import OPS, ReduceOp

#: bytes of each peer's input read and folded at once by the large reduction
PIECE_BYTES = 512 << 10
# EngineGroup.direct_copy_bytes and .broadcast_direct_bytes: data that fits a slot goes through
# the slots unless told otherwise (measured faster: benchmarks/README.md); larger data is copied
# straight from its owners' memory (one copy instead of two) where cross-memory reads work.


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
    """Every rank's ``buf`` (1-d bytes) becomes ``root``'s.

    Through the root's slot when it fits (and is below ``BROADCAST_DIRECT_BYTES`` where
    cross-memory copies work); else by cross-memory copies with the work shared: every reader
    pulls the first ``(n-1)/n`` of the buffer from the root while the root pushes the last
    ``1/n`` into each reader (so the root's core copies too instead of waiting), then a step
    without data so that nobody returns while its buffer is still being copied."""
    size = buf.size
    if size <= g.slot_bytes and not (g.cma_ok and size >= g.broadcast_direct_bytes):
        step = g.exchange(call, header, buf if g.me == root else None)
        if g.me != root:
            buf[...] = g.data(root, step, size, buf.dtype)
    elif g.cma_ok:
        step = g.exchange(call, header, extra=(os.getpid(), buf.ctypes.data, buf.ctypes.data))
        extras = g.extras(step)
        cut = size - (size // g.n) // 64 * 64  # the readers pull [0, cut), the root pushes
        if g.me == root:
            for r in range(g.n):
                if r != root:
                    g.write(r, extras[r][2] + cut, buf[cut:])
        else:
            g.read(root, extras[root][1], buf[:cut])
        g.sync(call)
    else:
        for s in range(0, buf.size, g.slot_bytes):
            broadcast(g, call, header, buf[s:s + g.slot_bytes], root)


def all_gather(g: EngineGroup, call: Step, header: bytes, block: np.ndarray,
               out: np.ndarray) -> None:
    """``out`` (1-d bytes) = every rank's ``block`` (1-d bytes), in rank order."""
    size = block.size
    if size <= g.slot_bytes and not (g.cma_ok and size >= g.direct_copy_bytes):
        step = g.exchange(call, header, block)
        for r in range(g.n):
            out[r * size:(r + 1) * size] = block if r == g.me else g.data(r, step, size,
                                                                          block.dtype)
    elif g.cma_ok:
        # this rank's own block first: while the peers arrive, and from a hot source
        out[g.me * size:(g.me + 1) * size] = block
        step = g.exchange(call, header, extra=(os.getpid(), block.ctypes.data, 0))
        extras = g.extras(step)
        for r in range(g.n):
            if r != g.me:
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


# ----------------------------------------------------------------------------- one data step
#: where a rank's data goes in scatter and the all-to-alls (:func:`placement`)
SLOT, DIRECT, MESSAGES = 0, 1, 2
_ADDR = np.dtype("<u8")


def placement(g: EngineGroup, nbytes: int, room: int) -> int:
    """How a rank's ``nbytes`` of data reach its peers when ``room`` bytes of its slot are free
    after the metadata: ``SLOT`` (in the metadata step), ``DIRECT`` (its peers read its memory;
    the slot holds the addresses) or ``MESSAGES`` (point-to-point). Every rank computes the same
    answer for every rank: the sizes are in the metadata, ``cma_ok`` is the group's.

    Data that fits goes in the slot, whatever its size (as gather's): one step instead of two,
    and on the 2-core test machine two copies through the slot beat one cross-memory read
    (2 ranks, 512 KiB a rank: gather through the slots ~37 us, scatter read directly ~90 us)."""
    if nbytes <= room:
        return SLOT
    if g.cma_ok and room >= _ADDR.itemsize * g.n:
        return DIRECT
    return MESSAGES


def put_pieces(g: EngineGroup, payload: np.ndarray, pieces: list[np.ndarray],
               flat: np.ndarray | None = None, starts: list[int] | None = None) -> None:
    """Before the metadata step: this rank's ``pieces`` (1-d bytes, one per rank; its own is
    not sent) into ``payload`` (the free part of its slot) back to back, or the addresses its
    peers read them from, as :func:`placement` says. ``flat``: the pieces are this array's
    bytes from ``starts[d]`` on (their addresses then cost no ``ctypes`` call each)."""
    me = g.me
    nbytes = sum(p.size for p in pieces) - pieces[me].size
    where = placement(g, nbytes, payload.size)
    if where == SLOT:
        pos = 0
        for d, p in enumerate(pieces):
            if d != me and p.size:
                payload[pos:pos + p.size] = p
                pos += p.size
        g.seg.sent += nbytes
    elif where == DIRECT:
        if flat is not None:
            base = flat.ctypes.data
            addrs = [base + s for s in starts]
        else:
            addrs = [p.ctypes.data for p in pieces]
        payload[:len(addrs) * _ADDR.itemsize].view(_ADDR)[:] = addrs


def sent_bytes(sizes: list[list[int]], me: int) -> tuple[list[int], list[int]]:
    """From ``sizes[r][d]`` (the bytes rank ``r`` sends rank ``d``): what each rank puts in
    its slot (its own piece stays home) and where this rank's piece starts there."""
    totals, starts = [], []
    for r, row in enumerate(sizes):
        totals.append(sum(row) - row[r])
        starts.append(sum(row[:me]) - (row[r] if r < me else 0))
    return totals, starts


def get_pieces(g: EngineGroup, call: Step, step: int, off: int, totals: list[int],
               starts: list[int], recvs: list[np.ndarray | None],
               own: np.ndarray | None = None, own_last: bool = False) -> bool:
    """After the metadata step: ``recvs[r]`` (1-d bytes; None or empty: nothing) = this rank's
    piece of rank ``r``'s data; rank ``r`` sends ``totals[r]`` bytes in all (its own piece left
    out), our piece at byte ``starts[r]`` of them (:func:`sent_bytes`); ``own``: this rank's
    piece of its own data (copied last when ``own_last``: its destination may overlap what the
    peers read). False (nothing done) when some rank's data must go over messages (the same
    answer on every rank); else True, after a last step that keeps every buffer alive until
    nobody reads it when some were read directly."""
    n, me = g.n, g.me
    room = g.slot_bytes - off
    where = [placement(g, t, room) for t in totals]
    if MESSAGES in where:
        return False
    mine = recvs[me] if own is not None and recvs[me] is not None and recvs[me].size else None
    if mine is not None and not own_last:
        mine[...] = own
    for i in range(1, n):  # rank me+1 first: the ranks read different peers at once
        r = (me + i) % n
        dst = recvs[r]
        if dst is None or not dst.size:
            continue
        slot = g.raw_slot(r, step)
        if where[r] == SLOT:
            start = off + starts[r]
            dst[...] = slot[start:start + dst.size]
        else:
            at = off + me * _ADDR.itemsize
            g.read(r, int(slot[at:at + _ADDR.itemsize].view(_ADDR)[0]), dst)
    if DIRECT in where:
        g.sync(call)  # nobody reads our buffers any more
    if mine is not None and own_last:
        mine[...] = own
    return True


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


__all__ = ["DIRECT", "MESSAGES", "SLOT", "all_gather", "allreduce", "barrier", "broadcast",
           "get_pieces", "placement", "put_pieces", "reduce_scatter", "sent_bytes"]
