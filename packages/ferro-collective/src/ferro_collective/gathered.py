"""Three ranks or more over point-to-point messages: the header rides the header exchange's own
rounds, with the data of a small call.

The header exchange is Bruck's all-gather (``ceil(log2 n)`` rounds; in round ``k`` each rank
sends what it knows to ``me - 2^k`` and receives from ``me + 2^k``, the ranks numbered node by
node where the job's nodes do not hold consecutive ranks, :meth:`.Params.node_major`: its cost
is then the same however the job names its ranks, which the cost model relies on when it
weighs a small call gathered in those rounds against the hierarchical stages). A small
allreduce, all_gather, reduce_scatter, reduce, gather or broadcast (``algorithm="auto"``, up to
:data:`GATHER_MAX` bytes gathered on each rank, where :func:`.costmodel.gathers` rates it
faster) runs in those same rounds: each rank's unit is its data with its header after it, so
every rank ends with every rank's data and header; an allreduce (a reduce: its root) folds
them in rank order (the star's bits), a reduce_scatter its own part of them in the ring's
order (the ring's bits) (:func:`exchange`, :func:`allreduce`, :func:`all_gather`,
:func:`reduce_scatter`): ``ceil(log2 n)`` messages a rank instead of as many for the headers
and as many again or more for the data (4 processes over TCP, a 4 KiB allreduce 190-204 us
against 301-311; `benchmarks/results/0.4/2core/tcp_gathered-2026-11-30`). In a broadcast
only the root's unit holds data (the others' hold :data:`PAD` bytes and the header): its
data reaches each rank once, along the binomial tree the rounds form from the root, as the
tree broadcast sends it, with the headers in the same messages (:func:`broadcast`).

A call of another size or form sends units of another length: the transports report
:class:`~ferro_backend.SizeMismatchError` and drop the message. A rank that meets one sends a
one-byte message in each of its later rounds instead of what it knows, and still takes its
peers' messages, so every rank that would have learned a block through it meets one too (each
block reaches each rank along one path); a rank that met none holds every header and compares
them. Every rank that met a disagreement either way then exchanges its header alone on the
call's last tag (:func:`settle`) and raises :class:`~ferro_backend.CollectiveMismatchError`.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from ferro_backend import CollectiveMismatchError, SizeMismatchError

from .arguments import finish
from .header import HEADER_SIZE, UNKNOWN, describe
from .ops import ReduceOp, fold
from .per_backend import STEPS_PER_CALL, check_headers

if TYPE_CHECKING:  # (p2p's header exchange calls this module's for three ranks or more)
    from .p2p import Ctx

#: the most bytes a small call gathers on each rank in the header exchange's rounds (larger
#: ones exchange the header first and run their own algorithm)
GATHER_MAX = 256 << 10
#: the tag offset (in a call's tags) of the headers' exchange after a disagreement
SETTLE_STEP = STEPS_PER_CALL - 1
#: what a rank that met a disagreement sends in its later rounds (no unit is one byte long)
_POISON = np.zeros(1, np.uint8)
#: the bytes before the header of a unit without data (a broadcast's non-root's,
#: :func:`exchange`'s ``root``; a message of two ranks without data, :func:`.pair.no_data`):
#: it differs in length from the header exchange's, so a rank that runs the call as the
#: header exchange and its own algorithm (another form) meets messages of another length
PAD = 8
#: groups whose last broadcast over point-to-point messages had a non-root that passed None
#: (:func:`broadcast`, :func:`.pair.broadcast`)
_NONE_LAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def gathered_bytes(name: str, nbytes: int, n: int) -> int:
    """The bytes a call of ``n`` ranks and ``nbytes`` a rank gathers on each rank in the rounds
    (what :data:`GATHER_MAX` bounds): every rank's, a broadcast's the root's alone."""
    return nbytes if name == "broadcast" else n * nbytes


def exchange(ctx: Ctx, header: bytes, block: np.ndarray, settling: bool = False,
             root: int | None = None) -> tuple[list[bytes], list[np.ndarray]]:
    """Bruck's all-gather of every rank's ``block`` (bytes) with ``header`` after it, on the
    call's first tag (``settling``: the last tag, headers alone, no settling again); returns
    the headers and the blocks (views of an array borrowed from the scratch pool until the
    call's end), both in rank order. ``root``: only that rank's block travels (a broadcast's),
    every other rank's unit is :data:`PAD` bytes and its header (its block in the result:
    those bytes); where a rank's units were placed for another root or size, the messages
    may still have the lengths this rank expects, and the headers read from them are not
    what the ranks sent: where any differs, every rank exchanges its header alone
    (:func:`settle`). Raises :class:`~ferro_backend.CollectiveMismatchError` on every rank
    where they disagree."""
    n, order = ctx.n, ctx.order
    rank = range(n) if order is None else order  # (position -> rank: node by node)
    me = ctx.rank if order is None else order.index(ctx.rank)  # (this rank's position)
    size = block.size
    # the units of positions me, me + 1, ... (mod n) in that order: where each starts
    if root is None:
        sizes, starts = (size,) * n, range(0, (n + 1) * (size + HEADER_SIZE), size + HEADER_SIZE)
    else:
        at = ((order.index(root) if order is not None else root) - me) % n  # (its position)
        sizes = (PAD,) * at + (size,) + (PAD,) * (n - 1 - at)
        starts = [i * (PAD + HEADER_SIZE) + (size - PAD if i > at else 0) for i in range(n + 1)]
    known = ctx.take(starts[n], np.uint8)
    known[:sizes[0]] = block if root is None or at == 0 else 0  # (a unit without data: zeros)
    known[sizes[0]:starts[1]] = np.frombuffer(header, np.uint8)
    tag = ctx.tag_base + (SETTLE_STEP if settling else 0)
    count, distance, met = 1, 1, False
    while count < n:
        take = min(distance, n - count)
        src, dst = rank[(me + distance) % n], rank[(me - distance) % n]
        try:  # (the receiver, me - distance, knows as much as this rank: it takes the next)
            req = ctx.irecv(known[starts[count]:starts[count + take]], src, tag)
        except SizeMismatchError:
            req, met = None, True
        ctx.send(_POISON if met else known[:starts[take]], dst, tag)
        if req is not None:
            try:
                ctx.wait(req, src, "the collective header",
                         {rank[(me + count + i) % n] for i in range(n - count)})
            except SizeMismatchError:
                met = True
        count += take
        distance *= 2
    if met:
        settle(ctx, header, None)  # (raises)
    where = [0] * n  # rank r's position, counted from this rank's
    for i, r in enumerate(rank):
        where[r] = (i - me) % n
    headers = [known[starts[i + 1] - HEADER_SIZE:starts[i + 1]].tobytes() for i in where]
    if any(h != header for h in headers):
        if root is not None:  # (units placed by another root or size: the headers alone)
            settle(ctx, header, None)  # (raises)
        try:
            check_headers(ctx.name, ctx.rank, headers, ctx.backend, ctx.seq)
        except CollectiveMismatchError:
            if not settling:
                settle(ctx, header, headers)
            raise
    return headers, [known[starts[i]:starts[i] + sizes[i]] for i in where]


class FromRootMet(Exception):
    """Messages of another length where the headers agree and a broadcast's non-root passed
    None (it sends its header alone: it cannot know the root's length): every rank raises this
    with the headers, and the broadcast goes on as its own algorithm (:func:`broadcast`)."""

    def __init__(self, headers: list[bytes]) -> None:
        super().__init__("a broadcast's non-root passed None")
        self.headers = headers


def settle(ctx: Ctx, header: bytes, seen: list[bytes] | None) -> None:
    """After a disagreement (``seen``: the headers this rank holds, None where it met a message
    of another length): every rank exchanges its header alone on the call's last tag; where
    this rank did not hold them all, raise the mismatch they name, :class:`FromRootMet` where
    they agree and a broadcast's non-root passed None, or else that the ranks ran the call in
    different forms."""
    headers, _ = exchange(ctx, header, np.empty(0, np.uint8), settling=True)
    if seen is None:
        check_headers(ctx.name, ctx.rank, headers, ctx.backend, ctx.seq)  # (raises if differ)
        if any(h[5] & UNKNOWN for h in headers):
            raise FromRootMet(headers)
        another_form(ctx, header, headers)


def another_form(ctx: Ctx, header: bytes, headers: list[bytes]) -> NoReturn:
    """After messages of another length (here and in :mod:`.pair`): raise the mismatch
    ``headers`` (every rank's, exchanged alone) name, or, where they agree, that some rank ran
    the call in another form."""
    check_headers(ctx.name, ctx.rank, headers, ctx.backend, ctx.seq)  # (raises where they differ)
    raise CollectiveMismatchError(
        f"{ctx.name}: every rank called {describe(header)}, but their messages differ in "
        "length: some ran it in another form (an algorithm= the others did not ask for, or "
        "the mismatch check set differently)")


def header_exchange(ctx: Ctx, header: bytes) -> list[bytes]:
    """The header exchange of three ranks or more (:func:`.p2p.header_exchange`)."""
    return exchange(ctx, header, np.empty(0, np.uint8))[0]


def allreduce(ctx: Ctx, header: bytes, x: np.ndarray, wd: np.dtype, op, out,
              root: int | None = None) -> np.ndarray | None:
    """A small allreduce: every rank's array (in the work dtype ``wd``) gathered with the
    headers, folded in rank order (the star's bits, MEAN's divide in the last step); a small
    reduce (``root``): the same, folded on the root alone (None elsewhere)."""
    n = ctx.n
    mine = ctx.take(x.size, wd)
    mine[...] = x.reshape(-1)
    _, blocks = exchange(ctx, header, mine.view(np.uint8))
    if root is not None and ctx.rank != root:
        return None
    dst = out.reshape(-1) if out is not None and wd == x.dtype else np.empty(x.size, wd)
    fold(dst, [blocks[r].view(wd) for r in range(n)], op,
         n if op is ReduceOp.MEAN else None)
    return finish(dst.reshape(x.shape), x.dtype, out)


def all_gather(ctx: Ctx, header: bytes, block: np.ndarray, result: np.ndarray | None
               ) -> np.ndarray | None:
    """A small all_gather: every rank's block (bytes) gathered with the headers; a small gather
    (``result`` None on the ranks that are not its root) the same."""
    _, blocks = exchange(ctx, header, block)
    if result is None:
        return None
    rows = result.reshape(-1).view(np.uint8).reshape(ctx.n, block.size)
    for r, data in enumerate(blocks):
        rows[r] = data
    return result


def none_last(backend, passed_none: bool) -> None:
    """After a broadcast over point-to-point messages: whether a non-root passed None (every
    rank learns it from the headers), which every rank records alike."""
    if passed_none:
        _NONE_LAST[backend] = True
    else:
        _NONE_LAST.pop(backend, None)


def none_was_last(backend) -> bool:
    """Whether the last broadcast on ``backend``'s group had a non-root that passed None."""
    return _NONE_LAST.get(backend, False)


def broadcast(ctx: Ctx, header: bytes, x: np.ndarray, buf: np.ndarray, root: int, plain,
              own) -> None:
    """A small broadcast into ``buf`` (the result's bytes; ``x``: this rank's array's bytes,
    the root's data on the root): the root's array gathered with every rank's header (the
    others' units carry no data: :func:`exchange`'s ``root``). Where the last broadcast on this
    group had a non-root that passed None (every rank learned it from the headers),
    ``plain()`` instead: the header exchange, then the call's own algorithm. A non-root that
    passes None now (:class:`.broadcast.FromRoot`) sends its header alone: every rank meets
    :class:`FromRootMet` and ``own()`` (the call's own algorithm, the tree or the star, as that
    non-root runs it) delivers the root's data."""
    if none_was_last(ctx.backend):
        plain()
        return
    try:
        _, blocks = exchange(ctx, header, x, root=root)
    except FromRootMet:
        own()
        none_last(ctx.backend, True)
        return
    if ctx.rank != root:
        buf[...] = blocks[root]
    none_last(ctx.backend, False)


def reduce_scatter(ctx: Ctx, header: bytes, x: np.ndarray, wd: np.dtype, op,
                   out: np.ndarray | None, out_shape: tuple) -> np.ndarray:
    """A small reduce_scatter: every rank's whole input (in the work dtype ``wd``) gathered
    with the headers; each rank folds its own part in the ring's order (the parts of ranks
    ``me + 1``, ``me + 2``, ..., ``me``: the ring's bits, MEAN's divide in the last step)."""
    n, me = ctx.n, ctx.rank
    flat = x.reshape(-1)
    mine = ctx.take(flat.size, wd)
    mine[...] = flat
    _, blocks = exchange(ctx, header, mine.view(np.uint8))
    part = flat.size // n
    a, b = me * part * wd.itemsize, (me + 1) * part * wd.itemsize
    direct = out is not None and wd == x.dtype and not np.may_share_memory(out, x)
    dst = out.reshape(-1) if direct else np.empty(part, wd)
    fold(dst, [blocks[(me + 1 + i) % n][a:b].view(wd) for i in range(n)], op,
         n if op is ReduceOp.MEAN else None)
    return finish(dst.reshape(out_shape), x.dtype, out)


__all__ = ["GATHER_MAX", "PAD", "SETTLE_STEP", "FromRootMet", "all_gather", "allreduce",
           "another_form", "broadcast", "exchange", "gathered_bytes", "header_exchange",
           "none_last", "none_was_last", "reduce_scatter", "settle"]
