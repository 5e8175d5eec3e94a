"""A receive posted in a rank's :class:`~ferro_backend.mailbox.Mailbox`, and one whose messages
a route moves only when asked (:class:`PumpedRecv`: a receive from any rank on a backend whose
same-host peers come through rings)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .base import Request
from .checks import check_timeout
from .errors import CollectiveTimeoutError

if TYPE_CHECKING:
    from .mailbox import Mailbox

#: the ``src`` of a receive posted for a message from any rank (``Backend.irecv_any``)
ANY_SOURCE = -1
#: seconds a waiting receive sleeps (or reads the sockets) before it looks at failures again
WAIT_SLICE_S = 1.0


class PostedRecv(Request):
    """A receive buffer waiting for its message."""

    __slots__ = ("_box", "src", "tag", "view", "_done", "_error", "source", "order")

    def __init__(self, box: Mailbox, src: int, tag: int, view: memoryview) -> None:
        self._box = box
        #: the rank posted for (:data:`ANY_SOURCE` for a receive from any rank)
        self.src = src
        self.tag = tag
        self.view = view
        self._done = False
        self._error: BaseException | None = None
        #: the rank whose message this receive took (known at once for a receive from one
        #: rank; for one from any rank, once a message is matched to it)
        self.source: int | None = None if src == ANY_SOURCE else src
        #: the mailbox's posting order (receives match in the order they were posted)
        self.order = 0

    # -- transport side -------------------------------------------------------------------
    def complete(self) -> None:
        box = self._box
        with box.cond:
            self._done = True
            box.cond.notify_all()
        if box.driver is not None:  # a waiter reading the sockets looks up
            box.driver.nudge()

    def fail(self, error: BaseException) -> None:
        box = self._box
        with box.cond:
            if not self._done:
                self._error = error
                self._done = True
                box.cond.notify_all()
        if box.driver is not None:
            box.driver.nudge()

    # -- caller side ----------------------------------------------------------------------
    def cancel(self, error: BaseException) -> bool:
        if not self._done and self._box.withdraw(self):
            self.fail(error)
            return True
        return False

    def is_completed(self) -> bool:
        if not self._done and self._box.driver is not None:
            self._box.driver.drive(self, 0.0)  # one look at the sockets (a polling loop reads)
        return self._done

    def poll(self, timeout: float = 0.0) -> bool:
        """Wait up to ``timeout`` seconds without giving up the receive: True once complete
        (then :meth:`wait` returns or raises at once), False if still pending. Raises the
        peer's failure, if any."""
        box = self._box
        deadline = time.monotonic() + check_timeout(timeout, "poll: timeout")
        driver = box.driver
        looked = driver is None  # with a driver, one look at the sockets even for poll(0)
        failed = None
        with box.cond:
            while not self._done:
                failure = box.failure("recv", self.src)
                if failure is not None and box._withdraw(self):
                    # the receive has failed for every waiter: another thread waiting on it, or
                    # a later wait/poll, raises the same error at once (they waited out their
                    # deadline, then a CollectiveTimeoutError)
                    self._error, self._done, failed = failure, True, failure
                    box.cond.notify_all()
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0 and looked:
                    return False
                if driver is None:
                    box.cond.wait(min(remaining, WAIT_SLICE_S))
                    continue
                box.cond.release()  # this thread reads the sockets while it waits
                try:
                    driver.drive(self, max(0.0, min(remaining, WAIT_SLICE_S)))
                finally:
                    box.cond.acquire()
                looked = True
        if failed is not None:
            if driver is not None:  # (a waiter reading the sockets looks up)
                driver.nudge()
            raise failed
        return True

    def wait(self, timeout: float | None = None) -> None:
        self.settle(self.poll, timeout)

    def settle(self, poll: Callable[[float], bool], timeout: float | None) -> None:
        """:meth:`wait` with ``poll`` (this request's, or that of a wrapper that drives the
        transport while it waits)."""
        limit = self._box.timeout() if timeout is None else check_timeout(timeout,
                                                                          "recv: timeout")
        if not poll(limit):
            self.expire(limit)
        if self._error is not None:
            raise self._error

    def expire(self, limit: float) -> None:
        """Give up a receive still pending after ``limit`` seconds: withdrawn (a later message
        goes to a later receive), CollectiveTimeoutError; nothing if it completed meanwhile."""
        box = self._box
        with box.cond:
            if not self._done:
                box._withdraw(self)
                who = "any rank" if self.src == ANY_SOURCE else f"rank {self.src}"
                raise CollectiveTimeoutError(
                    f"recv: rank {box.rank} waited {limit:g}s for a message from {who} (tag "
                    f"{self.tag}, {len(self.view)} bytes)")


class PumpedRecv(Request):
    """A receive from any rank on a backend some of whose peers come through a route that
    moves messages when asked (the same-host rings): waiting asks every route (``pumps``,
    none of which waits) between short sleeps on the mailbox."""

    __slots__ = ("_req", "_pumps")

    def __init__(self, req: PostedRecv, pumps: Sequence[Callable[[], None]]) -> None:
        self._req, self._pumps = req, tuple(pumps)

    @property
    def source(self) -> int | None:
        return self._req.source

    def _pump(self) -> None:
        for pump in self._pumps:
            pump()

    def cancel(self, error: BaseException) -> bool:
        return self._req.cancel(error)

    def is_completed(self) -> bool:
        if not self._req._done:
            self._pump()
        return self._req._done

    def poll(self, timeout: float = 0.0) -> bool:
        req = self._req
        deadline = time.monotonic() + check_timeout(timeout, "poll: timeout")
        pause = 5e-5
        while not req._done:
            self._pump()
            remaining = deadline - time.monotonic()
            if req.poll(max(0.0, min(pause, remaining))):
                return True
            if remaining <= 0:
                return False
            pause = min(pause * 2, 1e-3)
        return True

    def wait(self, timeout: float | None = None) -> None:
        self._req.settle(self.poll, timeout)


__all__ = ["ANY_SOURCE", "PostedRecv", "PumpedRecv"]
