"""The metadata round of the collectives whose sizes not every rank knows in advance.

``scatter`` (only the root knows the dtype and shape), ``all_gather_v`` and the all-to-alls (dim 0
differs between ranks and peers) and the object collectives (pickle sizes) need a small
all-gather of fixed-size blocks before their data moves. A :class:`MetaCall` is a
:class:`~.call.Call` that runs:

1. the usual header exchange (when the mismatch check is on): the header names what must agree
   (collective, dtype, trailing shape, op, root), so a rank that calls ``gather`` while another
   calls ``scatter`` gets :class:`CollectiveMismatchError` on every rank as for every other
   collective (the exchange has the same message sizes whatever the collective);
2. Bruck's all-gather of every rank's metadata block (``ceil(log2 n)`` rounds of small messages),
   the first 8 bytes of which say whether this rank's own arguments were valid;
3. ``body(ctx, metas)`` with every rank's metadata, in rank order.

On a ``ShmBackend`` steps 1 and 2 are one step of the same-host engine (header and metadata in
the slots), so that a mismatch with a collective on the engine's fast path is caught there too.
A collective with an engine path (``fast=(put, run)``: scatter, the all-to-alls) puts its data,
or the addresses its peers read it from, in the same step, right after the metadata block
(:func:`payload_offset`), and ``run`` moves the data on the engine (see :mod:`.fastpath`); the
others' body runs over point-to-point messages, in the engine's issue order.

A rank whose arguments were invalid (a list of the wrong length, splits that do not add up...)
still takes part in steps 1 and 2 and then raises its own error; its peers raise
:class:`CollectiveMismatchError` naming it, instead of waiting for data that will never come.
Checks that depend on every rank's metadata are made by every rank on the same data, so every
rank raises the same error.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from ferro_backend import Backend, CollectiveMismatchError

from . import algorithms as alg
from ._state import tag_base
from .call import Call
from .header import INVALID, encode, mismatch_check_enabled

#: an engine path of a :class:`MetaCall`: ``put(group, payload)`` writes this rank's data (or
#: its addresses) into ``payload``, the free part of its slot, before the metadata step;
#: ``run(group, call, step, offset, metas, messages)`` moves the data after it (``step``: the
#: metadata step, whose slots hold every rank's payload at ``offset``; ``messages()``: the body
#: over point-to-point messages, for data that can go neither way)
EnginePath = tuple[Callable[[Any, np.ndarray], None],
                   Callable[[Any, Any, int, int, list[bytes], Callable[[], Any]], Any]]

_STATUS = struct.Struct("<q")
#: most dims a descriptor (dtype + shape) carries
MAX_DIMS = 64
_DESC = struct.Struct(f"<16sq{MAX_DIMS}q")
DESC_SIZE = _DESC.size


_codes: dict[np.dtype, bytes] = {}
_descs: dict[bytes, tuple[np.dtype, tuple[int, ...]]] = {}
_ints: dict[int, struct.Struct] = {}


def dtype_code(dtype: np.dtype) -> bytes:
    """A short name from which ``np.dtype`` rebuilds ``dtype`` on another rank (``str`` keeps
    the byte order; ``name`` covers extension dtypes such as bfloat16), or a ValueError."""
    code = _codes.get(dtype)
    if code is not None:
        return code
    for name in (dtype.str, dtype.name):
        try:
            if len(name) <= 16 and np.dtype(name) == dtype:
                if len(_codes) < 256:
                    _codes[dtype] = name.encode()
                return name.encode()
        except TypeError:
            pass
    raise ValueError(f"dtype {dtype} has no short name another rank can rebuild it from "
                     "(structured dtypes are not supported here)")


def pack_desc(x: np.ndarray | None) -> bytes:
    """A fixed-size descriptor of ``x``'s dtype and shape (zeros for None); a ValueError for
    a dtype without a short name or more than ``MAX_DIMS`` dims."""
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
        got = np.dtype(dstr.rstrip(b"\x00").decode()), tuple(dims[:ndim])
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


def bruck_all_gather(ctx: alg.Ctx, block: bytes, tag: int, what: str) -> list[bytes]:
    """Every rank's ``block`` (all of one length), in rank order: Bruck's all-gather."""
    n, me, size = ctx.n, ctx.rank, len(block)
    known = bytearray(block)  # blocks of ranks me, me+1, ..., me+count-1 (mod n)
    count, distance = 1, 1
    while count < n:
        take = min(distance, n - count)
        src, dst = (me + distance) % n, (me - distance) % n
        incoming = bytearray(take * size)
        req = ctx.backend.irecv(incoming, src, tag=tag)
        ctx.send(bytes(known[: take * size]), dst, tag)
        ctx.wait(req, src, what, {(me + count + i) % n for i in range(n - count)})
        known += incoming
        count += take
        distance *= 2
    blocks = [b""] * n
    for i in range(n):
        blocks[(me + i) % n] = bytes(known[i * size:(i + 1) * size])
    return blocks


class MetaCall(Call):
    """A collective with a metadata round (see the module docstring).

    ``header``: ``(dtype, shape, op, root)`` as for :class:`Call`, what every rank must agree
    on; ``meta``: this rank's metadata (bytes of one length on every rank); ``invalid``: this
    rank's own argument error, raised after the metadata round; ``body(ctx, metas)``: the data
    movement. Runs in issue order with the engine's calls on a ``ShmBackend`` (through
    ``EngineGroup.run``, over point-to-point messages).
    """

    def __init__(self, name: str, backend: Backend, timeout: float | None, header: tuple,
                 meta: bytes, body: Callable[[alg.Ctx, list[bytes]], object],
                 invalid: BaseException | None = None, fast: EnginePath | None = None,
                 algorithm: str | None = None) -> None:
        super().__init__(name, backend, timeout, header, body, fast,  # type: ignore[arg-type]
                         algorithm)
        self.meta = meta
        self.invalid = invalid
        self._p2p: alg.Ctx | None = None

    def _python(self, _step=None):
        ctx = alg.Ctx(self.backend, self.name, self.seq, tag_base(self.seq), self.timeout)
        if ctx.n == 1:
            return self._finish(ctx, [self._block()])
        if mismatch_check_enabled():
            try:
                alg.header_exchange(ctx, self._header())
            except CollectiveMismatchError:
                if self.invalid is not None:
                    raise self.invalid from None
                raise
        blocks = bruck_all_gather(ctx, self._block(), ctx.next_tag(),
                                  "the collective's metadata")
        return self._finish(ctx, blocks)

    def __call__(self):
        if self.group is None:
            return self._python()
        return self.group.run(self.name, self.seq, self.timeout, self._engine)

    def _engine(self, call):
        """On the same-host engine: the header, the metadata and (with an engine path) the data
        or its addresses in one engine step (so a mismatch with any collective, fast path or
        not, is seen there); then the engine path, or the body over point-to-point messages,
        still in the engine's issue order."""
        g = self.group
        block = self._block()
        off = payload_offset(len(block))
        fast = self.fast if off <= g.slot_bytes else None
        try:
            if len(block) <= g.slot_bytes:
                slot = g.raw_slot(g.me, g.step + 1)
                slot[:len(block)] = np.frombuffer(block, np.uint8)
                if fast is not None and self.invalid is None:
                    fast[0](g, slot[off:])
                done = g.exchange(call, self._header())
                g.seg.sent += len(block)
                blocks = [g.slot_bytes_of(r, done, len(block)) for r in range(g.n)]
            else:
                g.exchange(call, self._header())
                blocks = bruck_all_gather(self._ctx(), block, self._ctx().next_tag(),
                                          "the collective's metadata")
        except CollectiveMismatchError:
            if self.invalid is not None:
                raise self.invalid from None
            raise
        if fast is None:
            return self._finish(self._ctx(), blocks)
        metas = self._metas(blocks)
        return fast[1](g, call, done, off, metas, lambda: self.body(self._ctx(), metas))

    def _ctx(self) -> alg.Ctx:
        """The point-to-point context of this call (made once, when needed)."""
        if self._p2p is None:
            self._p2p = alg.Ctx(self.backend, self.name, self.seq, tag_base(self.seq),
                                self.timeout)
        return self._p2p

    def _header(self) -> bytes:
        return encode(self.name, *self.header, seq=self.seq,
                      flags=INVALID if self.invalid is not None else 0)

    def _block(self) -> bytes:
        return _STATUS.pack(INVALID if self.invalid is not None else 0) + self.meta

    def _finish(self, ctx: alg.Ctx, blocks: list[bytes]):
        return self.body(ctx, self._metas(blocks))

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
    argument error, to be raised after the metadata round (see :class:`MetaCall`)."""
    try:
        return fn(), None
    except (TypeError, ValueError) as exc:
        return None, exc
