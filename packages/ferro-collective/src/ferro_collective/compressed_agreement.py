"""How the ranks agree on a compressed call (:mod:`.compressed`'s calls, their
:class:`~.compressed_steps.Steps`): the call as each rank made it (:func:`identity`), carried
by its first collective and compared on every rank (:func:`check_identities`); the check of a
whole call before its collectives (:class:`WholeCheck`); and the fixed block of sequence
numbers every compressed call takes on each of its groups (:class:`Numbers`), so that ranks
that disagree on one call, which every rank meets in its first collective, still number the
calls after it alike. That first collective's header says how many numbers the call takes
(:meth:`Numbers.span`), so that a peer that made an exact call there, which takes one,
catches up (:func:`.header.owed`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

import numpy as np

from ferro_backend import (
    Backend,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerAbortedError,
    PeerClosedError,
)

from .executors import abandoning, calling, in_call, prepared
from .header import HEADER_SIZE, INVALID, describe, reason, refusal
from .header import encode as encode_header
from .ops import ReduceOp
from .per_backend import state
from .records import ALL_GATHER
from .wire import WIRES

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


#: a refusal's reasons that are a peer's failure, not a disagreement (a rank whose stage
#: before the identity's collective failed sends its failure there: :meth:`.Steps.carry`)
_FAILURES = {cls.__name__: cls for cls in (PeerAbortedError, PeerClosedError,
                                           CollectiveTimeoutError)}


def check_identities(rows: np.ndarray, rank: int, ranks=None) -> None:
    """Raise where the ranks' identities (the first :data:`PREFIX` bytes of each of ``rows``,
    one per rank in rank order) differ: every rank holds them all, so every rank raises. Where
    a rank sent a failure it met in the call (a peer gone or aborted, a timeout, in a stage
    before this collective), that error's type, naming that rank and the failure; else
    :class:`~ferro_backend.CollectiveMismatchError` naming what each rank called. ``ranks``:
    the job's rank of each row (a subgroup's :attr:`~ferro_backend.SubBackend.global_ranks`;
    default the rows' indices)."""
    ids = [rows[r, :PREFIX].tobytes() for r in range(rows.shape[0])]
    if all(i == ids[rank] for i in ids):
        return
    ranks = list(range(len(ids))) if ranks is None else list(ranks)
    call = _described(ids[rank]).split("(")[0]
    for r, i in enumerate(ids):
        if i[5] & INVALID:
            text = reason(i[:HEADER_SIZE])
            kind = _FAILURES.get(text.partition(":")[0])
            if kind is not None:
                message = (f"{call}: rank {ranks[r]} met a failure in an earlier stage of the "
                           f"call ({text})")
                if kind is CollectiveTimeoutError:
                    raise kind(message)
                peer = re.search(r"peer rank (\d+)|rank (\d+) aborted", text)
                raise kind(message, peer=int(next(g for g in peer.groups() if g))
                           if peer else ranks[r])
    groups: dict[bytes, list[int]] = {}
    for r, i in enumerate(ids):
        groups.setdefault(i, []).append(ranks[r])
    parts = [f"ranks {rs} called {_described(i)}" for i, rs in groups.items()]
    raise CollectiveMismatchError(f"{call}: ranks disagree on the call: " + "; ".join(parts))


_DISAGREE = ": ranks disagree on the collective: "
_REFUSED = re.compile(r"(all_to_all_single|all_gather) (\(seq \d+\): rank \d+ refused the call)")
_PART = re.compile(r"ranks \[([^\]]*)\] called (.*?)(?: \(seq \d+[^()]*\))?(?=; ranks \[|$)", re.S)
_ROWS = re.compile(r"(all_to_all_single|all_gather)\(uint8\[(?:\*, )?(\d+)\]\)")


def in_words(error: BaseException, who: np.ndarray, first: str, rows: int,
             widths: Callable[[str], int] | None = None) -> BaseException:
    """``error``, met by the first collective of a compressed call (``first``: its record's
    name; ``rows``: the bytes of each of its rows, :data:`PREFIX` included), in the words of
    the user's call (``who``: its :func:`identity`) where it is that collective's header check:
    a refusal names the call (``allreduce[bf16] (seq 3): rank 1 refused the call (...)``), and
    a disagreement names each rank's call, not the exact collectives it is made of. A peer's
    compressed call is known by its first collective there: where it is this call's kind with
    rows of another width, the wires that give the same values rows of that width
    (``widths(wire)``: bf16 and fp16 give the same) where any does, else its rows' width.
    Other errors: :func:`in_call`."""
    mine = _described(who.tobytes())
    call = mine.split("(")[0]
    if not isinstance(error, CollectiveMismatchError):
        return in_call(error, call)
    text = str(error)
    refused = _REFUSED.match(text)
    if refused is not None:
        return _chained(error, f"{call} {refused.group(2)}{text[refused.end():]}")
    head, sep, rest = text.partition(_DISAGREE)
    parts = _PART.findall(rest)
    if not sep or head != first or not parts:
        return error
    words = [f"ranks [{ranks}] called {_peer(desc, mine, first, rows, widths)}"
             for ranks, desc in parts]
    return _chained(error, f"{call}: ranks disagree on the call: " + "; ".join(words))


def _peer(desc: str, mine: str, first: str, rows: int,
          widths: Callable[[str], int] | None) -> str:
    """What a rank whose first collective ``desc`` says (:func:`.header.describe`, its
    sequence number cut) called, against this rank's call ``mine``."""
    m = _ROWS.fullmatch(desc)
    if m is None:
        return desc  # (an exact call: in its own words)
    coll, width = m.group(1), int(m.group(2))
    if coll == first and width == rows:
        return mine
    name, _, args = mine.partition("[")
    args = args.partition("]")[2]
    wires = [w for w in WIRES if widths(w) == width] if widths and coll == first else []
    if wires:
        return (" or ".join(f"{name}[{w}]{args}" for w in wires) + " (as its rows' width "
                f"says, {width - PREFIX} bytes; or a call of another size whose rows are as "
                "wide)")
    if coll == "all_gather" and width == PREFIX:
        return (f"a compressed call large enough to be cut in pieces (its check {desc}: "
                "another size)")
    return (f"another compressed call (its first collective {desc}: rows of "
            f"{max(0, width - PREFIX)} bytes, of another size, wire or kind)")


def _chained(error: BaseException, message: str) -> CollectiveMismatchError:
    new = CollectiveMismatchError(message)
    new.__cause__ = error
    return new


def _described(ident: bytes) -> str:
    """``allreduce[bf16](float32[3], SUM)``: an :func:`identity` in words."""
    wire = ident[HEADER_SIZE:HEADER_SIZE + 8].rstrip(b"\0").decode(errors="replace")
    name, _, rest = describe(ident[:HEADER_SIZE]).removesuffix(" (seq 0)").partition("(")
    return f"{name}[{wire}]({rest}"


class Numbers:
    """The sequence numbers a compressed call takes on each of its groups: always as many
    (``blocks``: group -> count; :data:`.compressed.BLOCK` on one group), whatever its size,
    wire and kind; those its collectives do not take are given back (:meth:`rest`). Ranks that
    disagree on a call (sizes that cut it in different numbers of pieces, one rank that refused
    it) then still number the calls after it alike. One collective decides the rest
    (:meth:`ran_first`): the first of a flat call, the check of a call in pieces, the first
    cross-node one of a multi-node call (its node agreeing on the outcome); every rank meets a
    disagreement there (its headers, or the identities it carries), and once it failed the
    call's other collectives are given back instead of run, on every rank alike."""

    def __init__(self, blocks: dict) -> None:
        #: id(group) -> [numbers left, the group's state]
        self._left = {id(g): [count, state(g)] for g, count in blocks.items()}
        #: the blocks, which the call's first collective on each group says (:meth:`span`)
        self._blocks = {id(g): count for g, count in blocks.items()}
        self.decided = False  # the first collective has run
        self.ended = False    # ... and failed: the others are given back

    def span(self, group: Backend) -> int:
        """What the call's first collective on ``group`` says in its header the call takes
        there (:func:`.header.owed`): its block on that group (where a peer made an exact call
        there instead, the peer catches up)."""
        return self._blocks.get(id(group), 0)

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
    compared on every rank, which decides the call's :class:`Numbers`: a flat call in pieces
    (ranks whose sizes differ may cut pieces of one size, whose collectives' own headers and
    rows agree). :meth:`run` raises where they differ; :attr:`done` is set once it has run.
    (A multi-node call decides at its first cross-node collective instead, its node agreeing
    on the outcome: :meth:`.compressed_steps.Steps.agreement`; this check over every rank cost
    FSDP at 2 x 2 13% of its steps.)"""

    def __init__(self, name: str, x: np.ndarray, op: ReduceOp | None, wire: str,
                 backend: Backend, timeout, numbers: Numbers) -> None:
        self.n, self.rank, self.numbers = backend.world_size, backend.rank, numbers
        self.ranks = getattr(backend, "global_ranks", None)
        mine = self.who = identity(name, x, op, wire)
        self.gathered = np.empty(self.n * PREFIX, np.uint8)
        self.seq, go = prepared(ALL_GATHER, mine, backend, None, timeout, self.gathered,
                                numbers.span(backend))
        self._go = abandoning(go, backend)  # (a deadline passed: the group ends, as a call's)
        numbers.took(backend)
        self.done = threading.Event()

    def run(self, fail: Callable[[BaseException], None] | None = None) -> None:
        """Run it; where it fails, ``fail(error)`` (before :attr:`done` is set), then raise."""
        error = None
        try:
            with calling(_described(self.who.tobytes()).split("(")[0]):
                got = self._go()
            check_identities(np.asarray(got).reshape(self.n, PREFIX), self.rank, self.ranks)
        except BaseException as exc:
            error = in_words(exc, self.who, ALL_GATHER.name, PREFIX)
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
