"""Message matching shared by the ferro transports.

Each rank owns one :class:`Mailbox`. A receive either finds its message already queued (an
*unexpected* message, copied once more) or posts its buffer, so the transport writes the incoming
bytes straight into the caller's memory. Messages match on ``(src, tag)`` in FIFO order. A receive
from any source (:data:`ANY_SOURCE`) matches on ``tag`` alone: it takes the oldest queued message
on that tag, whoever sent it, or else the first message on that tag to arrive, unless a receive
posted earlier for that message's own source claims it first (receives match in posting order,
as MPI's do).

Failures reach every waiter at once: a peer that closed or died fails the receives posted for it
(after its queued messages are drained), and an abort fails every receive of the job. The mailbox
is also the one record of those failures for its rank: :meth:`Mailbox.check` is what every
transport's send path asks before it sends.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from . import _wire, forks
from .base import GROUP_ABORT_TAG, GROUP_TAG_SHIFT
from .checks import size_mismatch, wait_limit
from .errors import PeerAbortedError, PeerClosedError
from .posted import ANY_SOURCE, PostedRecv

#: why a peer is gone when it said goodbye (``Backend.close``) instead of dying
CLOSED_CLEANLY = "it closed its backend"
_LOW = (1 << GROUP_TAG_SHIFT) - 1  # a tag's bits within its subgroup's tag space


def copy_into(dst: memoryview, src) -> None:
    """Copy bytes with the GIL released (threads of a simulated job copy in parallel)."""
    _wire.copy_bytes(src, dst)


class Mailbox:
    """The receive side of one rank: posted receives, queued (unexpected) messages, and the
    failures known to this rank (an abort, its own close, peers that are gone).

    ``timeout`` returns the owning backend's current default deadline (so a changed
    ``Backend.timeout`` reaches receives that are already posted).
    """

    #: (the process that made this mailbox, the forked one it is in): set in a forked child,
    #: where it reads as closed (``forks``)
    forked: tuple[int, int] | None = None

    def __init__(self, rank: int, timeout: Callable[[], float],
                 world_size: int | None = None) -> None:
        self.rank = rank
        forks.track(self, forks.mark_mailbox)
        self.timeout = timeout
        #: the ranks that may send here (known: a receive from any rank fails once all are gone)
        self.world_size = world_size
        self.cond = threading.Condition(threading.Lock())
        self.posted: dict[tuple[int, int], deque[PostedRecv]] = {}
        self.unexpected: dict[tuple[int, int], deque] = {}
        #: tag -> receives from any rank, in posting order
        self.posted_any: dict[int, deque[PostedRecv]] = {}
        #: tag -> the sources of that tag's queued messages, in arrival order (what a receive
        #: from any rank takes first)
        self.arrivals: dict[int, deque[int]] = {}
        self._order = 0
        self.closed_peers: dict[int, str] = {}
        self.aborted: tuple[int, str] | None = None
        #: subgroup id -> (the rank that gave up on it, why): its receives fail
        self.aborted_groups: dict[int, tuple[int, str]] = {}
        #: subgroups whose view this rank closed (SubBackend.close): a receive on their tags
        #: fails (each view has an id of its own, so this closes that view alone)
        self.closed_groups: set[int] = set()
        #: subgroup id -> called (no arguments) once it is aborted
        self.on_group_abort: dict[int, list[Callable[[], None]]] = {}
        self.closed = False
        #: called (no arguments, from the thread that saw it) on every failure: a peer gone,
        #: an abort, this rank's close (e.g. to wake waits that do not use this mailbox)
        self.on_failure: list[Callable[[], None]] = []
        #: called ``(src, tag)`` after a receive is posted and left waiting (a transport's
        #: receive loop that holds back a large frame until its receive is posted)
        self.on_post: Callable[[int, int], None] | None = None
        #: the transport's receive loop, if a waiting thread may run it itself (its
        #: ``drive(req, seconds)``: the TCP mesh's :class:`~ferro_backend.mesh.reactor.Reactor`)
        self.driver = None

    def add_failure_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on every failure from now on, and at once when one has already
        happened (a peer that closed before the callback was registered must not be lost)."""
        with self.cond:
            self.on_failure.append(callback)
            seen = self.aborted is not None or self.closed or bool(self.closed_peers)
        if seen:
            callback()

    def _failed(self) -> None:
        for callback in self.on_failure:
            callback()

    # -- failures -------------------------------------------------------------------------
    def failure(self, op: str, peer: int) -> BaseException | None:
        """The error an ``op`` with ``peer`` must raise now, if any (lock-free read)."""
        if self.forked is not None:  # (a forked child's copy: closed, whatever else it knew)
            return forks.forked_error(op, *self.forked, rank=self.rank)
        aborted = self.aborted
        if aborted is not None:
            who, reason = aborted
            return PeerAbortedError(f"{op}: rank {who} aborted the job: {reason}", peer=who,
                                    reason=reason)
        if self.closed:
            return PeerClosedError(f"{op}: rank {self.rank}'s backend is closed", peer=self.rank)
        if peer == ANY_SOURCE:
            others = None if self.world_size is None else self.world_size - 1
            if others and len(self.closed_peers) >= others:
                return PeerClosedError(f"{op}: rank {self.rank} waits for a message from any "
                                       f"rank, and every other rank is gone", peer=None,
                                       clean=all(w == CLOSED_CLEANLY
                                                 for w in self.closed_peers.values()))
            return None
        why = self.closed_peers.get(peer)
        if why is not None:
            return PeerClosedError(f"{op}: rank {self.rank} <-> {peer}: peer rank {peer} is gone "
                                   f"({why})", peer=peer, clean=why == CLOSED_CLEANLY)
        return None

    def check(self, op: str, peer: int) -> None:
        """Raise what :meth:`failure` names, if anything (every send path calls this first)."""
        failure = self.failure(op, peer)
        if failure is not None:
            raise failure

    def peer_closed(self, src: int, why: str) -> None:
        with self.cond:
            self.closed_peers.setdefault(src, why)
            self.cond.notify_all()
        self._failed()

    def abort(self, who: int, reason: str) -> None:
        with self.cond:
            if self.aborted is None:
                self.aborted = (who, reason)
            self.cond.notify_all()
        self._failed()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self._failed()

    # -- a subgroup's abort ---------------------------------------------------------------
    def group_failure(self, op: str, group: int) -> BaseException | None:
        """The error an ``op`` on subgroup ``group`` (its id) must raise now, if a member gave
        up on it (lock-free read)."""
        aborted = self.aborted_groups.get(group)
        if aborted is None:
            return None
        who, reason = aborted
        # ``who`` is a rank of the transport (the job's), not of the subgroup: said so, since
        # the reason (SubBackend.abort_group) names the subgroup's own
        return PeerAbortedError(f"{op}: global rank {who} gave up on this subgroup: {reason}",
                                peer=who, reason=reason)

    def abort_group(self, group: int, who: int, reason: str) -> None:
        """Rank ``who`` gave up on subgroup ``group``: fail every receive posted on its tags,
        and every later one, with PeerAbortedError; then call its ``on_group_abort``
        callbacks. The rest of the job (other tags) goes on."""
        with self.cond:
            self.aborted_groups.setdefault(group, (who, reason))
            failed = self._take_group_receives(group)
            callbacks = self.on_group_abort.pop(group, [])
            self.cond.notify_all()
        for req in failed:
            req.fail(self.group_failure("recv", group))
        for callback in callbacks:
            callback()

    def _take_group_receives(self, group: int) -> list[PostedRecv]:
        """(``cond`` held) The receives posted on subgroup ``group``'s tags, withdrawn."""
        taken: list[PostedRecv] = []
        for key in [k for k in self.posted if k[1] >> GROUP_TAG_SHIFT == group]:
            taken.extend(self.posted.pop(key))
        for tag in [t for t in self.posted_any if t >> GROUP_TAG_SHIFT == group]:
            taken.extend(self.posted_any.pop(tag))
        return taken

    def close_group(self, group: int) -> None:
        """This rank closed its view of subgroup ``group``: every receive posted on its tags
        (a thread of this rank blocked in it) fails with PeerClosedError now; the members are
        not told (a closed view publishes nothing) and later calls are the view's to refuse."""
        with self.cond:
            self.closed_groups.add(group)
            failed = self._take_group_receives(group)
            self.cond.notify_all()
        for req in failed:
            req.fail(self.closed_group_error("recv"))

    def closed_group_error(self, op: str) -> PeerClosedError:
        """The error of an ``op`` on a subgroup whose view this rank closed."""
        return PeerClosedError(f"{op}: rank {self.rank} closed its view of this subgroup",
                               peer=self.rank)

    def add_group_abort_callback(self, group: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` once subgroup ``group`` is aborted (at once if it already is)."""
        with self.cond:
            done = group in self.aborted_groups
            if not done:
                self.on_group_abort.setdefault(group, []).append(callback)
        if done:
            callback()

    # -- receive side ---------------------------------------------------------------------
    def post(self, src: int, tag: int, view: memoryview, *, check: bool = True) -> PostedRecv:
        """Post ``view`` for the next message from ``src`` on ``tag`` (completed at once if one
        is queued). ``check=False`` posts even if ``src`` is gone (a transport that still holds
        messages from it raises after delivering them)."""
        key = (src, tag)
        with self.cond:
            if self.aborted is not None or self.closed:
                raise self.failure("recv", src)
            if self.aborted_groups and tag >> GROUP_TAG_SHIFT in self.aborted_groups:
                raise self.group_failure("recv", tag >> GROUP_TAG_SHIFT)
            if self.closed_groups and tag >> GROUP_TAG_SHIFT in self.closed_groups:
                raise self.closed_group_error("recv")
            msg = self._pop_unexpected(src, tag)
            if msg is None:
                if check:
                    self.check("recv", src)
                req = PostedRecv(self, src, tag, view)
                self._order += 1
                req.order = self._order
                self.posted.setdefault(key, deque()).append(req)
                self.cond.notify_all()  # a transport may be waiting to claim it
        if msg is None:
            hook = self.on_post
            if hook is not None:
                hook(src, tag)
            return req
        req = PostedRecv(self, src, tag, view)
        if len(msg) != len(view):
            raise size_mismatch("recv", src, self.rank, tag, len(view), len(msg))
        copy_into(view, msg)
        req._done = True
        return req

    def post_any(self, tag: int, view: memoryview) -> PostedRecv:
        """Post ``view`` for the next message on ``tag`` from any rank (completed at once from
        the oldest queued one); the request's ``source`` names the sender once it is done."""
        with self.cond:
            if self.aborted is not None or self.closed:
                raise self.failure("recv", ANY_SOURCE)
            if self.aborted_groups and tag >> GROUP_TAG_SHIFT in self.aborted_groups:
                raise self.group_failure("recv", tag >> GROUP_TAG_SHIFT)
            arrived = self.arrivals.get(tag)
            src = arrived[0] if arrived else None
            req = PostedRecv(self, ANY_SOURCE, tag, view)
            if src is None:  # nothing queued: every other rank gone fails it now
                failure = self.failure("recv", ANY_SOURCE)
                if failure is not None:
                    raise failure
                self._order += 1
                req.order = self._order
                self.posted_any.setdefault(tag, deque()).append(req)
                self.cond.notify_all()
            else:
                msg = self._pop_unexpected(src, tag)
        if src is None:
            hook = self.on_post
            if hook is not None:
                hook(ANY_SOURCE, tag)
            return req
        req.source = src
        if len(msg) != len(view):
            raise size_mismatch("recv", src, self.rank, tag, len(view), len(msg))
        copy_into(view, msg)
        req._done = True
        return req

    def withdraw(self, req: PostedRecv) -> bool:
        """Take a pending receive back (a timeout, a failure); False if a transport already
        claimed it (it completes shortly)."""
        with self.cond:
            return self._withdraw(req)

    def _withdraw(self, req: PostedRecv) -> bool:
        """:meth:`withdraw`, the caller holding the lock."""
        queue = (self.posted_any.get(req.tag) if req.src == ANY_SOURCE
                 else self.posted.get((req.src, req.tag)))
        if queue is not None and req in queue:
            queue.remove(req)
            return True
        return False

    def take_unexpected(self, src: int, tag: int):
        """The oldest queued message from ``src`` on ``tag``, or None (for transports that
        receive by polling, like MPI's)."""
        with self.cond:
            return self._pop_unexpected(src, tag)

    def _pop_unexpected(self, src: int, tag: int):
        """The oldest queued message from ``src`` on ``tag`` (caller holds the lock), or None."""
        msg = self._pop(self.unexpected, (src, tag))
        if msg is not None:
            arrived = self.arrivals[tag]
            arrived.remove(src)  # its first occurrence: this message's
            if not arrived:
                del self.arrivals[tag]
        return msg

    def _pop_posted(self, src: int, tag: int) -> PostedRecv | None:
        """The receive a message from ``src`` on ``tag`` goes to (caller holds the lock): the
        earlier posted of the first one for ``(src, tag)`` and the first one from any rank."""
        mine = self.posted.get((src, tag))
        anyone = self.posted_any.get(tag)
        if anyone and (not mine or anyone[0].order < mine[0].order):
            req = anyone.popleft()
            if not anyone:
                del self.posted_any[tag]
            req.source = src
            return req
        return self._pop(self.posted, (src, tag))

    @staticmethod
    def _pop(table: dict, key: tuple[int, int]):
        """First item queued under ``key`` in ``table`` (caller holds the lock), or None."""
        queue = table.get(key)
        if not queue:
            return None
        item = queue.popleft()
        if not queue:
            del table[key]
        return item

    # -- transport side -------------------------------------------------------------------
    def claim(self, src: int, tag: int) -> PostedRecv | None:
        """Take the first receive posted for ``(src, tag)``; the transport then fills it."""
        with self.cond:
            return self._pop_posted(src, tag)

    def claim_first(self, req: PostedRecv) -> bool:
        """Take ``req`` out of the posted receives if the next message from its rank on its
        tag goes to it (first in line for the pair, and no earlier receive from any rank on
        the tag waits); False leaves everything as it was."""
        key = (req.src, req.tag)
        with self.cond:
            mine = self.posted.get(key)
            if not mine or mine[0] is not req:
                return False
            anyone = self.posted_any.get(req.tag)
            if anyone and anyone[0].order < req.order:
                return False
            mine.popleft()
            if not mine:
                del self.posted[key]
            return True

    def repost_front(self, req: PostedRecv) -> None:
        """Give a claimed receive back, first in line (its message will come another way)."""
        with self.cond:
            if req.src == ANY_SOURCE:
                req.source = None
                self.posted_any.setdefault(req.tag, deque()).appendleft(req)
            else:
                self.posted.setdefault((req.src, req.tag), deque()).appendleft(req)
            self.cond.notify_all()

    def others_wait(self, src: int, tag: int) -> bool:
        """Whether a receive is posted now that a message from ``src`` on another tag than
        ``tag`` would complete (or one from any rank on another tag). A transport that holds
        back ``src``'s frame on ``tag`` (a large frame whose receive is not posted yet) holds
        up every frame behind it on that link: while this is true it must not."""
        with self.cond:
            return self._others_wait(src, tag)

    def _others_wait(self, src: int, tag: int) -> bool:
        if any(t != tag for t in self.posted_any):
            return True
        return any(s == src and t != tag for s, t in self.posted)

    def claim_wait(self, src: int, tag: int, timeout: float,
                   may_wait: Callable[[], bool] | None = None) -> PostedRecv | None:
        """Like :meth:`claim`, waiting up to ``timeout`` for the receive to be posted (a large
        frame that is about to be asked for is worth a short wait: no buffer, no extra copy).
        With ``may_wait``, the wait also ends (None) as soon as that says no, checked at least
        every millisecond. It ends at once (None) when a receive waits for a message from
        ``src`` on another tag (:meth:`others_wait`): that message may be behind this one."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                req = self._pop_posted(src, tag)
                if req is not None:
                    return req
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.closed or self.aborted is not None \
                        or self._others_wait(src, tag):
                    return None
                if may_wait is None:
                    self.cond.wait(wait_limit(remaining))
                elif may_wait():
                    self.cond.wait(min(remaining, 1e-3))
                else:
                    return None

    def deliver(self, src: int, tag: int, data) -> None:
        """Hand over a complete message: into a receive posted meanwhile, else into the queue
        (a subgroup's abort notice: :meth:`abort_group`)."""
        if tag & _LOW == GROUP_ABORT_TAG and tag >> GROUP_TAG_SHIFT:
            self.abort_group(tag >> GROUP_TAG_SHIFT, src, bytes(data).decode("utf-8", "replace"))
            return
        key = (src, tag)
        with self.cond:
            req = self._pop_posted(src, tag)
            if req is None:
                self.unexpected.setdefault(key, deque()).append(data)
                self.arrivals.setdefault(tag, deque()).append(src)
                self.cond.notify_all()
                return
        self.fill(req, data)

    def fill(self, req: PostedRecv, data) -> None:
        if len(data) != len(req.view):
            req.fail(size_mismatch("recv", req.source, self.rank, req.tag, len(req.view),
                                   len(data)))
            return
        copy_into(req.view, data)
        req.complete()


__all__ = ["ANY_SOURCE", "CLOSED_CLEANLY", "Mailbox", "PostedRecv",
           "copy_into"]
