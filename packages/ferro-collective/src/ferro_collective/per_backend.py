"""Per-backend state: the collective sequence number and the async workers.

All ranks must call collectives on a backend in the same order (as in torch.distributed); the
sequence number each call takes is then the same on every rank, and every message of that call
travels on tags derived from it, so calls in flight at once never mix. On a backend with a
same-host engine the numbers are the engine door's tickets (``Comm.reserve``), shared with every
other client of that engine (a compiled torch backend, a JAX handler), so all their calls keep
one order.
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from collections.abc import Callable

from ferro_backend import CollectiveMismatchError, settings
from ferro_backend.base import USER_TAG_LIMIT

from ._doorplan import SeqCounter
from .header import check_all, owed

#: collectives use tags in [2**31, 2**32 - 1): 2**19 - 1 sequence slots of 4096 step tags each
TAG_BASE = USER_TAG_LIMIT
STEPS_PER_CALL = 1 << 12
SEQ_SLOTS = (1 << 19) - 1
#: the longest a call waits for a refusal's catch-up before it takes its number anyway
HOLD_SECONDS = 600.0
#: the async workers' thread names start with this
WORKER_PREFIX = "ferro-collective-async"


class BackendState:
    def __init__(self, backend) -> None:
        engine = getattr(backend, "engine", None)
        #: the next sequence number (``counter()``): the engine door's next ticket, else this
        #: backend's own count (atomic under the GIL)
        self.counter = engine.comm.reserve if engine is not None else SeqCounter()
        #: gives a number taken from ``counter`` back unused (the door skips its turn; a
        #: backend's own count needs nothing: the number's tags are never used)
        self._skip = engine.comm.skip if engine is not None else None
        #: skips numbers after a call that took fewer than a peer's (:meth:`catch_up`)
        self._catch_up = engine.comm.catch_up if engine is not None else self.counter.catch_up
        self._comm = engine.comm if engine is not None else None
        self._lock = threading.Lock()
        #: set while a refusal's catch-up is due (:meth:`hold`)
        self.held: threading.Event | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def next_seq(self) -> int:
        held = self.held
        if held is not None:  # a refusal's catch-up first (:meth:`hold`)
            held.wait(HOLD_SECONDS)
        return self.counter()

    def hold(self, until: threading.Event) -> None:
        """The next number waits for ``until`` (at most :data:`HOLD_SECONDS`): a refused
        hierarchical call publishes its refusal in the background, and its exchange may owe
        numbers to the peers' call (their spans), which only a rank that numbered nothing after
        it can skip (:class:`.stage_check.Refused`)."""
        self.held = until

    def give_back(self, seq: int) -> None:
        """Number ``seq`` (taken, never run) will not run: every rank must give back the same
        numbers (a peer that ran it would wait for this rank)."""
        if self._skip is not None and self._skip(seq) != 0:
            raise RuntimeError(f"could not give back sequence number {seq}")

    def catch_up(self, seq: int, headers: list[bytes], rank: int) -> None:
        """Number ``seq``'s call met a mismatch (``headers``: every rank's, in rank order):
        where a peer's call takes more numbers than this rank's (a compressed call's block
        against an exact call), skip the difference, so that every rank numbers the next call
        alike; not where this rank already numbered a call after it (that call keeps its
        number, and meets its peers' calls apart)."""
        count = owed(headers, rank)
        if count > 0:
            self._catch_up(seq, count)

    def abandon(self, unrun: list[int], count: int, timeout: float) -> None:
        """A call's numbers ``unrun`` (taken in order, after one it ran) will not run: give
        them back, and where a peer's call took ``count`` more numbers, skip those after the
        last as :meth:`catch_up` does (on an engine, in the last one's turn: waiting for it at
        most ``timeout`` seconds)."""
        if not unrun:
            return
        for seq in unrun[:-1] if count > 0 else unrun:
            self.give_back(seq)
        if count <= 0:
            return
        last = unrun[-1]
        if self._comm is None:
            self._catch_up(last, count)
            return
        try:
            if self._comm.begin(last, timeout, "catch-up") == 0:
                self._catch_up(last, count)
        finally:
            self._comm.end(last)

    def submit(self, job: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``job()`` on this backend's worker threads; jobs start in submission order."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    settings.ASYNC_WORKERS.get(), thread_name_prefix=WORKER_PREFIX)
        return self._pool.submit(job)

    def __del__(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()


def state(backend) -> BackendState:
    """``backend``'s state, made at its first call, and made again where an engine was
    attached since (``attach_engine`` after collectives ran over messages: from then on the
    numbers are the door's tickets, which every member's attach starts alike)."""
    st = _states.get(backend)  # the common case needs no lock
    if st is None or st._comm is not _comm_of(backend):
        with _states_lock:
            st = _states.get(backend)
            if st is None or st._comm is not _comm_of(backend):
                st = _states[backend] = BackendState(backend)
    return st


def _comm_of(backend):
    """The door of ``backend``'s engine, or None. (The state holds the door, never the
    engine: the engine holds its group, and a state holding its backend would keep it alive
    in the weak table.)"""
    engine = getattr(backend, "engine", None)
    return None if engine is None else engine.comm


_recording = threading.local()


def reserve(*backends) -> list[int]:
    """The next sequence number of each backend, taken now (a hierarchical call reserves its
    stages' on the node and cross groups when it is issued; :func:`recorded` collects them)."""
    seqs = [state(b).next_seq() for b in backends]
    taken = getattr(_recording, "taken", None)
    if taken is not None:
        for b, s in zip(backends, seqs, strict=True):
            taken.setdefault(b, []).append(s)
    return seqs


class recorded:
    """``with recorded() as taken:`` collects the numbers :func:`reserve` hands out on this
    thread meanwhile, per backend, in order (``taken[backend]``: a list)."""

    def __enter__(self) -> dict:
        self.outer = getattr(_recording, "taken", None)
        _recording.taken = {}
        return _recording.taken

    def __exit__(self, *exc) -> None:
        _recording.taken = self.outer


def check_headers(name: str, rank: int, headers: list[bytes], backend, seq: int) -> None:
    """:func:`.header.check_all` of call ``seq`` on ``backend``; where the ranks disagree, this
    rank also catches up with the peer whose call takes the most numbers
    (:meth:`BackendState.catch_up`) before the mismatch is raised, which carries the headers
    (its ``headers`` attribute: every rank's, in rank order)."""
    try:
        check_all(name, rank, headers)
    except CollectiveMismatchError as exc:
        exc.headers = headers
        state(backend).catch_up(seq, headers, rank)
        raise


def tag_base(seq: int) -> int:
    return TAG_BASE + (seq % SEQ_SLOTS) * STEPS_PER_CALL
