"""Elastic jobs: keep training while ranks come and go, without restarting anyone.

Under ``ferrorun --nproc MIN:MAX`` (or ``--nnodes MIN:MAX``) each rank calls :func:`join`
instead of ``init_from_env``; the :class:`ElasticJob` it returns holds this rank's membership
in the job's current *generation* (ranks, world size, a backend) as the job's coordinator
(``ferro_backend.launch.coordinator``) decided it:

* when a collective fails because a rank died (``PeerClosedError``, ``PeerAbortedError``,
  ``CollectiveTimeoutError``), every survivor calls :meth:`ElasticJob.rebuild` with the last
  step it completed; once every living member has, the coordinator forms the next generation
  from them (a quorum of the living, never a timeout guess) and each gets a fresh backend;
* a replacement rank (ferrorun starts one per failure, up to ``--max-restarts``) joins by
  calling :func:`join`; the members see :meth:`ElasticJob.pending` and, agreeing on it at a
  step boundary, rebuild to take it in;
* the new generation says which rank holds the most advanced state (``ElasticJob.source``, at
  ``ElasticJob.step``): the others copy it from that rank (``ferro_collective.elastic.ElasticState``
  does the agreement and the copy).

Under ``FERRO_TRACE`` (``ferrorun --trace DIR``) each process writes one timeline for the whole
job, ``DIR/rank_<member id>.json`` (its rank changes with the generation, its member id does
not), with every generation's collectives and point-to-point calls; ferrorun merges the files.

What it guarantees: no process restarts and no checkpoint is read while at least MIN members
live; every rank of a generation continues from the same step with the same state. What it
does not: a job whose coordinator's node (ferrorun's node 0) dies ends; a rank that is fenced
(silent past the settle time, e.g. stopped) cannot come back into the job.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from typing import Any

from . import settings, timeline
from .base import Backend
from .errors import DistributedError, LauncherError, RendezvousError
from .joining.meet import build, choose_transport, node_key
from .launch.coordinator import MAX_LINE, mac, send_line
from .mesh.rendezvous import listen


class ElasticError(LauncherError):
    """The elastic job cannot go on: fewer members than its minimum, this rank was fenced, or
    the coordinator is gone or refused this rank."""


class JobFinishedError(ElasticError):
    """This rank (a replacement) arrived after the job finished: nothing is left to do.

    :func:`join` raises it; the script should exit 0 on it (ferrorun counts a rank that exits
    with it unhandled as failed)."""


class _Member:
    """What :func:`ferro_backend.timeline.start_from_env` traces for an elastic member
    (``FERRO_TRACE``): the process's one file for the whole job, ``rank_<member id>.json``
    (ranks change between generations, the id does not), written when the job closes, the
    process exits or SIGTERM ends it. Each generation's backend is traced on its own
    (``timeline._wrap_p2p``); this stand-in carries no calls."""

    def __init__(self, member_id: int) -> None:
        self.rank = member_id
        self._closing: list = []

    def _no_calls(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("elastic: the trace's stand-in backend carries no calls")

    send = recv = irecv = _no_calls

    def on_close(self, callback) -> None:
        self._closing.append(callback)

    def close(self) -> None:
        for callback in self._closing:
            callback()


class ElasticJob:
    """This rank's membership of an elastic job (made by :func:`join`).

    Parameters
    ----------
    address : str
        ``"host:port"`` of the job's coordinator (``FERRO_ELASTIC``).
    token : str
        The job's secret (``FERRO_TOKEN``).
    node : str, optional
        This rank's node key.
    join_timeout : float, default 120.0
        Seconds to wait to be taken into a generation.
    **backend_kwargs
        Keyword arguments of each generation's backend constructor.

    Attributes
    ----------
    backend : Backend
        The current generation's backend (a new object after every :meth:`rebuild`).
    generation : int
        The generation's number (0 for the first).
    member_id : int
        This rank's id for the whole job (ranks change between generations, ids do not).
    step : int
        The step the generation continues from: the highest one a member completed (-1: no
        member holds state, load a checkpoint).
    source : int or None
        The rank (in this generation) that holds the state at ``step``.
    history : list of dict
        Every generation this rank saw: ``generation``, ``world_size``, ``step``, ``reason``.
    """

    def __init__(self, address: str, token: str, *, node: str | None = None,
                 join_timeout: float = 120.0, **backend_kwargs: Any) -> None:
        if not isinstance(token, str):  # (else the hello's HMAC fails, past the connect)
            raise TypeError(f"ElasticJob: token must be a str, got {type(token).__name__}")
        host, _, port = address.rpartition(":")
        self._host = host.strip("[]")
        self._timeout = join_timeout
        self._kwargs = backend_kwargs
        self._node = node or node_key(settings.NODE_ID.get())
        self._buf = b""
        self._pending = False
        self.backend: Backend | None = None
        self.generation = -1
        self.step = -1
        self.source: int | None = None
        self.history: list[dict[str, Any]] = []
        self._traced: _Member | None = None
        self._untrace = _nothing
        trace_dir = settings.TRACE.get()
        if trace_dir is not None and not timeline.active():
            timeline.check_env_dir(trace_dir)  # a path that cannot be written: said at once
        try:
            self._sock = socket.create_connection((self._host, int(port)),
                                                  timeout=join_timeout)
        except OSError as exc:
            raise ElasticError(f"elastic: cannot reach the job's coordinator at {address}: "
                               f"{exc}") from exc
        self._sock.settimeout(None)
        challenge = self._read("challenge")
        listener, addr = self._listener()
        send_line(self._sock, {"op": "hello", "mac": mac(token, challenge["nonce"]),
                               "node": self._node, "pid": os.getpid(), "addr": addr})
        self.member_id = int(self._read("welcome")["id"])
        if trace_dir is not None and not timeline.active():
            self._traced = _Member(self.member_id)
            timeline.start_from_env(self._traced, trace_dir)
            timeline._name = f"member {self.member_id}"  # its rank changes with the generation
        self._enter(listener)

    # ------------------------------------------------------------------ public
    @property
    def rank(self) -> int:
        """This rank in the current generation (-1 between generations)."""
        return self.backend.rank if self.backend is not None else -1

    @property
    def world_size(self) -> int:
        """The current generation's number of ranks (0 between generations)."""
        return self.backend.world_size if self.backend is not None else 0

    def pending(self) -> bool:
        """True when a newcomer waits to be taken in (this rank's view, without blocking): the
        members must agree on it at one step boundary (``ElasticState.should_rebuild``) and
        then all call :meth:`rebuild`.

        Returns
        -------
        bool
        """
        if not self._pending:
            self._take_buffered()  # a line that came in the same read as the generation's
        if not self._pending:
            ready, _, _ = select.select([self._sock], [], [], 0)
            if ready:
                self._drain()
        return self._pending

    def rebuild(self, step: int, reason: str | None = None) -> None:
        """Leave this generation and join the next one: ``step`` is the last step this rank
        completed (-1 if it holds no state). ``reason`` (the error that ended the generation)
        makes this rank abort its old backend, so peers still blocked in it wake at once.

        Parameters
        ----------
        step : int
        reason : str, optional

        Raises
        ------
        ElasticError
            The job cannot go on.
        """
        old, self.backend = self.backend, None
        self._untrace()
        self._untrace = _nothing
        if old is not None:
            try:
                old.abort(reason) if reason is not None else old.close()
            except Exception:  # a backend already broken by the failure: nothing to release
                pass
        listener = self._ready(step, reason)
        self._pending = False
        self._enter(listener, int(step))

    def close(self) -> None:
        """This rank is done (the job finished): tell the coordinator, release the backend."""
        try:
            send_line(self._sock, {"op": "done"})
        except OSError:
            pass
        self._untrace()
        self._untrace = _nothing
        try:
            if self.backend is not None:
                self.backend.close()
                self.backend = None
        finally:
            self._sock.close()
            if self._traced is not None:  # FERRO_TRACE: the member's file, now
                self._traced.close()

    def __enter__(self) -> ElasticJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _ready(self, step: int, why: str | None) -> socket.socket:
        """Tell the coordinator this rank is ready for the next generation (``step``: the last
        it completed); the listener it offers for that generation's rendezvous."""
        listener, addr = self._listener()
        try:
            send_line(self._sock, {"op": "ready", "step": int(step), "addr": addr})
        except OSError as exc:
            listener.close()
            raise ElasticError(f"elastic: member {self.member_id}: the coordinator is gone "
                               f"({exc}){'' if why is None else f'; {why}'}") from exc
        return listener

    def _listener(self) -> tuple[socket.socket, str]:
        """A fresh listener for the next generation's rendezvous (used if this rank becomes its
        rank 0): loopback when the coordinator is on loopback, else every interface."""
        loop = self._host.startswith("127.") or self._host in ("localhost", "::1")
        lsock = listen("127.0.0.1" if loop else "0.0.0.0", 0, 0, 1024)
        ip = "127.0.0.1" if loop else self._sock.getsockname()[0]
        return lsock, f"{ip}:{lsock.getsockname()[1]}"

    def _enter(self, listener: socket.socket, step: int = -1) -> None:
        """Wait for the coordinator's next generation and build its backend. A generation
        that breaks while it forms (a member lost during its rendezvous: a handshake or the
        engine segment's hand-over refused) is left as a failed one is: this rank tells the
        coordinator it is ready again (``step``: the last it completed) and waits for the
        next generation."""
        while True:
            try:
                msg = self._read("generation")
                rank, world = int(msg["rank"]), int(msg["world"])
                nodes = [str(n) for n in msg["nodes"]]
                transport = choose_transport(settings.TRANSPORT.get(), len(set(nodes)) == 1,
                                             f"generation {msg['generation']} spans "
                                             f"{len(set(nodes))} nodes")
                if rank != 0:
                    listener.close()
                try:
                    backend = build(transport, rank, world, msg["addr"], dict(self._kwargs),
                                    listener if rank == 0 else None)
                    break
                except (DistributedError, OSError) as exc:
                    listener.close()
                    listener = self._ready(step, f"generation {msg['generation']} broke while "
                                                 f"it formed: {exc}")
            except BaseException:
                listener.close()
                raise
        backend.nodes = tuple(nodes)
        if transport == "tcp" and len(set(nodes)) > 1 and settings.HIERARCHY.get():
            from .hierarchy import attach_hierarchy
            attach_hierarchy(backend)
        if self._traced is not None and timeline.active():
            self._untrace = timeline._wrap_p2p(backend)
        self.backend = backend
        self._pending = False  # a newcomer announced before this generation is in it now
        self.generation, self.step = int(msg["generation"]), int(msg["step"])
        self.source = None if msg["source"] is None else int(msg["source"])
        self.history.append({"generation": self.generation, "world_size": world,
                             "step": self.step, "reason": msg["reason"]})

    def _read(self, want: str) -> dict[str, Any]:
        """The next message other than ``pending``, which must be ``want``."""
        deadline = time.monotonic() + self._timeout
        while True:
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                ready, _, _ = select.select([self._sock], [], [], max(0.0, left))
                if not ready:
                    raise ElasticError(f"elastic: member {getattr(self, 'member_id', '?')}: "
                                       f"no {want!r} from the coordinator at {self._host} in "
                                       f"{self._timeout:g} s (FERRO_ELASTIC_TIMEOUT): it is "
                                       "stopped or unreachable, or its node is gone")
                self._recv()
            msg = self._take()
            if msg is None:
                continue
            if msg.get("op") != want:
                raise RendezvousError(f"elastic: expected {want!r} from the coordinator, got "
                                      f"{msg.get('op')!r}")
            return msg

    def _recv(self) -> None:
        chunk = self._sock.recv(65536)
        if not chunk:
            raise ElasticError("elastic: the job's coordinator closed the connection (ferrorun "
                               "ended or its node is gone)")
        self._buf += chunk
        if len(self._buf) > MAX_LINE:
            raise RendezvousError("elastic: the coordinator sent an over-long line")

    def _take(self) -> dict[str, Any] | None:
        """The next line's message; None for ``pending`` (noted); the coordinator's verdicts
        (failed, fenced, refused) raised as errors."""
        line, self._buf = self._buf.split(b"\n", 1)
        msg = json.loads(line)
        op = msg.get("op")
        if op == "pending":
            self._pending = True
            return None
        if op == "refused" and msg.get("finished"):
            raise JobFinishedError(f"elastic: {msg.get('why')}: this rank has nothing to do")
        if op in ("failed", "fenced", "refused"):
            why = msg.get("why", "this rank was silent past the settle time and was excluded")
            raise ElasticError(f"elastic: member {getattr(self, 'member_id', '?')}: the "
                               f"coordinator says {op}: {why}")
        return msg

    def _drain(self) -> None:
        """Take what arrived, without blocking (between generations only verdicts and
        ``pending`` come)."""
        self._recv()
        self._take_buffered()

    def _take_buffered(self) -> None:
        """Take the complete lines already received (between generations only verdicts and
        ``pending`` come)."""
        while b"\n" in self._buf:
            msg = self._take()
            if msg is not None:
                raise RendezvousError(f"elastic: unexpected {msg.get('op')!r} from the "
                                      "coordinator during a generation")


def _nothing() -> None:
    pass


def join(**backend_kwargs: Any) -> ElasticJob:
    """Join the elastic job ferrorun started this rank in (``FERRO_ELASTIC`` names its
    coordinator, ``FERRO_TOKEN`` the secret); blocks until this rank is in a generation.
    Keyword arguments go to each generation's backend constructor. Under ``FERRO_TRACE``
    (``ferrorun --trace DIR``) the process's timeline, every generation's, is written to
    ``DIR/rank_<member id>.json`` when the job closes or the process exits.

    Parameters
    ----------
    **backend_kwargs
        Keyword arguments of each generation's backend constructor.

    Returns
    -------
    ElasticJob

    Raises
    ------
    JobFinishedError
        This rank is a replacement (ferrorun starts one per failure) that arrived after the
        members finished: the job succeeded and nothing is left to do. Catch it and exit 0,
        else ferrorun counts this rank as failed and exits 1. A subclass of ElasticError.
    ElasticError
        Not started by ``ferrorun --nproc MIN:MAX`` / ``--nnodes MIN:MAX``, the coordinator is
        unreachable, or the job cannot go on.
    SettingError
        ``FERRO_TRACE`` is a file or a directory that cannot be created or written.

    Examples
    --------
    >>> try:                               # doctest: +SKIP
    ...     job = join()
    ... except JobFinishedError:           # a replacement that came after the end
    ...     raise SystemExit(0)
    >>> job.backend.rank, job.world_size   # doctest: +SKIP
    (0, 4)
    """
    address = settings.ELASTIC.get()
    token = settings.TOKEN.get()
    if address is None or token is None:
        raise ElasticError("elastic.join: FERRO_ELASTIC and FERRO_TOKEN are unset: start the "
                           "job with ferrorun --nproc MIN:MAX (or --nnodes MIN:MAX)")
    timeout = settings.TIMEOUT.get()
    if timeout is not None:
        backend_kwargs.setdefault("timeout", timeout)
    return ElasticJob(address, token, join_timeout=settings.ELASTIC_TIMEOUT.get(),
                      **backend_kwargs)


__all__ = ["ElasticError", "ElasticJob", "JobFinishedError", "join"]
