"""The parts every compressed call is made of (:mod:`.compressed` has the calls, and
:mod:`.compressed_agreement` how its ranks agree on it): its chunks, encoded into rows and
folded or decoded out of them; its result delivered into ``out=``; :class:`Steps`, its exact
collectives in order, now or on a worker (the flat allreduce's: :func:`flat_allreduce`); its
timeline event; and :class:`Joined`, one future for a call cut in pieces.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ferro_backend import Backend, CollectiveMismatchError, DistributedError
from ferro_backend import timeline as _timeline

from . import _wire as _kernel
from . import tracing
from .arguments import check_out_like
from .compressed_agreement import (
    PREFIX,
    Numbers,
    check_identities,
    identity,
    in_call,
    in_words,
)
from .dispatch import run
from .executors import abandoning, calling, prepared
from .ops import ReduceOp
from .per_backend import state
from .records import ALL_GATHER, ALL_TO_ALL_SINGLE, ALLREDUCE
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
    a new array, returned in ``like``'s dtype or copied into ``out`` (which the call checked
    with its other arguments, so that a bad one is refused on every rank)."""
    if isinstance(out, np.ndarray) and out.shape == shape and out.dtype == like.dtype == \
            np.float32 and out.flags.c_contiguous and out.flags.writeable:
        fill(out.reshape(-1))
        return out
    result = np.empty(int(np.prod(shape)), np.float32)
    fill(result)
    result = result.reshape(shape)
    if out is None:
        return result if like.dtype == np.float32 else result.astype(like.dtype)
    check_out_like(name, out, shape, like.dtype)
    out[...] = result
    return out


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
        #: the collective that carries the call's identity (:meth:`carry`) and checks it
        #: (``verify``) as part of it; None: the call's check decides (a piece's)
        self.decider: int | None = None
        self.verify: Callable[[Any], None] = lambda got: None
        self._rows = 0
        #: the call's identity (:meth:`carry`) and the width of the decider's rows for the
        #: same values in another wire: its header check's errors in the user's words
        self.who: np.ndarray | None = None
        self.widths: Callable[[str], int] | None = None
        #: the node's agreement on the decider (:meth:`agreement`; a multi-node call's)
        self.agree: int | None = None
        #: the call's first collective failed with a mismatch on the agreement's group: every
        #: rank of that group met it, so none runs the agreement (a peer there may have made
        #: an exact call, which has none)
        self.skip_agree = False
        self.calls: list[tuple[Any, np.ndarray, Backend, Any, Any, Callable[[Any], None]]] = []
        #: the calls numbered so far (:meth:`number`): index -> (seq, what runs it)
        self.runs: dict[int, tuple[int, Callable[[], Any]]] = {}
        self.result: Any = None
        self.error: BaseException | None = None
        self.borrowed: list[np.ndarray] = []
        #: the bytes this rank's values are encoded into (chunks padded to whole blocks; a
        #: multi-node call's cross-node stage): the timeline's ``wire_bytes``
        self.encoded = 0
        #: a collective of these steps that times out in the background ends its group
        #: (:func:`.executors.abandon`, as the dispatcher does for the blocking ones); not a
        #: refusal's (:func:`.compressed_nodes.refuse`: as an exact call's refusal)
        self.abandons = True
        #: run once the call has run whole without an error (its error feedback's new
        #: residuals replace the old ones then)
        self.succeeded: list[Callable[[], None]] = []

    def take(self, *shape: int, dtype=np.uint8) -> np.ndarray:
        a = POOL.take(int(np.prod(shape)), np.dtype(dtype))
        self.borrowed.append(a)
        return a.reshape(shape)

    def then(self, coll, send: np.ndarray, group: Backend, arg, out,
             step: Callable[[Any], None]) -> None:
        self.calls.append((coll, send, group, arg, out, step))

    def carry(self, who: np.ndarray | None, group: Backend,
              widths: Callable[[str], int] | None = None) -> int:
        """The next collective (:meth:`then`) carries ``who`` (the call's :func:`identity`)
        ahead of each of its rows (one per rank of ``group``), checked on every rank as part
        of it, and decides the call (:class:`Numbers`: the first collective of a flat call; a
        multi-node call's first cross-node one). A rank whose collectives before it failed
        sends its failure there instead (the identity of a refusal, naming its error), so that
        every rank of ``group`` fails there too. Returns the bytes ahead of each row
        (:data:`PREFIX`; 0 without ``who``). ``widths(wire)``: the bytes of a row of it
        (``PREFIX`` included) where the call's values were sent in ``wire`` (its errors' words:
        :func:`.compressed_agreement.in_words`)."""
        if who is None:
            return 0
        self.decider, self._rows = len(self.calls), group.world_size
        self.who, self.widths = who, widths
        n, rank, ranks = group.world_size, group.rank, getattr(group, "global_ranks", None)
        self.verify = lambda got: check_identities(np.asarray(got).reshape(n, -1), rank, ranks)
        return PREFIX

    def _span(self, i: int) -> int:
        """What collective ``i``'s header says the call takes: where these steps carry the
        call's identity (a decider), their first collective on each group says the call's
        block there (:meth:`.compressed_agreement.Numbers.span`: where a peer made an exact
        call there, the peer catches up), else 0."""
        if self.decider is None or self.numbers is None:
            return 0
        group = self.calls[i][2]
        if any(c[2] is group for c in self.calls[:i]):
            return 0
        return self.numbers.span(group)

    def _on_zeros(self, i: int, send: np.ndarray) -> None:
        """Collective ``i`` runs after a failure: on zeros, and the decider with this rank's
        failure as its identity."""
        send[...] = 0
        if i == self.decider:
            send.reshape(self._rows, -1)[:, :PREFIX] = identity(self.name, None, None,
                                                                self.wire, self.error)

    def _ran(self, i: int, error: BaseException | None) -> None:
        if i == self.decider and self.numbers is not None:
            self.numbers.ran_first(error)

    def agreement(self, group: Backend) -> None:
        """Add, right after the decider, the collective by which every rank of ``group`` (a
        node) learns whether the decider failed on any of them: an exact MAX allreduce of the
        flag. (A multi-node call's decider is a cross-node collective, which each rank shares
        with one rank of every other node: a disagreement that one group meets, another may
        not; with the node's agreement, every rank of every node ends the call alike.)"""
        self.agree = len(self.calls)
        flag, anyone = self.take(1, dtype=np.int32), self.take(1, dtype=np.int32)
        self.then(ALLREDUCE, flag, group, ReduceOp.MAX, anyone, lambda got: None)

    def _agree(self, go: Callable[[], Any], send: np.ndarray) -> None:
        """Run the node's agreement (:meth:`agreement`): whatever this rank has met, it takes
        part; the call ends on this rank where it failed on any rank of the node."""
        numbers = self.numbers
        if self.error is not None:  # (its decider may have passed: every peer failed alike)
            numbers.ended = True
        send[0] = int(numbers.ended)
        try:
            anyone = int(np.asarray(go())[0])
        except BaseException as exc:
            numbers.ended = True
            self.fail(exc)
            return
        if anyone and not numbers.ended:
            numbers.ended = True
            self.fail(CollectiveMismatchError(
                f"{self.name}[{self.wire}]: ranks of another node disagree on the call (their "
                "error names what each rank called)"))

    @property
    def label(self) -> str:
        """The user's call, as its errors name it: ``allreduce[bf16]``."""
        return f"{self.name}[{self.wire}]" if self.wire not in (None, "None") else self.name

    def run(self, background: bool):
        """The result now, or (``background``) a :class:`Work` that gives it. Its errors name
        the user's call (:func:`.executors.in_call`), as does the reason its peers read where
        this rank gives up on one of its collectives (:func:`.executors.calling`)."""
        try:
            if not background:
                with calling(self.label):
                    return self._traced(self._now)
            with calling(self.label):
                self.number(range(len(self.calls)))  # numbered now, in order
        except DistributedError as exc:
            raise in_call(exc, self.label)  # noqa: B904 (the same error, renamed)
        future = state(self.backend).submit(
            lambda: self._traced(self._later, cat="collective.async"))
        return Work(self.name, self.runs[0][0], future)

    def number(self, indices) -> None:
        """Check and number the calls at ``indices`` now: their places in their groups' order
        of calls (:meth:`run_numbered` runs them later)."""
        for i in indices:
            coll, send, group, arg, out, _ = self.calls[i]
            seq, go = prepared(coll, send, group, arg, self.timeout, out, self._span(i))
            # (the blocking path's calls go through the dispatcher, which times them and, as
            # here, ends the group where this rank gives up on one: no peer completes it alone)
            if self.abandons:
                go = abandoning(go, group)
            self.runs[i] = seq, tracing.traced_job(coll.name, go, send, group, None)
            if self.numbers is not None:
                self.numbers.took(group)

    def run_numbered(self, indices) -> None:
        """Run the numbered calls at ``indices``, each followed by its step. After a failure
        the later calls still run, on zeros (every rank takes part in each, as its peers
        expect), unless the call's decider failed (:class:`Numbers`): they are given back then
        (the node's agreement still runs). The first error is kept (:meth:`close` raises it)."""
        numbers = self.numbers
        for i in indices:
            seq, go = self.runs[i]
            if numbers is not None and (numbers.ended if i != self.agree else self.skip_agree):
                numbers.give_back(self.calls[i][2], seq)
                continue
            self._one(i, go)

    def _one(self, i: int, go: Callable[[], Any]) -> None:
        """Collective ``i`` (``go()`` runs it) and its step; an error is kept (:meth:`fail`).
        After an error it runs on zeros (the decider with this rank's failure); the decider's
        result is checked, and decides; the node's agreement runs whatever came before."""
        send, step = self.calls[i][1], self.calls[i][5]
        if i == self.agree:
            self._agree(go, send)
            return
        if self.error is not None:
            self._on_zeros(i, send)
        try:
            try:
                got = go()
                if i == self.decider:
                    self.verify(got)
            except BaseException as exc:
                if i == self.decider:
                    exc = in_words(exc, self.who, self.calls[i][0].name,
                                   self.calls[i][1].shape[-1], self.widths)
                self._ran(i, exc)
                if i == 0 and self.agree is not None and isinstance(
                        exc, CollectiveMismatchError) and self.calls[0][2] is self.calls[
                            self.agree][2]:
                    self.skip_agree = True
                raise exc  # (in the user's words: the original is its cause)
            self._ran(i, None)
            if self.error is None:
                step(got)
        except BaseException as exc:  # (raised by close or _now)
            self.fail(exc)

    def fail(self, error: BaseException) -> None:
        """Keep the call's first error (in the user's call's name: :func:`in_call`); a piece's
        tells ``on_error`` at once."""
        if self.error is None:
            self.error = error = in_call(error, self.label)
            if self.on_error is not None:
                self.on_error(error)

    def close(self):
        """Once every call has run: the first error raised, else the buffers given back and
        the result."""
        if self.error is not None:
            raise self.error
        return self._succeeded()

    def _succeeded(self):
        for commit in self.succeeded:
            commit()
        POOL.give(*self.borrowed)
        return self.result

    def _now(self):
        """The calls in order, numbered as they run (:meth:`_one` each). An error is raised once
        the call is decided (its decider, and the node's agreement after it, have run: a node
        stage's failure goes on to them, on zeros, so that the other nodes' ranks learn of it
        there); the call's owner gives back the numbers not taken."""
        decided = self.agree if self.agree is not None else self.decider
        for i, (coll, send, group, arg, out, _) in enumerate(self.calls):
            if i == self.agree and self.skip_agree and self.error is not None:
                raise self.error  # (decided: its first collective met the disagreement)
            if self.numbers is not None:
                self.numbers.took(group)
            self._one(i, functools.partial(run, coll, send, group, arg, self.timeout, None, out,
                                           self._span(i)))
            if self.error is not None and (decided is None or i >= decided):
                raise self.error
        return self._succeeded()

    def _later(self):
        if self.after is not None:
            self.after.wait()
        with calling(self.label):
            self.run_numbered(range(len(self.calls)))
        return self.close()

    def _traced(self, call, *args, cat: str = "collective"):
        if self.on_error is not None:
            return call(*args)
        return traced(self.name, self.wire, self.tensor, self.backend, self.encoded, cat, call,
                      *args)


def flat_allreduce(s: Steps, flat: np.ndarray, group: Backend, op: ReduceOp,
                   done: Callable[[Callable[[np.ndarray], None]], None],
                   who: np.ndarray | None = None, agree: Backend | None = None,
                   feedback=None) -> Callable[[], None]:
    """Add the compressed allreduce of float32 ``flat`` over ``group`` to ``s``: an
    all-to-all of the encoded chunks, each rank's chunk folded and encoded, an all-gather,
    then ``done(fill)`` (``fill(dest)`` decodes the result into ``flat.size`` float32 values).
    ``who``: the call's :func:`identity`, carried ahead of each chunk of the all-to-all (the
    call's first collective, or a multi-node call's first cross-node one, whose node group,
    ``agree``, then agrees on it: :meth:`Steps.agreement`) and checked. Returns what encodes
    ``flat`` into the first one's bytes (call it once ``flat`` holds the values).
    ``feedback`` (:class:`~.wire.Feedback`): both encodings' last residuals are added to
    what they encode (``flat`` is not changed) and replaced by theirs once the call succeeded
    (:attr:`Steps.succeeded`; a failed call leaves them as they were)."""
    n, wire = group.world_size, s.wire
    c = chunk(flat.size, n, wire)
    width = encoded_bytes(c, wire)
    s.encoded += n * width
    p = s.carry(who, group, lambda w: PREFIX + encoded_bytes(chunk(flat.size, n, w), w))
    sent, rows, mine = s.take(n, p + width), s.take(n, p + width), s.take(width)
    acc, gathered = s.take(c, dtype=np.float32), s.take(n * width)
    if who is not None:
        sent[:, :p] = who

    # (a fed-back call's new residuals replace the old ones once it succeeded: a failed call
    # leaves them as they were)
    residuals: dict[str, np.ndarray] = {}

    def folded(got):
        fold_rows(got.reshape(n, p + width)[:, p:], wire, op, acc)
        if feedback is not None and _fits(feedback.folded, acc.size):
            np.add(acc, feedback.folded, out=acc)
        encode_into(acc, wire, mine)
        if feedback is not None:
            decoded = POOL.take(c, np.float32)
            decode_into(mine, wire, decoded, _kernel.COPY)
            residuals["folded"] = np.subtract(acc, decoded, out=feedback.spare("folded", c))
            POOL.give(decoded)

    def ended(got):
        done(lambda dest: decode_rows(got.reshape(n, width), c, wire, dest))

    s.then(ALL_TO_ALL_SINGLE, sent, group, (None, None), rows, folded)
    if agree is not None and who is not None:
        s.agreement(agree)
    s.then(ALL_GATHER, mine, group, None, gathered, ended)
    if feedback is None:
        return lambda: encode_chunks(flat, c, c, wire, sent[:, p:])

    def encode_fed_back():
        x = np.add(flat, feedback.sent, dtype=np.float32) if _fits(feedback.sent, flat.size) \
            else flat
        encode_chunks(x, c, c, wire, sent[:, p:])
        decoded = POOL.take(flat.size, np.float32)
        decode_rows(sent[:, p:], c, wire, decoded)
        residuals["sent"] = np.subtract(x, decoded, out=feedback.spare("sent", flat.size))
        POOL.give(decoded)

    def commit():
        for name, new in residuals.items():
            feedback.replace(name, new)

    s.succeeded.append(commit)
    return encode_fed_back


def _fits(residual: np.ndarray | None, size: int) -> bool:
    """Whether a fed-back ``residual`` (None before the first call) is added to a call of
    ``size`` values (one of another size starts afresh: zeros)."""
    return residual is not None and residual.size == size


def traced(name: str, wire: str, tensor, backend: Backend, wire_bytes: int, cat: str, call,
           *args):
    """``call(*args)``; while tracing, one timeline event (category ``cat``) for the
    compressed call: the input's bytes and the bytes this rank encodes (``wire_bytes``:
    :attr:`Steps.encoded`), above the events of the collectives it runs (``error=<type>`` if
    it raised)."""
    if not _timeline.active():
        return call(*args)
    x = np.asarray(tensor)
    entry = _timeline._begin(f"{name}[{wire}]", cat, {
        "bytes": int(x.nbytes), "dtype": str(x.dtype), "wire": wire,
        "wire_bytes": int(wire_bytes), "rank": backend.rank, "world": backend.world_size})
    error = None
    try:
        return call(*args)
    except BaseException as exc:
        error = exc
        raise
    finally:
        _timeline._end(entry, error)


def encoded_size(count: int, n: int, wire: str) -> int:
    """The bytes a compressed allreduce of ``count`` values over ``n`` ranks encodes each
    rank's values into (``n`` chunks, padded to whole int8/int4 blocks)."""
    return n * encoded_bytes(chunk(count, n, wire), wire)


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
