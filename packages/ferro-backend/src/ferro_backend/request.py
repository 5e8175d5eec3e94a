"""A pending point-to-point operation (:class:`Request`), and the two requests the
:class:`~ferro_backend.Backend` protocol's defaults return."""

from __future__ import annotations

import abc
import time
from typing import TYPE_CHECKING, Any

from .checks import check_timeout
from .errors import CollectiveTimeoutError

if TYPE_CHECKING:
    from .base import Backend


class Request(abc.ABC):
    """A pending point-to-point operation, as returned by :meth:`Backend.irecv`/:meth:`Backend.isend`.

    A transport implements :meth:`wait` and :meth:`is_completed`; :meth:`poll` has a default
    built on those (a transport that can block efficiently overrides it).
    """

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until complete (at most ``timeout`` seconds; None: the backend's timeout) and
        raise what the operation raised; :class:`CollectiveTimeoutError` when time runs out.

        Parameters
        ----------
        timeout : float, optional
        """

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """Whether the operation is complete (then :meth:`wait` returns or raises at once).

        Returns
        -------
        bool
            True once complete, successfully or not.
        """

    def poll(self, timeout: float = 0.0) -> bool:
        """Wait up to ``timeout`` seconds for completion without giving the operation up.

        Never raises a timeout (it may raise the operation's own failure, e.g. a peer that is
        gone).

        Parameters
        ----------
        timeout : float, default 0.0
            Seconds to wait at most (0: just look).

        Returns
        -------
        bool
            True once complete, False if still pending.
        """
        deadline = time.monotonic() + check_timeout(timeout)
        pause = 1e-5
        while not self.is_completed():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 1e-3)
        return True

    def cancel(self, error: BaseException) -> bool:
        """End the operation now with ``error``, if it is still pending and its transport can
        take it back (a posted receive: withdrawn, so a later message goes to a later
        receive); its waiters then raise ``error`` at once.

        Parameters
        ----------
        error : BaseException
            What :meth:`wait` raises from now on.

        Returns
        -------
        bool
            True if it ended so; False if it had completed (or this transport cannot take it
            back: the default).
        """
        return False

    def test(self) -> bool:
        """Alias of :meth:`is_completed` (MPI's name).

        Returns
        -------
        bool
            True once complete, successfully or not.
        """
        return self.is_completed()

    #: the rank a completed receive's message came from (a receive from one rank: that rank;
    #: from any rank, :meth:`Backend.irecv_any`: the sender, once complete; else None)
    source: int | None = None


class _LazyRecv(Request):
    """Default ``irecv``: the receive happens in ``wait`` (enough for transports whose sends
    never block on the receiver, like every ferro transport)."""

    def __init__(self, backend: Backend, out: Any, src: int, tag: int) -> None:
        self._args = (backend, out, src, tag)
        self._done = False
        self.source = src

    def wait(self, timeout: float | None = None) -> None:
        if not self._done:
            backend, out, src, tag = self._args
            backend.recv(out, src, tag=tag, timeout=timeout)
            self._done = True

    def is_completed(self) -> bool:
        return self._done

    def poll(self, timeout: float = 0.0) -> bool:
        """The receive itself, for at most ``timeout`` seconds: True once it has completed,
        False if the message has not come (a transport's receive that times out takes
        nothing). Looking at :meth:`is_completed` alone would wait the whole ``timeout``:
        nothing completes a lazy receive but a call that makes it."""
        if self._done:
            return True
        backend, out, src, tag = self._args
        try:
            backend.recv(out, src, tag=tag, timeout=check_timeout(timeout))
        except CollectiveTimeoutError:
            return False
        self._done = True
        return True


class _DoneRequest(Request):
    def wait(self, timeout: float | None = None) -> None:
        if timeout is not None:  # (validated as every request's: NaN, negative -> ValueError)
            check_timeout(timeout, "isend: timeout")
        return None

    def is_completed(self) -> bool:
        return True
