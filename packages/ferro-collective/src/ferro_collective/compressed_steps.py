"""The parts every compressed call is made of (:mod:`.compressed` has the calls): its chunks,
encoded into rows and folded or decoded out of them; its result delivered into ``out=``;
:class:`Steps`, its exact collectives in order, now or on a worker; its timeline event; and
:class:`Joined`, one future for a call cut in pieces.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ferro_backend import Backend, CollectiveMismatchError
from ferro_backend import timeline as _timeline

from . import _wire as _kernel
from .dispatch import run
from .executors import prepared
from .header import HEADER_SIZE, describe, refusal
from .header import encode as encode_header
from .ops import ReduceOp
from .per_backend import state
from .records import ALL_GATHER, ALL_TO_ALL_SINGLE
from .scratch import POOL
from .wire import FOLD, decode_into, encode_into, encoded_bytes
from .work import Work


def chunk(count: int, n: int, wire: str) -> int:
    """Values per chunk when ``count`` values are cut in ``n`` (int8, int4: whole blocks)."""
    c = max(1, -(-count // n))
    return -(-c // _kernel.BLOCK) * _kernel.BLOCK if wire in ("int8", "int4") else c


def encode_chunks(flat: np.ndarray, step: int, c: int, wire: str, sent: np.ndarray) -> None:
    """``flat`` cut in ``len(sent)`` pieces of ``step`` values, each padded with zeros to ``c``
    values (the allreduce's chunks: ``step == c``, the last one short; the reduce-scatter's
    dim-0 blocks: padded to whole int8/int4 blocks) and encoded into its row of ``sent``."""
    for r in range(sent.shape[0]):
        chunk = flat[r * step:(r + 1) * step]
        if chunk.size < c:
            chunk = np.concatenate([chunk, np.zeros(c - chunk.size, np.float32)])
        encode_into(chunk, wire, sent[r])


def fold_rows(rows: np.ndarray, wire: str, op: ReduceOp, acc: np.ndarray) -> np.ndarray:
    """Decode every rank's chunk into ``acc`` (float32, a chunk's values), folded in rank
    order."""
    decode_into(rows[0], wire, acc, _kernel.COPY)
    for r in range(1, rows.shape[0]):
        decode_into(rows[r], wire, acc, FOLD[op])
    if op is ReduceOp.MEAN:
        acc /= np.float32(rows.shape[0])
    return acc


def decode_rows(rows: np.ndarray, c: int, wire: str, dest: np.ndarray) -> None:
    """Every row's ``c`` values into float32 ``dest``, one after another, as many as it holds
    (a last chunk cut short goes through a scratch chunk)."""
    for r in range(rows.shape[0]):
        lo, hi = r * c, min((r + 1) * c, dest.size)
        if hi <= lo:
            break
        if hi - lo == c:
            decode_into(rows[r], wire, dest[lo:hi], _kernel.COPY)
        else:
            tmp = POOL.take(c, np.float32)
            decode_into(rows[r], wire, tmp, _kernel.COPY)
            dest[lo:hi] = tmp[:hi - lo]
            POOL.give(tmp)


def deliver(fill: Callable[[np.ndarray], None], like: np.ndarray, shape: tuple,
             out: np.ndarray | None, name: str):
    """The result: ``fill(dest)`` writes its float32 values straight into ``out`` where that
    is a float32 C-contiguous array of the result's shape (no copy, no new memory), else into
    a new array, returned in ``like``'s dtype or copied into ``out`` (checked here, once the
    collectives have run: a bad ``out`` on one rank does not leave its peers waiting)."""
    if isinstance(out, np.ndarray) and out.shape == shape and out.dtype == like.dtype == \
            np.float32 and out.flags.c_contiguous and out.flags.writeable:
        fill(out.reshape(-1))
        return out
    result = np.empty(int(np.prod(shape)), np.float32)
    fill(result)
    result = result.reshape(shape)
    if out is None:
        return result if like.dtype == np.float32 else result.astype(like.dtype)
    if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != like.dtype:
        raise ValueError(f"{name}: out= must be an array of shape {shape} and dtype "
                         f"{like.dtype}")
    out[...] = result
    return out


class Numbers:
    """The sequence numbers a compressed call takes on each of its groups: always as many
    (``blocks``: group -> count; :data:`.compressed.BLOCK` on one group), whatever its size,
    wire and kind; those its collectives do not take are given back (:meth:`rest`). Ranks that
    disagree on a call (sizes that cut it in different numbers of pieces, one rank that refused
    it) then still number the calls after it alike. Its first collective decides the rest
    (:meth:`ran_first`): every rank meets a disagreement there (its headers, the identities it
    carries, or the check of the whole call), and once it failed the call's other collectives
    are given back instead of run, on every rank alike."""

    def __init__(self, blocks: dict) -> None:
        #: id(group) -> [numbers left, the group's state]
        self._left = {id(g): [count, state(g)] for g, count in blocks.items()}
        self.decided = False  # the first collective has run
        self.ended = False    # ... and failed: the others are given back

    def covers(self, group: Backend) -> bool:
        return id(group) in self._left

    def took(self, group: Backend) -> None:
        """A collective of the call took a number of ``group``."""
        left = self._left[id(group)]
        if left[0] <= 0:
            raise RuntimeError("a compressed call took more sequence numbers than its block")
        left[0] -= 1

    def give_back(self, group: Backend, seq: int) -> None:
        """A collective numbered ``seq`` on ``group`` will not run."""
        self._left[id(group)][1].give_back(seq)

    def ran_first(self, error: BaseException | None) -> None:
        """A collective of the call ran (``error``: it failed); the first one decides."""
        if not self.decided:
            self.decided, self.ended = True, error is not None

    def rest(self) -> None:
        """Take the numbers the call has not taken and give them back (they never run)."""
        for left in self._left.values():
            while left[0] > 0:
                left[0] -= 1
                left[1].give_back(left[1].next_seq())


class WholeCheck:
    """The check of a whole compressed call, numbered when it is made (before the call's
    collectives): an all-gather of every rank's :func:`identity` over the call's backend,
    compared on every rank. Where the ranks' collectives may not meet a disagreement the same
    way (a call in pieces: sizes whose first pieces agree; a multi-node call: a node stage
    fails inside one node only), it decides the call's :class:`Numbers` on every rank alike.
    :meth:`run` raises where they differ; :attr:`done` is set once it has run."""

    def __init__(self, name: str, x: np.ndarray | None, op: ReduceOp | None, wire: str,
                 backend: Backend, timeout, numbers: Numbers,
                 refused: BaseException | None = None) -> None:
        self.n, self.rank, self.numbers = backend.world_size, backend.rank, numbers
        mine = identity(name, x, op, wire, refused)
        self.gathered = np.empty(self.n * PREFIX, np.uint8)
        self.seq, self._go = prepared(ALL_GATHER, mine, backend, None, timeout, self.gathered)
        if numbers.covers(backend):
            numbers.took(backend)
        self.done = threading.Event()

    def run(self, fail: Callable[[BaseException], None] | None = None) -> None:
        """Run it; where it fails, ``fail(error)`` (before :attr:`done` is set), then raise."""
        error = None
        try:
            check_identities(np.asarray(self._go()).reshape(self.n, PREFIX), self.rank)
        except BaseException as exc:
            error = exc
        self.numbers.ran_first(error)
        if error is not None and fail is not None:
            fail(error)
        self.done.set()
        if error is not None:
            raise error

    def job(self, fail: Callable[[BaseException], None]) -> Callable[[], None]:
        """:meth:`run` for a worker: its error goes to ``fail``."""
        def run():
            try:
                self.run(fail)
            except BaseException:
                pass  # (given to fail)
        return run


class Steps:
    """A compressed call's exact collectives in order: :meth:`then` adds one (its record, the
    bytes it sends, the group, its argument, where its result goes) with the step that takes
    its result (and fills the next one's bytes, or sets :attr:`result`). Its buffers come from
    the scratch pool (:meth:`take`: fresh memory costs more than the codec on a virtual
    machine) and go back when the call has run whole (a failed call keeps them: a message may
    still land in one)."""

    def __init__(self, name: str, wire: str, tensor, backend: Backend, timeout,
                 on_error: Callable[[BaseException], None] | None = None,
                 numbers: Numbers | None = None,
                 after: threading.Event | None = None) -> None:
        self.name, self.wire, self.tensor, self.backend, self.timeout = (
            name, wire, tensor, backend, timeout)
        #: set for a piece of a call (which records one event for all): told of the first
        #: error as it happens, in the background
        self.on_error = on_error
        #: the call's numbers on ``backend`` (a call on one group: every collective on it)
        self.numbers = numbers
        #: set once the call's check has run (a call in pieces: in the background, its
        #: pieces' collectives wait for it)
        self.after = after
        #: checks the first collective's result (:meth:`carry`): part of that collective
        self.verify: Callable[[Any], None] | None = None
        self.calls: list[tuple[Any, np.ndarray, Backend, Any, Any, Callable[[Any], None]]] = []
        #: the calls numbered so far (:meth:`number`): index -> (seq, what runs it)
        self.runs: dict[int, tuple[int, Callable[[], Any]]] = {}
        self.result: Any = None
        self.error: BaseException | None = None
        self.borrowed: list[np.ndarray] = []

    def take(self, *shape: int, dtype=np.uint8) -> np.ndarray:
        a = POOL.take(int(np.prod(shape)), np.dtype(dtype))
        self.borrowed.append(a)
        return a.reshape(shape)

    def then(self, coll, send: np.ndarray, group: Backend, arg, out,
             step: Callable[[Any], None]) -> None:
        self.calls.append((coll, send, group, arg, out, step))

    def carry(self, who: np.ndarray | None, n: int) -> int:
        """The first collective (the next :meth:`then`, the first) carries ``who`` (the call's
        :func:`identity`) ahead of each of its ``n`` rows, checked on every rank as part of that
        collective: the bytes ahead of each row (:data:`PREFIX`; 0 without ``who``)."""
        if who is None:
            return 0
        if self.calls:
            raise RuntimeError("a compressed call's identity travels in its first collective")
        rank = self.backend.rank
        self.verify = lambda got: check_identities(np.asarray(got).reshape(n, -1), rank)
        return PREFIX

    def run(self, background: bool):
        """The result now, or (``background``) a :class:`Work` that gives it."""
        if not background:
            return self._traced(self._now)
        self.number(range(len(self.calls)))  # numbered now, in order
        future = state(self.backend).submit(lambda: self._traced(self._later))
        return Work(self.name, self.runs[0][0], future)

    def number(self, indices) -> None:
        """Check and number the calls at ``indices`` now: their places in their groups' order
        of calls (:meth:`run_numbered` runs them later)."""
        for i in indices:
            coll, send, group, arg, out, _ = self.calls[i]
            self.runs[i] = prepared(coll, send, group, arg, self.timeout, out)
            if self.numbers is not None:
                self.numbers.took(group)

    def run_numbered(self, indices) -> None:
        """Run the numbered calls at ``indices``, each followed by its step. After a failure
        the later calls still run, on zeros (every rank takes part in each, as its peers
        expect), unless the call's first collective failed (:class:`Numbers`): they are given
        back then. The first error is kept (:meth:`close` raises it)."""
        numbers = self.numbers
        for i in indices:
            send, group, step = self.calls[i][1], self.calls[i][2], self.calls[i][5]
            seq, go = self.runs[i]
            if numbers is not None and numbers.ended:
                numbers.give_back(group, seq)
                continue
            if self.error is not None:
                send[...] = 0
            try:
                try:
                    got = go()
                    if i == 0 and self.verify is not None:
                        self.verify(got)
                except BaseException as exc:
                    if numbers is not None:
                        numbers.ran_first(exc)
                    raise
                if numbers is not None:
                    numbers.ran_first(None)
                if self.error is None:
                    step(got)
            except BaseException as exc:  # (raised by close, once the rest have run)
                self.fail(exc)

    def fail(self, error: BaseException) -> None:
        """Keep the call's first error; a piece's tells ``on_error`` at once."""
        if self.error is None:
            self.error = error
            if self.on_error is not None:
                self.on_error(error)

    def close(self):
        """Once every call has run: the first error raised, else the buffers given back and
        the result."""
        if self.error is not None:
            raise self.error
        POOL.give(*self.borrowed)
        return self.result

    def _now(self):
        numbers = self.numbers
        for i, (coll, send, group, arg, out, step) in enumerate(self.calls):
            if numbers is not None:
                numbers.took(group)
            try:
                got = run(coll, send, group, arg, self.timeout, None, out)
                if i == 0 and self.verify is not None:
                    self.verify(got)
            except BaseException as exc:
                if numbers is not None:
                    numbers.ran_first(exc)
                raise
            if numbers is not None:
                numbers.ran_first(None)
            step(got)
        POOL.give(*self.borrowed)
        return self.result

    def _later(self):
        if self.after is not None:
            self.after.wait()
        self.run_numbered(range(len(self.calls)))
        return self.close()

    def _traced(self, call, *args):
        if self.on_error is not None:
            return call(*args)
        return traced(self.name, self.wire, self.tensor, self.backend, call, *args)


def flat_allreduce(s: Steps, flat: np.ndarray, group: Backend, op: ReduceOp,
                   done: Callable[[Callable[[np.ndarray], None]], None],
                   who: np.ndarray | None = None) -> Callable[[], None]:
    """Add the compressed allreduce of float32 ``flat`` over ``group`` to ``s``: an
    all-to-all of the encoded chunks, each rank's chunk folded and encoded, an all-gather,
    then ``done(fill)`` (``fill(dest)`` decodes the result into ``flat.size`` float32 values).
    ``who``: the call's :func:`identity`, carried ahead of each chunk of the all-to-all (the
    call's first collective) and checked. Returns what encodes ``flat`` into the first one's
    bytes (call it once ``flat`` holds the values)."""
    n, wire = group.world_size, s.wire
    c = chunk(flat.size, n, wire)
    width = encoded_bytes(c, wire)
    p = s.carry(who, n)
    sent, rows, mine = s.take(n, p + width), s.take(n, p + width), s.take(width)
    acc, gathered = s.take(c, dtype=np.float32), s.take(n * width)
    if who is not None:
        sent[:, :p] = who

    def folded(got):
        encode_into(fold_rows(got.reshape(n, p + width)[:, p:], wire, op, acc), wire, mine)

    def ended(got):
        done(lambda dest: decode_rows(got.reshape(n, width), c, wire, dest))

    s.then(ALL_TO_ALL_SINGLE, sent, group, (None, None), rows, folded)
    s.then(ALL_GATHER, mine, group, None, gathered, ended)
    return lambda: encode_chunks(flat, c, c, wire, sent[:, p:])


#: bytes a compressed call's first collective carries ahead of each rank's data: the call as
#: the rank made it (:func:`identity`), compared on every rank (:func:`check_identities`).
#: Its collectives' own headers name bytes only: calls of other sizes, shapes, dtypes, ops,
#: wires or kinds may send rows of the same width
PREFIX = 128


def identity(name: str, x: np.ndarray | None, op: ReduceOp | None, wire: str,
             refused: BaseException | None = None) -> np.ndarray:
    """A compressed call of collective ``name`` on ``x`` as :data:`PREFIX` bytes: its header
    (:func:`.header.encode`, sequence number 0; a refusal's, :func:`.header.refusal`, where
    this rank ``refused`` the call), then ``wire`` (its first 8 bytes)."""
    out = np.zeros(PREFIX, np.uint8)
    header = (refusal(name, 0, refused) if refused is not None
              else encode_header(name, x.dtype, x.shape, op))
    out[:HEADER_SIZE] = np.frombuffer(header, np.uint8)
    out[HEADER_SIZE:HEADER_SIZE + 8] = np.frombuffer(
        wire.encode(errors="replace")[:8].ljust(8, b"\0"), np.uint8)
    return out


def check_identities(rows: np.ndarray, rank: int) -> None:
    """Raise :class:`~ferro_backend.CollectiveMismatchError` where the ranks' identities (the
    first :data:`PREFIX` bytes of each of ``rows``, one per rank in rank order) differ: every
    rank holds them all, so every rank raises, naming what each rank called."""
    ids = [rows[r, :PREFIX].tobytes() for r in range(rows.shape[0])]
    if all(i == ids[rank] for i in ids):
        return
    groups: dict[bytes, list[int]] = {}
    for r, i in enumerate(ids):
        groups.setdefault(i, []).append(r)
    parts = [f"ranks {rs} called {_described(i)}" for i, rs in groups.items()]
    raise CollectiveMismatchError(f"{_described(ids[rank]).split('(')[0]}: ranks disagree on "
                                  "the call: " + "; ".join(parts))


def _described(ident: bytes) -> str:
    """``allreduce[bf16](float32[3], SUM)``: an :func:`identity` in words."""
    wire = ident[HEADER_SIZE:HEADER_SIZE + 8].rstrip(b"\0").decode(errors="replace")
    name, _, rest = describe(ident[:HEADER_SIZE]).removesuffix(" (seq 0)").partition("(")
    return f"{name}[{wire}]({rest}"


def traced(name: str, wire: str, tensor, backend: Backend, call, *args):
    """``call(*args)``; while tracing, one timeline event for the compressed call: the input's
    bytes and the bytes of its encoding (``wire_bytes``), beside the events of the collectives
    it runs."""
    if not _timeline.active():
        return call(*args)
    x = np.asarray(tensor)
    t0 = _timeline._now_us()
    try:
        return call(*args)
    finally:
        _timeline.record(f"{name}[{wire}]", "collective", t0, _timeline._now_us() - t0,
                         bytes=int(x.nbytes), dtype=str(x.dtype), wire=wire,
                         wire_bytes=encoded_bytes(int(x.size), wire), rank=backend.rank,
                         world=backend.world_size)


class Joined:
    """One future for a call's pieces: ``finish()``'s value once all have run; the first error
    as soon as a piece meets it (:meth:`fail`, from the piece's steps: ranks that disagree on
    the call's size cut it in different numbers of pieces, and a piece a peer never issues
    would wait for it until its timeout)."""

    def __init__(self, count: int, finish: Callable[[], Any]) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.left, self.finish, self.lock = count, finish, threading.Lock()

    def fail(self, error: BaseException) -> None:
        with self.lock:
            if not self.future.done():
                self.future.set_exception(error)

    def one_done(self, done: concurrent.futures.Future) -> None:
        error = done.exception()
        if error is not None:
            self.fail(error)
            return
        with self.lock:
            self.left -= 1
            if self.left or self.future.done():
                return
            try:
                self.future.set_result(self.finish())
            except BaseException as exc:
                self.future.set_exception(exc)
