"""The compressed collectives (the public calls' ``wire=``; :mod:`.wire` has the formats):
allreduce, reduce_scatter and all_gather, now or in the background.

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

from ferro_backend import Backend
from ferro_backend import timeline as _timeline

from . import _wire as _kernel
from .compressed_steps import Joined, Numbers, Steps, chunk, decode_rows, deliver, encode_chunks, fold_rows
from .executors import ARGUMENT_ERRORS, Refusal, prepared
from .header import HEADER_SIZE, check_all
from .header import encode as encode_header
from .ops import ReduceOp
from .per_backend import WORKER_PREFIX, state
from .records import ALL_GATHER, ALL_TO_ALL_SINGLE, REDUCE_SCATTER
from .wire import check_floats, check_wire, decode_into, encode, encode_into, encoded_bytes
from .work import Work

#: a bf16/fp16 allreduce of at least twice this many encoded bytes is cut in pieces of at least
#: this many (at most MAX_PIECES), run at once on the async workers: one piece's encode, fold
#: and decode, and its second collective, overlap the others' bytes on the link (elementwise
#: formats only: the bits are the same as in one piece)
PIECE_BYTES = 1 << 20
MAX_PIECES = 4
_ELEMENTWISE = ("bf16", "fp16")
#: the sequence numbers every compressed call on one group takes, whatever its size, wire and
#: kind (:class:`~.compressed_steps.Numbers`): a call in pieces takes one for the check of the
#: whole call and two a piece
BLOCK = 1 + 2 * MAX_PIECES


def checked(name: str, backend: Backend, timeout, check: Callable[[], Any]) -> Any:
    """``check()``, a compressed call's own argument checks (its value returned). Where one
    fails (TypeError, ValueError), this rank refuses the call: its first number carries the
    refusal, so the peers' first collective of the call raises
    :class:`~ferro_backend.CollectiveMismatchError` naming this rank and the reason, and the
    call's other numbers are given back, as the peers give back theirs."""
    try:
        return check()
    except ARGUMENT_ERRORS as exc:
        refused = Refusal.of(name, backend, timeout, exc)
        if refused is not None:
            numbers = Numbers(backend, BLOCK)
            refused.start()
            numbers.took()
            numbers.rest()
        raise


def checked_wire(wire: str, algorithm: str | None, name: str) -> str:
    """``wire`` when it is a wire format and no ``algorithm`` is forced with it (else
    ValueError naming the call)."""
    if algorithm is not None:
        raise ValueError(f"{name}: algorithm={algorithm!r} and wire={wire!r} together; a "
                         "compressed call has its own algorithm (ferro_collective.wire)")
    return check_wire(wire, name)


# ---------------------------------------------------------------------------- the calls
def _flat_allreduce(s: Steps, flat: np.ndarray, group: Backend, op: ReduceOp,
                    done: Callable[[Callable[[np.ndarray], None]], None]) -> Callable[[], None]:
    """Add the compressed allreduce of float32 ``flat`` over ``group`` to ``s``: an
    all-to-all of the encoded chunks, each rank's chunk folded and encoded, an all-gather,
    then ``done(fill)`` (``fill(dest)`` decodes the result into ``flat.size`` float32 values).
    Returns what encodes ``flat`` into the first one's bytes (call it once ``flat`` holds the
    values)."""
    n, wire = group.world_size, s.wire
    c = chunk(flat.size, n, wire)
    width = encoded_bytes(c, wire)
    sent, rows, mine = s.take(n, width), s.take(n, width), s.take(width)
    acc, gathered = s.take(c, dtype=np.float32), s.take(n * width)

    def folded(got):
        encode_into(fold_rows(got.reshape(n, width), wire, op, acc), wire, mine)

    def ended(got):
        done(lambda dest: decode_rows(got.reshape(n, width), c, wire, dest))

    s.then(ALL_TO_ALL_SINGLE, sent, group, (None, None), rows, folded)
    s.then(ALL_GATHER, mine, group, None, gathered, ended)
    return lambda: encode_chunks(flat, c, c, wire, sent)


def allreduce(tensor, backend: Backend, op: ReduceOp, wire: str, timeout, out,
              background: bool = False, algorithm: str | None = None):
    """:func:`~ferro_collective.allreduce` with ``wire``; ``background``: a :class:`Work`
    (``allreduce_async``). On a multi-node job the node stages are exact, the cross-node
    stage compressed. A large bf16/fp16 call runs in pieces at once (:data:`PIECE_BYTES`)."""
    name = "allreduce_async" if background else "allreduce"
    x = np.asarray(tensor)

    def check():
        check_floats(x, op, "allreduce")
        return checked_wire(wire, algorithm, name)

    wire = checked("allreduce", backend, timeout, check)
    pieces = _pieces(x.size, wire)
    if len(pieces) > 1:
        return _in_pieces(x, pieces, backend, op, wire, timeout, out, background)
    return _allreduce(x, tensor, backend, op, wire, timeout, out, background)


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
    result; one :class:`Work` (``background``) or the result. The timeline gets one event."""
    flat = x.reshape(-1)
    fits = (isinstance(out, np.ndarray) and out.shape == x.shape and out.dtype == x.dtype
            and out.flags.c_contiguous and out.flags.writeable)
    into = out.reshape(-1) if fits else np.empty(x.size, x.dtype)
    t0 = _timeline._now_us() if _timeline.active() else None
    # (a blocking call made on a worker runs its pieces one after another: waiting there for
    # the others could wait for itself)
    at_once = background or not threading.current_thread().name.startswith(WORKER_PREFIX)

    def finish():
        if t0 is not None:
            _timeline.record(f"allreduce[{wire}]", "collective", t0, _timeline._now_us() - t0,
                             bytes=int(x.nbytes), dtype=str(x.dtype), wire=wire,
                             wire_bytes=sum(encoded_bytes(hi - lo, wire) for lo, hi in pieces),
                             rank=backend.rank, world=backend.world_size, pieces=len(pieces))
        if fits:
            return out
        result = into.reshape(x.shape)
        if out is None:
            return result
        if not isinstance(out, np.ndarray) or out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(f"allreduce: out= must be an array of shape {x.shape} and dtype "
                             f"{x.dtype}")
        out[...] = result
        return out

    h = getattr(backend, "hierarchy", None)
    if h is not None and h.num_nodes > 1:
        joined = Joined(1, finish)
        seq, jobs = _node_pieces(flat, pieces, h, backend, op, wire, timeout, into,
                                 joined.fail)
        if not at_once:
            for job in jobs:
                job()
            return finish()
        futures = [state(backend).submit(job) for job in jobs]
        futures[-1].add_done_callback(joined.one_done)
    else:
        joined = Joined(len(pieces), finish)
        numbers = Numbers(backend, BLOCK)
        try:
            seq, check = _check_whole(x, op, wire, backend, timeout, numbers)
            if not at_once:
                check()
                for lo, hi in pieces:
                    _allreduce(flat[lo:hi], flat[lo:hi], backend, op, wire, timeout,
                               into[lo:hi], False, on_error=joined.fail, numbers=numbers)
                return finish()
            checked = threading.Event()  # the pieces' collectives wait for the check

            def check_job():
                try:
                    check()
                except BaseException as exc:
                    joined.fail(exc)
                finally:
                    checked.set()

            state(backend).submit(check_job)
            works = [_allreduce(flat[lo:hi], flat[lo:hi], backend, op, wire, timeout,
                                into[lo:hi], True, on_error=joined.fail, numbers=numbers,
                                after=checked)
                     for lo, hi in pieces]
        finally:
            numbers.rest()
        for w in works:
            w.future.add_done_callback(joined.one_done)
    work = Work("allreduce", seq, joined.future)
    return work if background else work.wait()


def _allreduce(x: np.ndarray, tensor, backend: Backend, op: ReduceOp, wire: str, timeout, out,
               background: bool, on_error: Callable[[BaseException], None] | None = None,
               numbers: Numbers | None = None, after: threading.Event | None = None):
    """One compressed allreduce of ``x`` (flat, or the node stages exact and the cross-node
    stage compressed); ``on_error``: it is a piece of a call (no event of its own; told of
    its first error at once), whose ``numbers`` it takes and whose check (``after``) its
    collectives wait for in the background."""
    h = getattr(backend, "hierarchy", None)
    if h is not None and h.num_nodes > 1:
        s = Steps("allreduce", wire, tensor, backend, timeout, on_error)
        _node_calls(s, x, h, op, out)
        return s.run(background)
    own = numbers is None
    if own:
        numbers = Numbers(backend, BLOCK)
    s = Steps("allreduce", wire, tensor, backend, timeout, on_error, numbers, after)
    flat = np.ascontiguousarray(x.reshape(-1), dtype=np.float32)

    def done(fill):
        s.result = deliver(fill, x, x.shape, out, "allreduce")

    _flat_allreduce(s, flat, backend, op, done)()
    try:
        return s.run(background)
    finally:
        if own:
            numbers.rest()


def _check_whole(x: np.ndarray, op: ReduceOp, wire: str, backend: Backend, timeout,
                 numbers: Numbers) -> tuple[int, Callable[[], None]]:
    """The check of a call in pieces, numbered now (its first number): an all_gather of the
    whole call's header, compared on every rank (ranks whose sizes differ may cut pieces of
    the same size, whose own headers agree). Returns its number and what runs it, which
    raises :class:`~ferro_backend.CollectiveMismatchError` on every rank where they differ."""
    n = backend.world_size
    mine, gathered = np.empty(HEADER_SIZE, np.uint8), np.empty(n * HEADER_SIZE, np.uint8)
    seq, go = prepared(ALL_GATHER, mine, backend, None, timeout, gathered)
    numbers.took()
    mine[:] = np.frombuffer(encode_header("allreduce", x.dtype, x.shape, op, seq=seq),
                            np.uint8)

    def run():
        try:
            got = np.asarray(go()).reshape(n, HEADER_SIZE)
            check_all(f"allreduce[{wire}]", backend.rank, [row.tobytes() for row in got])
        except BaseException as exc:
            numbers.ran_first(exc)
            raise
        numbers.ran_first(None)

    return seq, run


def _node_calls(s: Steps, x: np.ndarray, h, op: ReduceOp, out) -> None:
    """Add the multi-node allreduce of ``x`` to ``s``: the node's exact reduce_scatter (call
    0), the compressed allreduce across the nodes of this local rank's slice (calls 1, 2), the
    node's all_gather (call 3); then ``s.result``."""
    flat, backend = x.reshape(-1), s.backend
    local = h.local_world
    per = -(-max(1, flat.size) // local)
    padded = s.take(per * local, dtype=x.dtype)
    padded[:flat.size] = flat
    padded[flat.size:] = 0
    node_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
    part32 = s.take(per, dtype=np.float32)   # the node's sum of this local rank's slice
    part = s.take(per, dtype=x.dtype)         # ... folded across the nodes
    node_sum = s.take(per, dtype=x.dtype)     # (the node stage's result)
    whole = s.take(per * local, dtype=x.dtype)

    def summed(got):
        part32[...] = got
        encode_cross()

    def crossed(fill):
        if part.dtype == np.float32:
            fill(part)
        else:
            part[...] = _filled(fill, per)

    def gathered(got):
        got = got[:flat.size]
        if op is ReduceOp.MEAN:
            np.divide(got, np.asarray(backend.world_size, got.dtype), out=got)

        def fill(dest):
            dest[...] = got

        s.result = deliver(fill, x, x.shape, out, "allreduce")

    s.then(REDUCE_SCATTER, padded, h.node, node_op, node_sum, summed)
    encode_cross = _flat_allreduce(s, part32, h.cross, node_op, crossed)
    s.then(ALL_GATHER, part, h.node, None, whole, gathered)


def _node_pieces(flat: np.ndarray, pieces: list[tuple[int, int]], h, backend: Backend,
                 op: ReduceOp, wire: str, timeout, into: np.ndarray,
                 on_error: Callable[[BaseException], None]) -> tuple[int, list]:
    """A multi-node allreduce in pieces whose cross-node stages overlap: the node
    reduce_scatters of every piece one after another, each piece's compressed cross-node
    allreduce as soon as its node stage is done, the node all_gathers in order as the pieces
    come back. (Each piece a whole hierarchical call would run its node all_gather before the
    next piece's reduce_scatter: the engine runs a group's calls in their order, so the
    pieces' cross stages could not overlap.) Every call is numbered now, each group's in the
    same order on every rank. Returns the first call's number and the jobs, to run in order
    (each waits only for jobs before it, so the workers, which start jobs in order, run them
    whatever their number)."""
    ss = [Steps("allreduce", wire, flat[lo:hi], backend, timeout, on_error)
          for lo, hi in pieces]
    for (lo, hi), s in zip(pieces, ss):
        _node_calls(s, flat[lo:hi], h, op, into[lo:hi])
    for calls in ([0], [1, 2], [3]):  # node: every reduce_scatter, then every all_gather
        for s in ss:
            s.number(calls)
    node_done = [threading.Event() for _ in ss]
    cross_done = [threading.Event() for _ in ss]

    def part(s: Steps, calls: list[int], after: threading.Event | None = None,
             done: threading.Event | None = None) -> Callable[[], None]:
        """A job: once ``after`` is set, run piece ``s``'s ``calls``; then set ``done``."""
        def job():
            try:
                if after is not None:
                    after.wait()
                s.run_numbered(calls)
            except BaseException as exc:
                s.fail(exc)
            finally:
                if done is not None:
                    done.set()
        return job

    def node_stages():
        for s, done in zip(ss, node_done):
            part(s, [0], done=done)()

    def gathers():
        for s, crossed in zip(ss, cross_done):
            part(s, [3], after=crossed)()
        for s in ss:
            s.close()

    crosses = [part(s, [1, 2], after, done) for s, after, done in zip(ss, node_done, cross_done)]
    return ss[0].runs[0][0], [node_stages, *crosses, gathers]


def _filled(fill: Callable[[np.ndarray], None], count: int) -> np.ndarray:
    result = np.empty(count, np.float32)
    fill(result)
    return result


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
        return checked_wire(wire, algorithm, name)

    wire = checked("reduce_scatter", backend, timeout, check)
    shape = (x.shape[0] // n, *x.shape[1:])
    per = int(np.prod(shape))
    h = getattr(backend, "hierarchy", None)
    if wire in _ELEMENTWISE and h is not None and h.num_nodes > 1:
        return _reduce_scatter_nodes(x, tensor, h, backend, op, wire, timeout, out, shape,
                                     background)
    c = chunk(per, 1, wire)
    numbers = Numbers(backend, BLOCK)
    s = Steps("reduce_scatter", wire, tensor, backend, timeout, numbers=numbers)
    width = encoded_bytes(c, wire)
    sent, rows, acc = s.take(n, width), s.take(n, width), s.take(c, dtype=np.float32)
    encode_chunks(np.ascontiguousarray(x.reshape(-1), dtype=np.float32), per, c, wire, sent)

    def folded(got):
        fold_rows(got.view(np.uint8).reshape(n, width), wire, op, acc)

        def fill(dest):
            dest[...] = acc[:per]

        s.result = deliver(fill, x, shape, out, "reduce_scatter")

    # its bytes travel as int8, the allreduce's first all-to-all's as uint8: their headers
    # differ where the ranks disagree on which call they make (rows of the same width)
    s.then(ALL_TO_ALL_SINGLE, sent.view(np.int8), backend, (None, None), rows.view(np.int8),
           folded)
    try:
        return s.run(background)
    finally:
        numbers.rest()


def _reduce_scatter_nodes(x: np.ndarray, tensor, h, backend: Backend, op: ReduceOp, wire: str,
                          timeout, out, shape: tuple, background: bool):
    """The bf16/fp16 reduce_scatter of a multi-node job: exact inside the node, compressed
    across nodes. Local rank ``i`` of every node gets, from an exact reduce_scatter over its
    node, its node's sum of the blocks of the ranks of local index ``i`` (in node order); those
    are encoded, all-to-all'd across the nodes and folded in node order (every hierarchy's nodes
    hold the same number of ranks). (int8/int4 stay flat: their error feedback needs what this
    rank's own blocks lost in the encoding.)"""
    n, local, nodes = backend.world_size, h.local_world, h.num_nodes
    per = int(np.prod(shape))
    s = Steps("reduce_scatter", wire, tensor, backend, timeout)
    blocks = x.reshape(n, per)
    grouped = s.take(local, nodes, per, dtype=x.dtype)
    for k, members in enumerate(h.members):
        for i, r in enumerate(members):
            grouped[i, k] = blocks[r]
    node_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
    node_sum = s.take(nodes * per, dtype=x.dtype)
    width = encoded_bytes(per, wire)
    sent, rows, acc = s.take(nodes, width), s.take(nodes, width), s.take(per, dtype=np.float32)

    def summed(got):
        encode_chunks(np.ascontiguousarray(got, dtype=np.float32), per, per, wire, sent)

    def folded(got):
        fold_rows(got.reshape(nodes, width), wire, node_op, acc)
        if op is ReduceOp.MEAN:
            np.divide(acc, np.float32(n), out=acc)

        def fill(dest):
            dest[...] = acc

        s.result = deliver(fill, x, shape, out, "reduce_scatter")

    s.then(REDUCE_SCATTER, grouped.reshape(-1), h.node, node_op, node_sum, summed)
    s.then(ALL_TO_ALL_SINGLE, sent, h.cross, (None, None), rows, folded)
    return s.run(background)


def all_gather(tensor, backend: Backend, wire: str, timeout, out, background: bool = False,
               algorithm: str | None = None):
    """:func:`~ferro_collective.all_gather` with ``wire``: each rank's block encoded, gathered,
    decoded."""
    name = "all_gather_async" if background else "all_gather"
    x = np.asarray(tensor)

    def check():
        check_floats(x, None, "all_gather")
        return checked_wire(wire, algorithm, name)

    wire = checked("all_gather", backend, timeout, check)
    n = backend.world_size
    shape = (n,) if x.ndim == 0 else (n * x.shape[0], *x.shape[1:])
    numbers = Numbers(backend, BLOCK)
    s = Steps("all_gather", wire, tensor, backend, timeout, numbers=numbers)
    width = encoded_bytes(x.size, wire)
    mine, gathered = s.take(width), s.take(n * width)
    encode_into(np.ascontiguousarray(x.reshape(-1), dtype=np.float32), wire, mine)

    def decoded(got):
        s.result = deliver(lambda dest: decode_rows(got.reshape(n, width), x.size, wire,
                                                      dest), x, shape, out, "all_gather")

    s.then(ALL_GATHER, mine, backend, None, gathered, decoded)
    try:
        return s.run(background)
    finally:
        numbers.rest()


def sent_values(x: np.ndarray, n: int, wire: str, name: str) -> np.ndarray:
    """What the peers decode of this rank's ``x`` in a compressed ``name`` ("reduce_scatter":
    ``x``'s ``n`` dim-0 blocks; "allreduce": ``n`` chunks of the flat values) over ``n`` ranks,
    as float32 of ``x``'s shape: ``x`` less what its encoding rounds away, for error feedback
    (``x - sent_values(x, ...)`` is the error; the flat allreduce's second encoding, of the
    folded chunk, and a multi-node job's cross-node stage are not this rank's to feed back).

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
