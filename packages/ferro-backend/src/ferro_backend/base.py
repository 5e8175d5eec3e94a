"""The ``Backend`` protocol: point-to-point messaging between the ranks of a job.

A backend moves raw bytes. Anything that exports the buffer protocol can be sent (``bytes``,
``bytearray``, ``memoryview``, C-contiguous numpy arrays), and anything ``np.asarray`` views as
a C-contiguous array without copying (a torch CPU tensor); ``recv`` fills a caller-allocated,
writable buffer whose length must equal the message's. Messages between one pair of ranks on one
``tag`` arrive in the order they were sent; different tags are independent streams.

Tags are integers in ``[0, 2**64)``. Plain user code uses ``[0, 2**31)``; ``[2**31, 2**32)`` is
kept for ferro's own layers (barrier, collectives), and the upper 32 bits carry the subgroup id of
a :class:`~ferro_backend.SubBackend`, so a subgroup's traffic can never be taken for its parent's.
"""

from __future__ import annotations

import abc
import threading
import time
from typing import Any

from .checks import as_recv_view, as_send_view, check_peer, check_rank, check_tag, check_timeout
from .errors import (
    CollectiveTimeoutError,
    InvalidRankError,
    PeerAbortedError,
    PeerClosedError,
    SizeMismatchError,
)
from .ranks import FixedRanks, describe_topology  # noqa: F401 - FixedRanks: re-exported
from .request import Request, _DoneRequest, _LazyRecv

DEFAULT_TIMEOUT: float = 60.0
"""Seconds a blocking call waits before :class:`CollectiveTimeoutError` (per backend, overridable)."""

USER_TAG_LIMIT = 1 << 31
"""Tags below this are free for user code; ``[2**31, 2**32)`` belongs to ferro's own layers."""
GROUP_TAG_SHIFT = 32
"""Subgroup ids live in the bits above this one (see :class:`SubBackend`)."""
BARRIER_TAG = (1 << 32) - 1
"""The tag the default :meth:`Backend.barrier` uses."""
PUBLISH_BEFORE_CLOSE_S = 2.0
"""At most this many seconds, :meth:`Backend.finish_publishing` (at the start of ``close`` and
``abort``) waits for what :meth:`Backend.publish_before_close` registered."""
_PUBLISHING_LOCK = threading.Lock()
GROUP_ABORT_TAG = (1 << 32) - 2
"""In a subgroup's tag space: its abort notice (:meth:`SubBackend.abort_group`), above every
collective's tags. Every ferro transport takes a message on such a tag (a subgroup id above
:data:`GROUP_TAG_SHIFT`, these low bits) for the notice: no other message may use one."""


class Backend(abc.ABC):
    """Transport-agnostic point-to-point messaging for the ranks of one job.

    Implementations provide :attr:`rank`, :attr:`world_size`, :meth:`send`, :meth:`recv`,
    :meth:`close` (which calls ``super().close()``) and :meth:`abort`; :meth:`barrier`,
    :meth:`irecv` and :meth:`isend` have default implementations on top of those, and
    :meth:`peer_failure` reports this backend closed or aborted once ``super().close()`` (or the
    default :meth:`abort`) recorded it. The default :meth:`abort` tells no peer the reason: it
    records the abort and closes the backend, so peers see what the transport's :meth:`close`
    shows them (``PeerClosedError``), not ``PeerAbortedError``; a transport implements it to keep
    the contract (``ferro_backend.testing.check_backend`` checks it). A backend is a context
    manager: leaving the ``with`` block closes it, and leaving it with an exception first
    aborts, so peers stop waiting for this rank.
    """

    #: the one default deadline, in seconds, of every blocking call on this backend: p2p
    #: receives, barriers, and every collective of the layers above (a per-call ``timeout=``
    #: wins). Setting it validates it (:func:`check_timeout`).
    _timeout: float = DEFAULT_TIMEOUT
    #: payload bytes this rank sent / received (transports that count them update these)
    bytes_sent: int = 0
    bytes_received: int = 0
    #: this backend's own end as ``Backend.close``/``Backend.abort`` recorded it:
    #: ``("closed", "")``, ``("aborted", reason)``, or None while it is up
    _ended: tuple[str, str] | None = None

    @property
    def timeout(self) -> float:
        """The default deadline, in seconds, of every blocking call on this backend (p2p
        receives, barriers, the collectives above); a per-call ``timeout=`` wins."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = check_timeout(value, f"{type(self).__name__}.timeout")

    def resolve_timeout(self, timeout: float | None, what: str = "timeout") -> float:
        """A per-call ``timeout`` validated, or this backend's :attr:`Backend.timeout` when None.

        Parameters
        ----------
        timeout : float or None
            Seconds (positive and finite), or None for :attr:`Backend.timeout`.
        what : str, default "timeout"
            How the error names the value (e.g. ``"recv: timeout"``).

        Returns
        -------
        float
            The deadline's length in seconds.

        Raises
        ------
        ValueError
            ``timeout`` is not a positive finite number (named by ``what``).
        """
        if timeout is None:
            return check_timeout(self.timeout, f"{type(self).__name__}.timeout")
        return check_timeout(timeout, what)

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This rank's index in the job, 0-based."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """The number of ranks in the job."""

    @abc.abstractmethod
    def send(self, data: Any, dst: int, *, tag: int = 0) -> None:
        """Send the bytes of ``data`` to rank ``dst`` on stream ``tag``.

        Returns once ``data`` may be reused. Raises :class:`InvalidRankError` for a bad ``dst``
        (or ``dst == rank``), :class:`PeerClosedError` if ``dst`` is gone (closed or died) or
        this backend is closed, :class:`PeerAbortedError` once an abort of ``dst`` (or of this
        rank) is known. ``tag`` is any integer in ``[0, 2**64)``: tags that differ only above
        bit 31 are separate streams (subgroups live there).

        Parameters
        ----------
        data, dst, tag
            A buffer-protocol object (bytes, C-contiguous array...); a rank; an int, default 0.
        """

    @abc.abstractmethod
    def recv(self, out: Any, src: int, *, tag: int = 0, timeout: float | None = None) -> None:
        """Fill the writable buffer ``out`` with the next message from ``src`` on ``tag``.

        Raises :class:`SizeMismatchError` if the message's length differs from ``len(out)`` in
        bytes, :class:`CollectiveTimeoutError` after ``timeout`` seconds (default:
        :attr:`Backend.timeout`), :class:`PeerClosedError`/:class:`PeerAbortedError` if ``src`` closed,
        died or aborted, or this backend is closed. Abort wins over data: once this rank knows
        ``src`` aborted, every receive from it raises :class:`PeerAbortedError` naming the
        reason, even where messages ``src`` sent before aborting are still queued (so no rank
        completes a collective another rank gave up on). A closed peer's queued messages are
        still delivered first.

        Parameters
        ----------
        out, src, tag, timeout
            A writable buffer; a rank; an int, default 0; seconds (float), optional.
        """

    def _send_view(self, data: Any, dst: int, tag: int) -> memoryview:
        """Validate a send's peer and tag; the bytes of ``data`` to send (for transports)."""
        try:
            check_peer("send", dst, self.rank, self.world_size, "dst")
        except InvalidRankError:
            self._raise_if_down("send")
            raise
        check_tag(tag)
        return as_send_view(data)

    def _recv_view(self, out: Any, src: int, tag: int) -> memoryview:
        """Validate a receive's peer and tag; the writable bytes of ``out`` (for transports)."""
        try:
            check_peer("recv", src, self.rank, self.world_size, "src")
        except InvalidRankError:
            self._raise_if_down("recv")
            raise
        check_tag(tag)
        return as_recv_view(out)

    def _raise_if_down(self, op: str) -> None:
        """Raise what a closed or aborted backend raises for ``op``, if this one is (it wins
        over a bad peer: every call on a closed backend raises PeerClosedError at once)."""
        failure = self.peer_failure(op, self.rank)
        if failure is not None:
            raise failure

    def irecv(self, out: Any, src: int, *, tag: int = 0) -> Request:
        """Post a receive into ``out`` and return at once; ``Request.wait`` completes it.

        Parameters
        ----------
        out : writable buffer
            Filled with the message; its length must equal the message's.
        src : int
            The sending rank.
        tag : int, default 0
            The stream the message travels on.

        Returns
        -------
        Request
            Its ``wait`` raises what :meth:`recv` would (``SizeMismatchError``, a timeout...).

        Raises
        ------
        InvalidRankError
            ``src`` is not a rank of this job.
        """
        check_rank(src, self.world_size, "irecv: src")
        return _LazyRecv(self, out, src, tag)

    def irecv_any(self, out: Any, *, tag: int = 0) -> Request:
        """Post a receive into ``out`` for the next message on ``tag`` from any other rank and
        return at once; once complete, ``Request.source`` names the sender.

        Receives match messages in the order they were posted: a message goes to the first
        posted receive for its source or for any rank, whichever was posted first. The
        receive fails with :class:`PeerClosedError` once every other rank is gone, with
        :class:`PeerAbortedError` on an abort, and :class:`SizeMismatchError` if the message's
        length differs from ``len(out)`` in bytes. Transports without it raise
        :class:`NotImplementedError` naming themselves (the default).

        Parameters
        ----------
        out : writable buffer
            Filled with the message.
        tag : int, default 0
            The stream to receive from.

        Returns
        -------
        Request
            Once complete, its ``source`` is the sender's rank.

        Raises
        ------
        NotImplementedError
            The transport does not receive from any source.
        """
        raise NotImplementedError(f"{type(self).__name__} does not receive from any source "
                                  f"(irecv_any): receive from a named rank")

    def recv_any(self, out: Any, *, tag: int = 0, timeout: float | None = None) -> int:
        """Fill ``out`` with the next message on ``tag`` from any other rank.

        Parameters
        ----------
        out : writable buffer
            Filled with the message.
        tag : int, default 0
            The stream to receive from.
        timeout : float, optional
            Seconds to wait (default: :attr:`Backend.timeout`).

        Returns
        -------
        int
            The sender's rank.

        Raises
        ------
        CollectiveTimeoutError
            No message within ``timeout``; otherwise as :meth:`irecv_any`.
        """
        limit = self.resolve_timeout(timeout, "recv_any: timeout")
        req = self.irecv_any(out, tag=tag)
        req.wait(limit)
        assert req.source is not None, f"{type(self).__name__}: a completed irecv_any names no source"
        return req.source

    def isend(self, data: Any, dst: int, *, tag: int = 0) -> Request:
        """Start a send. The default sends eagerly (ferro transports never block on receivers).

        Parameters
        ----------
        data : buffer
            What to send (bytes, memoryview, a C-contiguous numpy array...).
        dst : int
            The receiving rank.
        tag : int, default 0
            The stream the message travels on.

        Returns
        -------
        Request
            Complete once ``data`` may be reused; ``wait`` raises the send's error.
        """
        self.send(data, dst, tag=tag)
        return _DoneRequest()

    def barrier(self, *, timeout: float | None = None) -> None:
        """Block until every rank has entered the barrier (dissemination: ceil(log2 n) rounds).

        Parameters
        ----------
        timeout : float, optional
        """
        n, me = self.world_size, self.rank
        self._raise_if_down("barrier")  # (one rank has no round that would notice)
        deadline = time.monotonic() + self.resolve_timeout(timeout, "barrier: timeout")
        step, round_ = 1, 0
        token = bytearray(1)
        while step < n:
            self.send(bytes([round_]), (me + step) % n, tag=BARRIER_TAG)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveTimeoutError(
                    f"barrier: rank {me} timed out in round {round_} of {n} ranks"
                )
            try:
                self.recv(token, (me - step) % n, tag=BARRIER_TAG, timeout=remaining)
            except CollectiveTimeoutError:  # (in the barrier's words, naming the late rank)
                raise CollectiveTimeoutError(
                    f"barrier: rank {me} timed out in round {round_} of {n} ranks waiting "
                    f"for rank {(me - step) % n}") from None
            if token[0] != round_:
                raise SizeMismatchError(
                    f"barrier: rank {me} got round {token[0]} from rank {(me - step) % n}, "
                    f"expected round {round_}"
                )
            step <<= 1
            round_ += 1

    #: threads publishing this backend's messages that close/abort wait for (a short while)
    _publishing: tuple[threading.Thread, ...] = ()

    def publish_before_close(self, thread: threading.Thread) -> None:
        """Register ``thread`` (started) as one whose messages should go out before this
        backend's goodbye: :meth:`finish_publishing`, which ferro's transports call at the start
        of their :meth:`close` and :meth:`abort`, waits for it a short while. The collectives
        register the thread publishing a refused call's reason, so that a rank that refuses a
        call and then closes (its script ending on the error) still tells its peers why.

        Parameters
        ----------
        thread : threading.Thread
            A started thread that sends on this backend and ends by itself (by its deadline).
        """
        with _PUBLISHING_LOCK:
            self._publishing = tuple(t for t in self._publishing if t.is_alive()) + (thread,)

    def finish_publishing(self, limit: float = PUBLISH_BEFORE_CLOSE_S) -> None:
        """Wait, at most ``limit`` seconds in all, for the threads :meth:`publish_before_close`
        registered to end (never for the calling thread); nothing when none is registered.
        Transports call it at the start of :meth:`close` and :meth:`abort`, before the goodbye
        or abort notice; an outside transport may do the same.

        Parameters
        ----------
        limit : float, default 2.0 (``PUBLISH_BEFORE_CLOSE_S``)
            The most seconds it waits; the threads still running then go on (their sends
            meet the closed backend).
        """
        if not self._publishing:  # (the common case: nothing to wait for)
            return
        with _PUBLISHING_LOCK:
            pending, self._publishing = self._publishing, ()
        end = time.monotonic() + limit
        me = threading.current_thread()
        for thread in pending:
            if thread is not me:
                thread.join(max(0.0, end - time.monotonic()))

    def abort(self, reason: str) -> None:
        """Tell every peer that this rank failed: their pending and later receives from this
        rank raise :class:`PeerAbortedError` naming ``reason`` (even where this rank's earlier
        messages are queued), and every later call on this backend raises
        :class:`PeerClosedError` (or a subclass). Ferro's collectives call it when they time
        out or fail, so the peers stop waiting.

        Every transport must implement it. The default reaches no peer with the reason: it
        records the abort (:meth:`peer_failure` then reports it, so this rank's later calls
        raise) and calls :meth:`close`, so peers see only what the transport shows them of a
        closed rank (:class:`PeerClosedError`, not :class:`PeerAbortedError`).

        Parameters
        ----------
        reason : str
            Why, named in the peers' errors.
        """
        if self._ended is None:
            self._ended = ("aborted", str(reason))
        self.close()

    @abc.abstractmethod
    def close(self) -> None:
        """Release the transport. Idempotent. Every later call on this backend raises
        :class:`PeerClosedError`; so do the peers' sends to this rank and their receives from
        it (messages it sent before closing may still be delivered first).

        Implementations call ``super().close()``: it records this backend closed, so the
        default :meth:`peer_failure` reports it (the layers above ask it before a call, so
        collectives, even on one rank, raise :class:`PeerClosedError` after close).
        """
        if self._ended is None:
            self._ended = ("closed", "")

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            try:
                self.abort(f"{exc_type.__name__}: {exc}")
            except Exception:
                pass
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank={self.rank} world_size={self.world_size}>"

    # -- what a transport may offer beyond messages (declared here, with their defaults) -----
    #: the node (host) of every rank, index = rank, when known (``init_from_env`` sets it from
    #: the launcher's rendezvous); None: not known
    nodes: tuple[str, ...] | None = None
    #: the same-host engine of this group (:class:`ferro_backend.engine.Engine`), on which
    #: ferro-collective runs its collectives; None: messages only
    engine: Any = None
    #: a job on several nodes: its node and cross groups
    #: (:class:`ferro_backend.hierarchy.Hierarchy`); None: one level
    hierarchy: Any = None
    #: the modelled network a simulated job runs on (:class:`ferro_backend.netsim.Network`)
    network: Any = None

    def peer_failure(self, op: str, peer: int) -> BaseException | None:
        """The error an ``op`` involving ``peer`` must raise now (the job aborted, this backend
        closed, or ``peer`` is gone), or None. Ferro's layers ask it (``peer`` = this rank)
        before every collective. The default knows only this backend's own end, as recorded by
        ``Backend.close`` (reached through ``super().close()``) and the default :meth:`abort`:
        :class:`PeerAbortedError` after an abort, :class:`PeerClosedError` after close.
        Transports that track their peers' failures override it.

        Parameters
        ----------
        op : str
            The operation, for the error's message (e.g. ``"recv"``).
        peer : int
            The rank it involves.

        Returns
        -------
        BaseException or None
            The error to raise (not raised here), or None when ``peer`` may be used.
        """
        ended = self._ended
        if ended is None:
            return None
        me = self.rank
        if ended[0] == "aborted":
            return PeerAbortedError(f"{op}: rank {me} aborted: {ended[1]}", peer=me,
                                    reason=ended[1])
        return PeerClosedError(f"{op}: rank {me}'s backend is closed", peer=me)

    def link_transports(self) -> tuple[str, str]:
        """How this transport moves messages, in words; transports override it for
        :meth:`Backend.describe`.

        Returns
        -------
        tuple of str
            ``(within a node, between nodes)``.
        """
        name = type(self).__name__
        return name, name

    def describe(self) -> str:
        """The job's topology as this rank sees it: ranks per node and the transport of each
        kind of link (within a node, between nodes). ``init_from_env`` logs it once at INFO
        on rank 0.

        Returns
        -------
        str
            Several lines: the ranks per node and the transport of each kind of link.

        Examples
        --------
        >>> from ferro_backend import SimulatedBackend
        >>> print(SimulatedBackend.create_group(2)[0].describe())
        SimulatedBackend: 2 ranks on 1 node (this is rank 0)
          node 'this process': ranks 0-1
          links within a node: in-process (threads, one copy per message)
        """
        return describe_topology(self)
