"""Two ranks over point-to-point messages: the header rides with the data.

A checked call over point-to-point messages (TCP, MPI, a simulated job, a multi-node job's
cross-node stage between two nodes) first exchanges the ranks' headers (the mismatch check,
:func:`.p2p.header_exchange`), then its data. On two ranks that is two messages each way where
one would carry both, and over TCP a small message costs most of a small call's time (2
processes on this host, 4 KiB: allreduce 60 us with the check, 35 without). So a call of two
ranks, in which each rank sends the other at most one block and receives at most one
(allreduce, all_gather, reduce_scatter, and to or from a root gather, reduce and broadcast,
up to :data:`FUSE_MAX` bytes, a broadcast :data:`BROADCAST_FUSE_MAX`; ``algorithm="auto"``),
sends its block with its header after it as one message on the call's first tag, the tag the
header exchange uses (:func:`exchange`); the header exchange of two ranks is the same message
with no block, and a collective with a metadata round sends its metadata block there
(:func:`metadata`). A rank with no block to send (a broadcast's other rank, a gather's or
reduce's root) sends :data:`.gathered.PAD` bytes in its place (:func:`no_data`): a message
of the call's own form is never the header exchange's. A broadcast's root does the same, but
where its peer passed None (which cannot receive a message of a length it does not know) it
sends its header and then its data again (:func:`from_root`). The block comes first, so that
it lands aligned.

A disagreement shows on both ranks at that first message: its header differs, or its length
(a call of another size, or one that exchanges its header alone), which the transports report
as :class:`~ferro_backend.SizeMismatchError` and drop. Then both ranks exchange their headers
alone on the call's last tag (:func:`settle`) and raise
:class:`~ferro_backend.CollectiveMismatchError` naming what each called, as the header
exchange does. Every rank that meets a disagreement at its first message settles, whichever
way it met it, so neither waits for the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ferro_backend import CollectiveMismatchError, SizeMismatchError

from .arguments import finish
from .gathered import PAD, another_form, none_last, none_was_last
from .header import HEADER_SIZE, UNKNOWN
from .ops import ReduceOp, fold
from .per_backend import STEPS_PER_CALL, check_headers

if TYPE_CHECKING:  # (p2p's header exchange calls this module's for two ranks)
    from .p2p import Ctx

#: the largest block a call of two ranks sends with its header (larger ones exchange the
#: header first: 2 processes over TCP here, the one message is faster up to 1-2 MiB and slower
#: at 4 MiB, where the ring's segments overlap the copies that one message cannot)
FUSE_MAX = 1 << 20
#: a broadcast's: its one message costs two copies the tree does not make (into the message,
#: out of it), which from 1 MiB cost what the header's round trip saves (the median of 6
#: launches 319 us against 316)
BROADCAST_FUSE_MAX = 512 << 10
#: the tag offset (in a call's tags) of the headers' exchange after a disagreement
SETTLE_STEP = STEPS_PER_CALL - 1


def outbox(ctx: Ctx, nbytes: int) -> np.ndarray:
    """A message of ``nbytes`` of data (to fill: ``box[:nbytes]``) and room for the header,
    borrowed from the scratch pool for the call (:meth:`.p2p.Ctx.take`)."""
    return ctx.take(nbytes + HEADER_SIZE, np.uint8)


def no_data(ctx: Ctx) -> np.ndarray:
    """The message of a rank that sends no data in its call (a broadcast's other rank, a
    gather's or reduce's root): :data:`.gathered.PAD` zero bytes and room for the header, so
    that it differs in length from the header exchange's (a peer that runs the call in another
    form, the header exchange and its own algorithm, meets a message of another length)."""
    box = outbox(ctx, PAD)
    box[:PAD] = 0
    return box


def exchange(ctx: Ctx, header: bytes, box: np.ndarray, incoming: int, none=None
             ) -> tuple[list[bytes], np.ndarray | None]:
    """Send ``box`` (an :func:`outbox`, filled) with ``header`` after its data to the peer and
    receive the peer's message of ``incoming`` bytes of data on the call's first tag; returns
    the headers in rank order and the peer's data (a view of its message, borrowed from the
    scratch pool until the call's end). Raises :class:`~ferro_backend.CollectiveMismatchError`
    on both ranks where they disagree. ``none()`` (a broadcast's root): what to run where the
    peer's message had another length and its header, exchanged alone, says it passed None
    (the data is then None)."""
    peer = 1 - ctx.rank
    inbox = ctx.take(incoming + HEADER_SIZE, np.uint8)
    try:
        req = ctx.irecv(inbox, peer, ctx.tag_base)
    except SizeMismatchError:  # (the peer's message was there already: the peer still waits
        req = None  # for this rank's first message before it settles)
    box[box.size - HEADER_SIZE:] = np.frombuffer(header, np.uint8)
    ctx.send(box, peer, ctx.tag_base)
    try:
        if req is None:
            raise SizeMismatchError("the peer's first message")
        ctx.wait(req, peer, "the collective header")
    except SizeMismatchError:
        return settle(ctx, header, None, none), None  # (raises, unless none() ran)
    theirs = inbox[incoming:].tobytes()
    headers = [header, theirs] if ctx.rank == 0 else [theirs, header]
    if theirs != header:
        try:
            check_headers(ctx.name, ctx.rank, headers, ctx.backend, ctx.seq)
        except CollectiveMismatchError:
            settle(ctx, header, headers)
            raise
    return headers, inbox[:incoming]


def settle(ctx: Ctx, header: bytes, seen: list[bytes] | None, none=None) -> list[bytes]:
    """After a disagreement at a call's first message (``seen``: the headers it carried, None
    where its length differed): the ranks exchange their headers alone on the call's last tag;
    where the first message's length differed, raise the mismatch they name (or, where they
    agree, that the ranks ran the call in different forms), but where ``none`` is given and
    the peer's header says it passed None to a broadcast, run ``none()`` and return the
    headers."""
    theirs = _headers_alone(ctx, header)
    headers = [header, theirs] if ctx.rank == 0 else [theirs, header]
    if seen is None:
        if none is not None and theirs[5] & UNKNOWN:
            check_headers(ctx.name, ctx.rank, headers, ctx.backend, ctx.seq)
            none()
            return headers
        another_form(ctx, header, headers)
    return headers


def header_exchange(ctx: Ctx, header: bytes) -> list[bytes]:
    """The header exchange of two ranks (:func:`.p2p.header_exchange`): the same message as
    :func:`exchange`'s with no data."""
    return exchange(ctx, header, np.empty(HEADER_SIZE, np.uint8), 0)[0]


def metadata(ctx: Ctx, header: bytes, block: bytes) -> list[bytes]:
    """The header and metadata round of a collective whose sizes only some ranks know
    (:class:`.metadata_step.MetaPlan`), on two ranks: the block with the header after it, one
    message each way; every rank's block, in rank order."""
    box = outbox(ctx, len(block))
    box[:len(block)] = np.frombuffer(block, np.uint8)
    theirs = exchange(ctx, header, box, len(block))[1].tobytes()
    return [block, theirs] if ctx.rank == 0 else [theirs, block]


def allreduce(ctx: Ctx, header: bytes, x: np.ndarray, wd: np.dtype, op, out) -> np.ndarray:
    """allreduce of two ranks: each sends its array (in the work dtype ``wd``) with the header
    and folds the two in rank order (recursive doubling's bits)."""
    n = x.size
    box = outbox(ctx, n * wd.itemsize)
    mine = box[:n * wd.itemsize].view(wd)
    mine[...] = x.reshape(-1)
    _, data = exchange(ctx, header, box, n * wd.itemsize)
    theirs = data.view(wd)
    dst = out.reshape(-1) if out is not None and wd == x.dtype else np.empty(n, wd)
    fold(dst, [mine, theirs] if ctx.rank == 0 else [theirs, mine], op,
         2 if op is ReduceOp.MEAN else None)
    return finish(dst.reshape(x.shape), x.dtype, out)


def all_gather(ctx: Ctx, header: bytes, block: np.ndarray, result: np.ndarray) -> np.ndarray:
    """all_gather of two ranks: each sends its block (bytes) with the header."""
    flat = result.reshape(-1).view(np.uint8)
    size, me = block.size, ctx.rank
    box = outbox(ctx, size)
    box[:size] = block
    _, data = exchange(ctx, header, box, size)
    flat[me * size:(me + 1) * size] = block
    flat[(1 - me) * size:(2 - me) * size] = data
    return result


def reduce_scatter(ctx: Ctx, header: bytes, x: np.ndarray, wd: np.dtype, op,
                   out: np.ndarray | None, out_shape: tuple) -> np.ndarray:
    """reduce_scatter of two ranks: each sends the other's half (in ``wd``) with the header
    and folds its own half with the one it receives (the ring's order: its own first)."""
    flat = x.reshape(-1)
    half, me = flat.size // 2, ctx.rank
    nbytes = half * wd.itemsize
    box = outbox(ctx, nbytes)
    box[:nbytes].view(wd)[...] = flat[(1 - me) * half:(2 - me) * half]
    _, data = exchange(ctx, header, box, nbytes)
    mine = np.ascontiguousarray(flat[me * half:(me + 1) * half], dtype=wd)
    direct = out is not None and wd == x.dtype and not np.may_share_memory(out, x)
    dst = out.reshape(-1) if direct else np.empty(half, wd)
    fold(dst, [mine, data.view(wd)], op, 2 if op is ReduceOp.MEAN else None)
    if direct:
        return out
    if out is None:
        return dst.astype(x.dtype, copy=False).reshape(out_shape)
    np.copyto(out.reshape(-1), dst, casting="unsafe")
    return out


def broadcast(ctx: Ctx, header: bytes, buf: np.ndarray, root: int, plain) -> None:
    """broadcast of two ranks (``buf``: the result's bytes, the root's data on the root): the
    root sends its data with its header, the other rank its header after :func:`no_data`'s
    bytes. A non-root that passed None (:class:`.broadcast.FromRoot`) sends its header alone
    and cannot receive a message of a length it does not know: both drop the other's message,
    exchange their headers alone on the call's last tag, and the root, seeing the peer's,
    sends its data on the next tag (:func:`from_root`), which costs that call
    an exchange more (4 KiB over TCP 130 us against 80). So where the last broadcast on this
    group had such a non-root, both ranks know it (the root from its header), and this call
    runs ``plain()`` instead: the header exchange, then the tree (:func:`.gathered.none_last`)."""
    peer, size = 1 - ctx.rank, buf.size
    if none_was_last(ctx.backend):
        plain()
        return
    if ctx.rank != root:
        buf[...] = exchange(ctx, header, no_data(ctx), size)[1]
        return
    box = outbox(ctx, size)
    box[:size] = buf
    if exchange(ctx, header, box, PAD, lambda: ctx.send(buf, peer, ctx.tag_base + 1))[1] is None:
        none_last(ctx.backend, True)


def from_root(ctx: Ctx, header: bytes) -> bytes:
    """The header exchange of a broadcast's non-root of two ranks that passed None
    (``header``: its own, naming no shape); returns the root's header. Its data then comes on
    the call's next tag (the tree's), whether the root sent its header alone (a call over
    :data:`BROADCAST_FUSE_MAX`) or with its data: that message, of a length this rank cannot know, is
    dropped, and the root, seeing this rank's header, sends its header again alone on the
    call's last tag and its data after it (:func:`broadcast`)."""
    peer = 1 - ctx.rank
    inbox = ctx.take(HEADER_SIZE, np.uint8)
    try:
        req = ctx.irecv(inbox, peer, ctx.tag_base)
    except SizeMismatchError:
        req = None
    ctx.send(header, peer, ctx.tag_base)
    alone = False
    try:
        if req is None:
            raise SizeMismatchError("the peer's first message")
        ctx.wait(req, peer, "the collective header")
        theirs = inbox.tobytes()
    except SizeMismatchError:  # (the root's data came with its header; or another call)
        theirs, alone = _headers_alone(ctx, header), True
    headers = [header, theirs] if ctx.rank == 0 else [theirs, header]
    try:
        check_headers(ctx.name, ctx.rank, headers, ctx.backend, ctx.seq)
    except CollectiveMismatchError:
        if not alone:  # (the peer met it at the first message: it settles)
            _headers_alone(ctx, header)
        raise
    return theirs


def _headers_alone(ctx: Ctx, header: bytes) -> bytes:
    """This rank's header for the peer's on the call's last tag (:func:`settle`'s exchange)."""
    peer = 1 - ctx.rank
    theirs = bytearray(HEADER_SIZE)
    req = ctx.irecv(theirs, peer, ctx.tag_base + SETTLE_STEP)
    ctx.send(header, peer, ctx.tag_base + SETTLE_STEP)
    ctx.wait(req, peer, "the collective header, alone")
    return bytes(theirs)


def gather(ctx: Ctx, header: bytes, block: np.ndarray, result: np.ndarray | None,
           root: int) -> np.ndarray | None:
    """gather of two ranks: the other rank sends its block (bytes) with its header, the root
    its header after :func:`no_data`'s bytes."""
    size, peer = block.size, 1 - ctx.rank
    box = no_data(ctx) if result is not None else outbox(ctx, size)
    if result is None:
        box[:size] = block
    _, data = exchange(ctx, header, box, size if result is not None else PAD)
    if result is None:
        return None
    flat = result.reshape(-1).view(np.uint8)
    flat[root * size:(root + 1) * size] = block
    flat[peer * size:(peer + 1) * size] = data
    return result


def reduce(ctx: Ctx, header: bytes, x: np.ndarray, wd: np.dtype, op, out, root: int
           ) -> np.ndarray | None:
    """reduce of two ranks: the other rank sends its array (in ``wd``) with its header, the
    root its header after :func:`no_data`'s bytes and folds its own array with the one it
    receives (the tree's order: its own first)."""
    nbytes = x.size * wd.itemsize
    mine = ctx.rank == root
    box = no_data(ctx) if mine else outbox(ctx, nbytes)
    if not mine:
        box[:nbytes].view(wd)[...] = x.reshape(-1)
    _, data = exchange(ctx, header, box, nbytes if mine else PAD)
    if not mine:
        return None
    own = np.ascontiguousarray(x.reshape(-1), dtype=wd)
    direct = out is not None and wd == x.dtype and not np.may_share_memory(out, x)
    dst = out.reshape(-1) if direct else np.empty(x.size, wd)
    fold(dst, [own, data.view(wd)], op, 2 if op is ReduceOp.MEAN else None)
    return out if direct else finish(dst.reshape(x.shape), x.dtype, out)


__all__ = ["BROADCAST_FUSE_MAX", "FUSE_MAX", "SETTLE_STEP", "all_gather", "allreduce",
           "broadcast", "exchange", "from_root", "gather", "header_exchange", "metadata",
           "no_data", "outbox", "reduce", "reduce_scatter", "settle"]
