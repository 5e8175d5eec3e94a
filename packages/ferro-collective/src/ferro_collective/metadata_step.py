"""The metadata round of the collectives whose sizes not every rank knows in advance.

``scatter`` (only the root knows the dtype and shape), ``all_gather_v`` and the all-to-alls (dim 0
differs between ranks and peers) and the object collectives (pickle sizes) need a small
all-gather of fixed-size blocks before their data moves. A :class:`MetaPlan` is a
:class:`~.plan.Plan` that runs:

1. the usual header exchange (when the mismatch check is on): the header names what must agree
   (collective, dtype, trailing shape, op, root), so a rank that calls ``gather`` while another
   calls ``scatter`` gets :class:`CollectiveMismatchError` on every rank as for every other
   collective (the exchange has the same message sizes whatever the collective);
2. Bruck's all-gather of every rank's metadata block (``ceil(log2 n)`` rounds of small messages),
   the first 8 bytes of which say whether this rank's own arguments were valid;
3. ``body(ctx, metas)`` with every rank's metadata, in rank order.

Over point-to-point messages steps 1 and 2 are one: on two ranks one message each way, the
metadata block with the header after it (:mod:`.pair`), on more the header exchange's Bruck
rounds with each rank's block before its header (:mod:`.gathered`); a disagreement there, in
the header or a message's length, raises on every rank as the header exchange does.

On a ``ShmBackend`` steps 1 and 2 are one step of the same-host engine (header and metadata in
the slots), so that a mismatch with a collective on the engine's fast path is caught there too.
A collective with an engine path (``engine_path=(put, run)``: scatter, the all-to-alls) puts its
data, or the addresses its peers read it from, in the same step, right after the metadata block
(:func:`payload_offset`), and ``run`` moves the data on the engine (:func:`put_pieces`,
:func:`get_pieces`); the others' body runs over point-to-point messages, in the engine's issue
order.

A rank whose arguments were invalid (a list of the wrong length, splits that do not add up...)
still takes part in steps 1 and 2 and then raises its own error; its peers raise
:class:`CollectiveMismatchError` naming it, instead of waiting for data that will never come.
Checks that depend on every rank's metadata are made by every rank on the same data, so every
rank raises the same error.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ferro_backend import Backend, CollectiveMismatchError, PeerClosedError
from ferro_backend.engine import AVAILABLE as _ENGINE

from . import gathered, pair
from .header import INVALID, dtype_from_code, dtype_name, encode, mismatch_check_enabled, refusal
from .header import dtype_code as header_dtype_code
from .p2p import Ctx, bruck_all_gather
from .plan import Plan

if TYPE_CHECKING:
    from .engine_group import EngineGroup, Step

#: an engine path of a :class:`MetaPlan`: ``put(group, payload)`` writes this rank's data (or
#: its addresses) into ``payload``, the free part of its slot, before the metadata step;
#: ``run(group, call, step, offset, metas, messages)`` moves the data after it (``step``: the
#: metadata step, whose slots hold every rank's payload at ``offset``; ``messages()``: the body
#: over point-to-point messages, for data that can go neither way)
EnginePath = tuple[Callable[[Any, np.ndarray], None],
                   Callable[[Any, Any, int, int, list[bytes], Callable[[], Any]], Any]]

if _ENGINE:
    from ferro_backend.engine._steps import ROTATE_MIN
else:  # no engine: no step moves data
    ROTATE_MIN = 0

_STATUS = struct.Struct("<q")
#: most dims a descriptor (dtype + shape) carries
MAX_DIMS = 64
_DESC = struct.Struct(f"<16sq{MAX_DIMS}q")
DESC_SIZE = _DESC.size


_descs: dict[bytes, tuple[np.dtype, tuple[int, ...]]] = {}
_ints: dict[int, struct.Struct] = {}


def dtype_code(dtype: np.dtype) -> bytes:
    """The code from which another rank rebuilds ``dtype`` (:func:`.header.dtype_code`, up to
    16 bytes), or a TypeError where there is none (a structured dtype: its code only tells
    dtypes apart)."""
    code = header_dtype_code(dtype, 16)
    if code.startswith(b"#"):
        raise TypeError(f"dtype {dtype} has no short name another rank can rebuild it from "
                        "(structured dtypes are not supported here)")
    return code


def pack_desc(x: np.ndarray | None) -> bytes:
    """A fixed-size descriptor of ``x``'s dtype and shape (zeros for None); a TypeError for
    a dtype without a short name (:func:`dtype_code`), a ValueError for more than
    ``MAX_DIMS`` dims."""
    if x is None:
        return bytes(DESC_SIZE)
    if x.ndim > MAX_DIMS:
        raise ValueError(f"{x.ndim} dims, at most {MAX_DIMS}")
    return _DESC.pack(dtype_code(x.dtype), x.ndim, *x.shape, *(0,) * (MAX_DIMS - x.ndim))


def unpack_desc(block: bytes) -> tuple[np.dtype, tuple[int, ...]]:
    desc = bytes(block[:DESC_SIZE])
    got = _descs.get(desc)  # the same few descriptors come back call after call
    if got is None:
        dstr, ndim, *dims = _DESC.unpack(desc)
        dtype = dtype_from_code(dstr)
        if dtype is None:  # (an ml_dtypes type this process cannot import)
            raise TypeError(f"dtype {dtype_name(dstr)} cannot be rebuilt on this rank")
        got = dtype, tuple(dims[:ndim])
        if len(_descs) > 256:
            _descs.clear()
        _descs[desc] = got
    return got


def _ints_struct(count: int) -> struct.Struct:
    st = _ints.get(count)
    if st is None:
        st = _ints[count] = struct.Struct(f"<{count}q")
    return st


def pack_ints(values) -> bytes:
    return _ints_struct(len(values)).pack(*values)


def unpack_ints(block: bytes, count: int, offset: int = 0) -> list[int]:
    return list(_ints_struct(count).unpack_from(block, offset))


class MetaPlan(Plan):
    """A collective with a metadata round (see the module docstring).

    ``header``: ``(dtype, shape, op, root)`` as for :class:`~.plan.Plan`, what every rank must
    agree on; ``meta``: this rank's metadata (bytes of one length on every rank); ``invalid``:
    this rank's own argument error, raised after the metadata round; ``body(ctx, metas)``: the
    data movement over point-to-point messages; ``engine_path``: the data movement on the
    engine (scatter, the all-to-alls), or None.
    """

    __slots__ = ("meta", "invalid", "engine_path", "_p2p")

    def __init__(self, name: str, backend: Backend, timeout: float | None, header: tuple,
                 meta: bytes, body: Callable[[Ctx, list[bytes]], object],
                 invalid: BaseException | None = None, engine_path: EnginePath | None = None,
                 algorithm: str | None = None) -> None:
        super().__init__(name, backend, timeout, header, body, algorithm=algorithm)  # type: ignore[arg-type]
        self.meta = meta
        self.invalid = invalid
        self.engine_path = engine_path if algorithm in (None, "auto") else None
        self._p2p: Ctx | None = None

    def run_python(self):
        ctx = self.context()
        try:
            return self._run_python(ctx)
        except PeerClosedError as exc:  # (the transport's words name only recv or send)
            ctx.name_failure(exc)
            raise

    def _run_python(self, ctx: Ctx):
        if ctx.n == 1:
            return self._finish(ctx, [self._block()])
        if not mismatch_check_enabled():
            return self._finish(ctx, bruck_all_gather(ctx, self._block(), ctx.next_tag(),
                                                      "the collective's metadata"))
        try:
            if ctx.n == 2:  # (header and metadata in one message each way)
                return self._finish(ctx, pair.metadata(ctx, self.encoded(), self._block()))
            # (more ranks: the metadata rides the header exchange's rounds)
            _, views = gathered.exchange(ctx, self.encoded(),
                                         np.frombuffer(self._block(), np.uint8))
        except CollectiveMismatchError:
            if self.invalid is not None:
                raise self.invalid from None
            raise
        return self._finish(ctx, [v.tobytes() for v in views])

    def run_engine(self, g, call):
        """On the same-host engine: the header, the metadata and (with an engine path) the data
        or its addresses in one engine step (so a mismatch with any collective, one-call or
        not, is seen there); then the engine path, or the body over point-to-point messages,
        still in the engine's issue order."""
        block = self._block()
        off = payload_offset(len(block))
        path = self.engine_path if off <= g.slot_bytes else None
        try:
            if len(block) <= g.slot_bytes:
                slot = g.engine.slot_data(g.me, g.step + 1)
                slot[:len(block)] = np.frombuffer(block, np.uint8)
                if path is not None and self.invalid is None:
                    path[0](g, slot[off:])
                done = g.exchange(call, self.encoded(), prefilled=len(block))
                blocks = [g.engine.slot_data(r, done)[:len(block)].tobytes() for r in range(g.n)]
            else:
                g.exchange(call, self.encoded())
                blocks = bruck_all_gather(self._ctx(), block, self._ctx().next_tag(),
                                          "the collective's metadata")
        except CollectiveMismatchError:
            if self.invalid is not None:
                raise self.invalid from None
            raise
        if path is None:
            return self._finish(self._ctx(), blocks)
        metas = self._metas(blocks)
        return path[1](g, call, done, off, metas, lambda: self.python(self._ctx(), metas))

    def encoded(self) -> bytes:
        """The header every rank compares: a refusal naming this rank's argument error where
        it has one (its peers' mismatch then gives the reason)."""
        if self.invalid is not None:
            return refusal(self.name, self.seq, self.invalid, self.span)
        return encode(self.name, *self.header, seq=self.seq, span=self.span)

    def _ctx(self) -> Ctx:
        """The point-to-point context of this call (made once, when needed)."""
        if self._p2p is None:
            self._p2p = self.context()
        return self._p2p

    def _block(self) -> bytes:
        return _STATUS.pack(INVALID if self.invalid is not None else 0) + self.meta

    def _finish(self, ctx: Ctx, blocks: list[bytes]):
        result = self.python(ctx, self._metas(blocks))
        ctx.release()
        return result

    def _metas(self, blocks: list[bytes]) -> list[bytes]:
        """Every rank's metadata, or this rank's own argument error, or a mismatch naming the
        ranks whose arguments were invalid."""
        if self.invalid is not None:
            raise self.invalid
        bad = [r for r, b in enumerate(blocks) if _STATUS.unpack_from(b)[0] & INVALID]
        if bad:
            raise CollectiveMismatchError(
                f"{self.name} (seq {self.seq}): ranks {bad} passed invalid arguments (see the "
                "error on those ranks)")
        return [b[_STATUS.size:] for b in blocks]


def payload_offset(block_bytes: int) -> int:
    """Where an engine path's data starts in a slot after a metadata block of
    ``block_bytes`` (the next cache line)."""
    return -(-block_bytes // 64) * 64


def guard(fn: Callable[[], object]) -> tuple[object, BaseException | None]:
    """``(fn(), None)``, or ``(None, the TypeError/ValueError it raised)``: a rank's own
    argument error, to be raised after the metadata round (see :class:`MetaPlan`)."""
    try:
        return fn(), None
    except (TypeError, ValueError) as exc:
        return None, exc


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
    (benchmarks/README.md, "Measurements behind the defaults")."""
    if nbytes <= room:
        return SLOT
    if g.cma_ok and room >= _ADDR.itemsize * g.n:
        return DIRECT
    return MESSAGES


def payload_rot(g: EngineGroup, step: int, off: int, nbytes: int) -> int:
    """Where a rank's ``nbytes`` of data start after the metadata (at ``off``) in its slot of
    ``step``: at 0, or, from ``ROTATE_MIN`` bytes, moving on through the slot from call to call
    as the door's one-step data does (``_onestep.h``: writing the lines a peer read the call
    before waits for its copies to be invalidated; lines it read calls ago are out of its
    cache). The same on every rank: the step and every rank's size are known to all."""
    if off + nbytes < ROTATE_MIN:
        return 0
    return g.steps.rot(step, off + nbytes)


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
        pos = payload_rot(g, g.step + 1, g.slot_bytes - payload.size, nbytes)
        for d, p in enumerate(pieces):
            if d != me and p.size:
                payload[pos:pos + p.size] = p
                pos += p.size
        g.engine.count_filled(nbytes)
    elif where == DIRECT:
        if flat is not None:
            base = flat.ctypes.data
            addrs = [base + s for s in starts]
        else:
            addrs = [p.ctypes.data for p in pieces]
        payload[:len(addrs) * _ADDR.itemsize].view(_ADDR)[:] = addrs


def put_block(g: EngineGroup, payload: np.ndarray, block: np.ndarray) -> None:
    """:func:`put_pieces` for a rank that sends every rank the same ``block`` (1-d bytes:
    all_gather_v): it rides in the slot once, or every peer finds its address (read with
    :func:`get_pieces`, each rank's piece starting at 0 of its sender's data)."""
    where = placement(g, block.size, payload.size)
    if where == SLOT:
        at = payload_rot(g, g.step + 1, g.slot_bytes - payload.size, block.size)
        payload[at:at + block.size] = block
        g.engine.count_filled(block.size)
    elif where == DIRECT:
        payload[:g.n * _ADDR.itemsize].view(_ADDR)[:] = block.ctypes.data


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
        slot = g.engine.slot_data(r, step)
        if where[r] == SLOT:
            start = off + payload_rot(g, step, off, totals[r]) + starts[r]
            dst[...] = slot[start:start + dst.size]
        else:
            at = off + me * _ADDR.itemsize
            g.read(r, int(slot[at:at + _ADDR.itemsize].view(_ADDR)[0]), dst)
    if DIRECT in where:
        g.sync(call)  # nobody reads our buffers any more
    if mine is not None and own_last:
        mine[...] = own
    return True


__all__ = ["DESC_SIZE", "DIRECT", "MESSAGES", "ROTATE_MIN", "SLOT", "EnginePath", "MetaPlan",
           "get_pieces", "guard", "pack_desc", "pack_ints", "payload_offset",
           "payload_rot", "placement", "put_block", "put_pieces", "sent_bytes", "unpack_desc",
           "unpack_ints"]
