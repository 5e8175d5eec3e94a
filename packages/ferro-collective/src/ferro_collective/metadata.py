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
the slots), so that a mismatch with a collective on the engine's fast path is caught there too;
the body then runs over point-to-point messages, in the engine's issue order.

A rank whose arguments were invalid (a list of the wrong length, splits that do not add up...)
still takes part in steps 1 and 2 and then raises its own error; its peers raise
:class:`CollectiveMismatchError` naming it, instead of waiting for data that will never come.
Checks that depend on every rank's metadata are made by every rank on the same data, so every
rank raises the same error.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from ferro_backend import Backend, CollectiveMismatchError

from . import algorithms as alg
from ._state import tag_base
from .call import Call
from .header import INVALID, encode, mismatch_check_enabled

_STATUS = struct.Struct("<q")
#: most dims a descriptor (dtype + shape) carries
MAX_DIMS = 64
_DESC = struct.Struct(f"<16sq{MAX_DIMS}q")
DESC_SIZE = _DESC.size


def dtype_code(dtype: np.dtype) -> bytes:
    """A short name from which ``np.dtype`` rebuilds ``dtype`` on another rank (``str`` keeps
    the byte order; ``name`` covers extension dtypes such as bfloat16), or a ValueError."""
    for code in (dtype.str, dtype.name):
        try:
            if len(code) <= 16 and np.dtype(code) == dtype:
                return code.encode()
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
    dims = list(x.shape) + [0] * (MAX_DIMS - x.ndim)
    return _DESC.pack(dtype_code(x.dtype), x.ndim, *dims)


def unpack_desc(block: bytes) -> tuple[np.dtype, tuple[int, ...]]:
    dstr, ndim, *dims = _DESC.unpack(block[:DESC_SIZE])
    return np.dtype(dstr.rstrip(b"\x00").decode()), tuple(dims[:ndim])


def pack_ints(values) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def unpack_ints(block: bytes, count: int, offset: int = 0) -> list[int]:
    return np.frombuffer(block, dtype="<i8", count=count, offset=offset).tolist()


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
                 invalid: BaseException | None = None) -> None:
        super().__init__(name, backend, timeout, header, body)  # type: ignore[arg-type]
        self.meta = meta
        self.invalid = invalid

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

    def _engine(self, step):
        """On the same-host engine: the header and the metadata in one engine step (so a
        mismatch with any collective, fast path or not, is seen there), then the body over
        point-to-point messages, still in the engine's issue order."""
        g = self.group
        ctx = alg.Ctx(self.backend, self.name, self.seq, tag_base(self.seq), self.timeout)
        block = self._block()
        try:
            if len(block) <= g.slot_bytes:
                done = g.exchange(step, self._header(), np.frombuffer(block, np.uint8))
                blocks = [bytes(g.data(r, done, len(block), np.uint8)) for r in range(g.n)]
            else:
                g.exchange(step, self._header())
                blocks = bruck_all_gather(ctx, block, ctx.next_tag(),
                                          "the collective's metadata")
        except CollectiveMismatchError:
            if self.invalid is not None:
                raise self.invalid from None
            raise
        return self._finish(ctx, blocks)

    def _header(self) -> bytes:
        return encode(self.name, *self.header, seq=self.seq,
                      flags=INVALID if self.invalid is not None else 0)

    def _block(self) -> bytes:
        return _STATUS.pack(INVALID if self.invalid is not None else 0) + self.meta

    def _finish(self, ctx: alg.Ctx, blocks: list[bytes]):
        if self.invalid is not None:
            raise self.invalid
        bad = [r for r, b in enumerate(blocks) if _STATUS.unpack_from(b)[0] & INVALID]
        if bad:
            raise CollectiveMismatchError(
                f"{self.name} (seq {self.seq}): ranks {bad} passed invalid arguments (see the "
                "error on those ranks)")
        return self.body(ctx, [b[_STATUS.size:] for b in blocks])


def guard(fn: Callable[[], object]) -> tuple[object, BaseException | None]:
    """``(fn(), None)``, or ``(None, the TypeError/ValueError it raised)``: a rank's own
    argument error, to be raised after the metadata round (see :class:`MetaCall`)."""
    try:
        return fn(), None
    except (TypeError, ValueError) as exc:
        return None, exc
