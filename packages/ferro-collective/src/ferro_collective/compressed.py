"""The compressed collectives (the public calls' ``wire=``; :mod:`.wire` has the formats):
allreduce, reduce_scatter and all_gather, now or in the background (a multi-node job's:
:mod:`.compressed_nodes`).

Each is a few exact collectives on encoded bytes with local steps between them (encode, decode
and fold in rank order), which a :class:`~.compressed_steps.Steps` lists: the first
collective's bytes are encoded when the call is made; each later one's are made by the step
after the collective before it. The blocking form runs the collectives as they come; the
``*_async`` form checks and numbers every one of them when it is issued (so the call keeps its
place in the backend's order of calls however long it waits for a worker) and runs them on a
worker thread. If one fails, the ones after it still run, on zeros (every rank takes part in
each, as its peers expect), and the first error is raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ferro_backend import Backend, DistributedError
from ferro_backend import timeline as _timeline
from ferro_backend.checks import check_timeout

from . import _wire as _kernel
from .arguments import check_out_like
from .compressed_agreement import PREFIX, Numbers, WholeCheck, identity
from .compressed_nodes import node_calls, node_pieces, reduce_scatter_nodes, refuse
from .compressed_steps import (
    Joined,
    Steps,
    chunk,
    decode_rows,
    deliver,
    encode_chunks,
    encoded_size,
    flat_allreduce,
    fold_rows,
)
from .executors import ARGUMENT_ERRORS, Refusal, in_call
from .ops import ReduceOp
from .per_backend import WORKER_PREFIX, state
from .records import ALL_GATHER, ALL_TO_ALL_SINGLE
from .wire import (
    Feedback,
    check_feedback,
    check_floats,
    check_wire,
    decode_into,
    encode,
    encode_into,
    encoded_bytes,
)
from .work import Work

#: a bf16/fp16 allreduce of at least twice this many encoded bytes is cut in pieces of at least
#: this many (at most MAX_PIECES), run at once on the async workers: one piece's encode, fold
#: and decode, and its second collective, overlap the others' bytes on the link (elementwise
#: formats only: the bits are the same as in one piece)
PIECE_BYTES = 1 << 20
MAX_PIECES = 4
_ELEMENTWISE = ("bf16", "fp16")
#: the sequence numbers every compressed call on one group takes, whatever its size, wire and
#: kind (:class:`~.compressed_agreement.Numbers`): a call in pieces takes one for the check of the
#: whole call and two a piece
BLOCK = 1 + 2 * MAX_PIECES


def checked(name: str, backend: Backend, wire, timeout, check: Callable[[], Any]) -> Any:
    """``check()``, a compressed call's own argument checks (its value returned). Where one
    fails (TypeError, ValueError), this rank refuses the call: its first number carries the
    refusal (on a multi-node job: its first collectives, :func:`.compressed_nodes.refuse`),
    so the peers' first collective of the call raises
    :class:`~ferro_backend.CollectiveMismatchError` naming this rank and the reason, and the
    call's other numbers are given back, as the peers give back theirs. (A multi-node
    all_gather or int8/int4 reduce_scatter refused on one rank leaves its peers to their
    deadline.)"""
    # closed or aborted: the call's name, with its wire (as where it is met inside the call)
    failure = backend.peer_failure(f"{name}[{wire}]" if isinstance(wire, str) else name,
                                   backend.rank)
    if failure is not None:
        raise failure
    try:
        if timeout is not None:  # (in the call's name: its collectives would name theirs)
            check_timeout(timeout, f"{name}: timeout")
        return check()
    except ARGUMENT_ERRORS as exc:
        if timeout is not None and not _valid_timeout(timeout):
            timeout = None  # (the refusal waits for the backend's deadline)
        h = getattr(backend, "hierarchy", None)
        if h is not None and h.num_nodes > 1:
            if (name == "allreduce" or wire not in ("int8", "int4")) and name != "all_gather" \
                    and backend.peer_failure(name, backend.rank) is None:
                numbers = _numbers(backend, staged=True)
                try:
                    refuse(name, backend, h, wire, timeout, exc, numbers)
                finally:
                    numbers.rest()
            raise
        refused = Refusal.of(name, backend, timeout, exc)
        if refused is not None:
            numbers = _numbers(backend)
            refused.span = numbers.span(backend)
            refused.start()
            numbers.took(backend)
            numbers.rest()
        raise


def _valid_timeout(timeout) -> bool:
    try:
        check_timeout(timeout)
    except ValueError:
        return False
    return True


def _check_out(name: str, out, shape: tuple, dtype) -> None:
    """``out=`` (where given) an ndarray of the result's ``shape`` and ``dtype``, writable
    (else TypeError, SizeMismatchError, ValueError naming it): checked with the call's other
    arguments, so that a bad one on one rank refuses the call on every rank. (It need not be
    C-contiguous: the result is written into it with ``out[...] = result``.)"""
    if out is None:
        return
    check_out_like(name, out, shape, dtype)
    if not out.flags.writeable:
        raise ValueError(f"{name}: out must be writable")


def checked_wire(wire: str, algorithm: str | None, name: str) -> str:
    """``wire`` when it is a wire format and no ``algorithm`` is forced with it (else
    ValueError naming the call)."""
    if algorithm is not None:
        raise ValueError(f"{name}: algorithm={algorithm!r} and wire={wire!r} together; a "
                         "compressed call has its own algorithm (ferro_collective.wire)")
    return check_wire(wire, name)


def _numbers(backend: Backend, staged: bool = False) -> Numbers:
    """A compressed call's numbers: :data:`BLOCK` on ``backend``; on a multi-node job also
    two a piece on its node group (and one for the node's agreement on the call's decider)
    and on its cross-node group (the node and cross-node stages). A multi-node call that runs
    as node and cross-node stages (``staged``) takes one on ``backend``, as an exact
    hierarchical call does (:mod:`.stage_check`): where ranks disagree on which they make,
    the numbers on every group still match."""
    h = getattr(backend, "hierarchy", None)
    if h is None or h.num_nodes <= 1:
        return Numbers({backend: BLOCK})
    return Numbers({backend: 1 if staged else BLOCK, h.node: 2 * MAX_PIECES + 1,
                    h.cross: 2 * MAX_PIECES})


def allreduce(tensor, backend: Backend, op: ReduceOp, wire: str, timeout, out,
              background: bool = False, algorithm: str | None = None,
              feedback: Feedback | None = None):
    """:func:`~ferro_collective.allreduce` with ``wire``; ``background``: a :class:`Work`
    (``allreduce_async``). On a multi-node job the node stages are exact, the cross-node
    stage compressed. A large bf16/fp16 call runs in pieces at once (:data:`PIECE_BYTES`),
    unless it feeds back its error (``feedback``: :class:`~.wire.Feedback`)."""
    name = "allreduce_async" if background else "allreduce"
    x = np.asarray(tensor)

    def check():
        check_floats(x, op, "allreduce")
        check_feedback(feedback, op, name)
        _check_out("allreduce", out, x.shape, x.dtype)
        return checked_wire(wire, algorithm, name)

    wire = checked("allreduce", backend, wire, timeout, check)
    pieces = _pieces(x.size, wire)
    if len(pieces) > 1 and feedback is None:
        return _in_pieces(x, pieces, backend, op, wire, timeout, out, background)
    return _allreduce(x, tensor, backend, op, wire, timeout, out, background,
                      feedback=feedback)


def _pieces(count: int, wire: str) -> list[tuple[int, int]]:
    """Where a compressed allreduce of ``count`` values is cut: at most :data:`MAX_PIECES`
    pieces of at least :data:`PIECE_BYTES` encoded each; one piece for int8/int4 (their blocks
    would move) and for small calls. (The same on every rank: it depends on nothing else.)"""
    k = min(MAX_PIECES, encoded_bytes(count, wire) // PIECE_BYTES)
    if wire not in _ELEMENTWISE or k < 2:
        return [(0, count)]
    step = -(-count // k)
    return [(lo, min(lo + step, count)) for lo in range(0, count, step)]


def _in_pieces(x: np.ndarray, pieces: list[tuple[int, int]], backend: Backend, op: ReduceOp,
               wire: str, timeout, out, background: bool):
    """The allreduce of ``x`` as one compressed allreduce a piece, issued now (numbered in
    order) and run on the workers at once, each writing its values into its slice of the
    result; one :class:`Work` (``background``) or the result. The timeline gets one event
    (``error=<type>`` if the call failed)."""
    if not _timeline.active():
        return _pieces_call(x, pieces, backend, op, wire, timeout, out, background)
    entry = _timeline._begin(
        f"allreduce[{wire}]", "collective.async" if background else "collective",
        {"bytes": int(x.nbytes), "dtype": str(x.dtype), "wire": wire,
         "wire_bytes": _pieces_encoded(pieces, backend, wire), "rank": backend.rank,
         "world": backend.world_size, "pieces": len(pieces)})
    try:
        result = _pieces_call(x, pieces, backend, op, wire, timeout, out, background)
    except BaseException as exc:
        _timeline._end(entry, exc)
        raise
    if background:
        result.future.add_done_callback(lambda done: _timeline._end(entry, done.exception()))
    else:
        _timeline._end(entry)
    return result


def _pieces_call(x: np.ndarray, pieces: list[tuple[int, int]], backend: Backend, op: ReduceOp,
                 wire: str, timeout, out, background: bool):
    """:func:`_in_pieces` untimed; its errors (met where it numbers its collectives too) name
    the user's call (:func:`.executors.in_call`)."""
    try:
        return _pieces_run(x, pieces, backend, op, wire, timeout, out, background)
    except DistributedError as exc:
        raise in_call(exc, f"allreduce[{wire}]")  # noqa: B904 (the same error, renamed)


def _pieces_run(x: np.ndarray, pieces: list[tuple[int, int]], backend: Backend, op: ReduceOp,
                wire: str, timeout, out, background: bool):
    flat = x.reshape(-1)
    fits = (isinstance(out, np.ndarray) and out.shape == x.shape and out.dtype == x.dtype
            and out.flags.c_contiguous and out.flags.writeable)
    into = out.reshape(-1) if fits else np.empty(x.size, x.dtype)
    # (a blocking call made on a worker runs its pieces one after another: waiting there for
    # the others could wait for itself)
    at_once = background or not threading.current_thread().name.startswith(WORKER_PREFIX)

    def finish():
        if fits:
            return out
        result = into.reshape(x.shape)
        if out is None:
            return result
        check_out_like("allreduce", out, x.shape, x.dtype)
        out[...] = result
        return out

    h = getattr(backend, "hierarchy", None)
    if h is not None and h.num_nodes > 1:
        joined = Joined(1, finish)
        numbers = _numbers(backend, staged=True)
        try:
            seq, jobs = node_pieces(flat, pieces, h, backend, op, wire, timeout, into,
                                    joined.fail, numbers, identity("allreduce", x, op, wire))
            if not at_once:
                for job in jobs:
                    job()
                return finish()
            futures = [state(backend).submit(job) for job in jobs]
        finally:
            numbers.rest()
        futures[-1].add_done_callback(joined.one_done)
    else:
        joined = Joined(len(pieces), finish)
        numbers = _numbers(backend)
        try:
            check = WholeCheck("allreduce", x, op, wire, backend, timeout, numbers)
            seq = check.seq
            if not at_once:
                check.run()
                for lo, hi in pieces:
                    _allreduce(flat[lo:hi], flat[lo:hi], backend, op, wire, timeout,
                               into[lo:hi], False, on_error=joined.fail, numbers=numbers)
                return finish()
            state(backend).submit(check.job(joined.fail))  # the pieces wait for it
            works = [_allreduce(flat[lo:hi], flat[lo:hi], backend, op, wire, timeout,
                                into[lo:hi], True, on_error=joined.fail, numbers=numbers,
                                after=check.done)
                     for lo, hi in pieces]
        finally:
            numbers.rest()
        for w in works:
            w.future.add_done_callback(joined.one_done)
    work = Work("allreduce", seq, joined.future)
    return work if background else work.wait()


def _pieces_encoded(pieces: list[tuple[int, int]], backend: Backend, wire: str) -> int:
    """The bytes a call in ``pieces`` encodes this rank's values into (a multi-node call's:
    its slice of each piece, across the nodes)."""
    h = getattr(backend, "hierarchy", None)
    if h is not None and h.num_nodes > 1:
        return sum(encoded_size(-(-max(1, hi - lo) // h.local_world), h.num_nodes, wire)
                   for lo, hi in pieces)
    return sum(encoded_size(hi - lo, backend.world_size, wire) for lo, hi in pieces)


def _allreduce(x: np.ndarray, tensor, backend: Backend, op: ReduceOp, wire: str, timeout, out,
               background: bool, on_error: Callable[[BaseException], None] | None = None,
               numbers: Numbers | None = None, after: threading.Event | None = None,
               feedback: Feedback | None = None):
    """One compressed allreduce of ``x`` (flat, or the node stages exact and the cross-node
    stage compressed); ``on_error``: it is a piece of a call (no event of its own; told of
    its first error at once), whose ``numbers`` it takes and whose check (``after``) its
    collectives wait for in the background; ``feedback``: its compressed stage's error
    feedback."""
    h = getattr(backend, "hierarchy", None)
    if h is not None and h.num_nodes > 1:
        numbers = _numbers(backend, staged=True)
        try:
            s = Steps("allreduce", wire, tensor, backend, timeout, on_error, numbers)
            node_calls(s, x, h, op, out, identity("allreduce", x, op, wire), feedback)
            return s.run(background)
        finally:
            numbers.rest()
    own = numbers is None
    if own:
        numbers = _numbers(backend)
    s = Steps("allreduce", wire, tensor, backend, timeout, on_error, numbers, after)
    flat = np.ascontiguousarray(x.reshape(-1), dtype=np.float32)

    def done(fill):
        s.result = deliver(fill, x, x.shape, out, "allreduce")

    who = identity("allreduce", x, op, wire) if own else None  # (a piece's: the call's check)
    flat_allreduce(s, flat, backend, op, done, who, feedback=feedback)()
    try:
        return s.run(background)
    finally:
        if own:
            numbers.rest()


def reduce_scatter(tensor, backend: Backend, op: ReduceOp, wire: str, timeout, out,
                   background: bool = False, algorithm: str | None = None):
    """:func:`~ferro_collective.reduce_scatter` with ``wire``: the allreduce's first half (its
    chunks are the input's dim-0 slices)."""
    name = "reduce_scatter_async" if background else "reduce_scatter"
    x = np.asarray(tensor)
    n = backend.world_size

    def check():
        check_floats(x, op, "reduce_scatter")
        if x.ndim == 0 or x.shape[0] % n:
            from ferro_backend.errors import SizeMismatchError

            raise SizeMismatchError(f"reduce_scatter: dim 0 of shape {x.shape} is not "
                                    f"divisible by the world size {n}")
        _check_out("reduce_scatter", out, (x.shape[0] // n, *x.shape[1:]), x.dtype)
        return checked_wire(wire, algorithm, name)

    wire = checked("reduce_scatter", backend, wire, timeout, check)
    shape = (x.shape[0] // n, *x.shape[1:])
    per = int(np.prod(shape))
    h = getattr(backend, "hierarchy", None)
    if wire in _ELEMENTWISE and h is not None and h.num_nodes > 1:
        numbers = _numbers(backend, staged=True)
        try:
            s = reduce_scatter_nodes(x, tensor, h, backend, op, wire, timeout, out, shape,
                                     numbers, identity("reduce_scatter", x, op, wire))
            return s.run(background)
        finally:
            numbers.rest()
    c = chunk(per, 1, wire)
    numbers = _numbers(backend)
    s = Steps("reduce_scatter", wire, tensor, backend, timeout, numbers=numbers)
    width = encoded_bytes(c, wire)
    s.encoded = n * width
    who = identity("reduce_scatter", x, op, wire)
    p = s.carry(who, backend, lambda w: PREFIX + encoded_bytes(chunk(per, 1, w), w))
    sent, rows, acc = s.take(n, p + width), s.take(n, p + width), s.take(c, dtype=np.float32)
    sent[:, :p] = who
    encode_chunks(np.ascontiguousarray(x.reshape(-1), dtype=np.float32), per, c, wire,
                  sent[:, p:])

    def folded(got):
        fold_rows(got.reshape(n, p + width)[:, p:], wire, op, acc)

        def fill(dest):
            dest[...] = acc[:per]

        s.result = deliver(fill, x, shape, out, "reduce_scatter")

    s.then(ALL_TO_ALL_SINGLE, sent, backend, (None, None), rows, folded)
    try:
        return s.run(background)
    finally:
        numbers.rest()


def all_gather(tensor, backend: Backend, wire: str, timeout, out, background: bool = False,
               algorithm: str | None = None):
    """:func:`~ferro_collective.all_gather` with ``wire``: each rank's block encoded, gathered,
    decoded."""
    name = "all_gather_async" if background else "all_gather"
    x = np.asarray(tensor)

    n = backend.world_size
    shape = (n,) if x.ndim == 0 else (n * x.shape[0], *x.shape[1:])

    def check():
        check_floats(x, None, "all_gather")
        _check_out("all_gather", out, shape, x.dtype)
        return checked_wire(wire, algorithm, name)

    wire = checked("all_gather", backend, wire, timeout, check)
    numbers = _numbers(backend)
    s = Steps("all_gather", wire, tensor, backend, timeout, numbers=numbers)
    width = s.encoded = encoded_bytes(x.size, wire)
    who = identity("all_gather", x, None, wire)
    p = s.carry(who, backend, lambda w: PREFIX + encoded_bytes(x.size, w))
    mine, gathered = s.take(p + width), s.take(n * (p + width))
    mine[:p] = who
    encode_into(np.ascontiguousarray(x.reshape(-1), dtype=np.float32), wire, mine[p:])

    def decoded(got):
        s.result = deliver(lambda dest: decode_rows(got.reshape(n, p + width)[:, p:], x.size,
                                                      wire, dest), x, shape, out, "all_gather")

    s.then(ALL_GATHER, mine, backend, None, gathered, decoded)
    try:
        return s.run(background)
    finally:
        numbers.rest()


def sent_values(x: np.ndarray, n: int, wire: str, name: str) -> np.ndarray:
    """What the peers decode of this rank's ``x`` in a compressed ``name`` ("reduce_scatter":
    ``x``'s ``n`` dim-0 blocks; "allreduce": ``n`` chunks of the flat values) over ``n`` ranks,
    as float32 of ``x``'s shape: ``x`` less what its encoding rounds away, for error feedback
    (``x - sent_values(x, ...)`` is the error; the allreduce's second encoding, of the folded
    chunk, and a multi-node job's cross-node stage are fed back by the call itself: its
    ``feedback=``, :class:`~.wire.Feedback`).

    Parameters
    ----------
    x : numpy.ndarray
        Float values (for "reduce_scatter", a dim 0 divisible by ``n``).
    n : int
        The world size of the call.
    wire : {"bf16", "fp16", "int8", "int4"}
    name : {"reduce_scatter", "allreduce"}

    Returns
    -------
    numpy.ndarray
        float32, ``x``'s shape.
    """
    flat = np.ascontiguousarray(np.asarray(x).reshape(-1), dtype=np.float32)
    if name == "reduce_scatter":
        rows = flat.reshape(n, -1)
        out = np.empty_like(rows)
        for r in range(n):
            decode_into(encode(rows[r], wire), wire, out[r], _kernel.COPY)
        return out.reshape(np.shape(x))
    if name != "allreduce":
        raise ValueError(f"sent_values: name {name!r}, expected 'reduce_scatter' or 'allreduce'")
    c = chunk(flat.size, n, wire)
    sent = np.empty((n, encoded_bytes(c, wire)), np.uint8)
    encode_chunks(flat, c, c, wire, sent)
    out = np.empty(flat.size, np.float32)
    decode_rows(sent, c, wire, out)
    return out.reshape(np.shape(x))
