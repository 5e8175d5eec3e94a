"""The membership of an elastic job (``ferrorun --nproc MIN:MAX``, ``--nnodes MIN:MAX``).

One :class:`Coordinator` per job (ferrorun runs it on node 0, beside the rendezvous) keeps
who is in the job. Every rank holds one connection to it for its whole life (JSON lines,
HMAC-authenticated with the job's token); the connection is the liveness signal: a rank that
dies, even by SIGKILL, or whose node dies, closes it, and the coordinator knows at once.

A *generation* is one membership: its ranks, world size and rendezvous address. It changes
only by a quorum of the living, never by a timeout guess:

* a member whose collectives failed (or that agreed, with every other member, to take a
  waiting replacement in at a step boundary) sends ``ready`` with its completed step and the
  address of a fresh listener, and waits;
* the coordinator decides once **every living member of the generation is ready** (the dead
  closed their connections); a member that stays silent past ``settle`` seconds (stopped, or
  cut off from the network) is fenced: excluded, and told so if it ever speaks again;
* the new generation is the ready members in their old order, then waiting newcomers (up to
  ``max_members``); while they are fewer than ``min_members`` the coordinator waits up to
  ``settle`` seconds for newcomers, and longer, up to ``join_deadline`` seconds, while a
  replacement ferrorun has started is on its way (an agent says so: :meth:`Coordinator.expect`
  on node 0, :func:`announce_replacement` from another node); then it ends the job for all
  (``failed``). Its step is
  the highest step a member completed, and its ``source`` the first rank holding it: the
  state every other rank copies from (``ferro_collective.elastic``).

The first generation forms when ``expected`` members are here, or ``min_members`` are and
``last_call`` seconds have passed (torchelastic's rule). See ``ferro_backend.elastic``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: the most bytes one JSON line may take (a hostile or broken peer cannot grow a buffer)
MAX_LINE = 1 << 16
PURPOSE = b"ferro-elastic-v1"


def mac(token: str, nonce: str) -> str:
    """The proof a member sends for the coordinator's ``nonce``."""
    return hmac.new(token.encode(), PURPOSE + nonce.encode(), hashlib.sha256).hexdigest()


def send_line(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(json.dumps(msg, separators=(",", ":")).encode() + b"\n")


@dataclass
class _Member:
    sock: socket.socket
    buf: bytes = b""
    id: int = -1                 # -1 until authenticated
    nonce: str = ""
    node: str = ""
    pid: int = 0
    status: str = "new"          # new, waiting (for a generation), active, done, gone
    step: int = -1               # completed step it reported (-1: holds no state)
    addr: str = ""               # its listener for the next generation
    since: float = field(default_factory=time.monotonic)


class Coordinator:
    """Serve one elastic job's membership on ``host:port`` (port 0: a free one) in a thread.

    ``unseen_deaths`` (optional; ferrorun on node 0 passes it): called, from the coordinator's
    thread, before it ends the job for too few members; True while a process of this node's
    agent has ended that the agent has not yet looked at (it may start a replacement and call
    :meth:`expect`): the job waits for the agent's look rather than race it.
    """

    def __init__(self, token: str, min_members: int, max_members: int, expected: int, *,
                 host: str = "127.0.0.1", port: int = 0, settle: float = 30.0,
                 last_call: float = 10.0, join_deadline: float = 60.0,
                 unseen_deaths: Callable[[], bool] | None = None) -> None:
        if not 1 <= min_members <= max_members or not min_members <= expected <= max_members:
            raise ValueError(f"Coordinator: need 1 <= min ({min_members}) <= expected "
                             f"({expected}) <= max ({max_members})")
        self.token, self.min, self.max, self.expected = token, min_members, max_members, expected
        self.settle, self.last_call, self.join_deadline = settle, last_call, join_deadline
        self.unseen_deaths = unseen_deaths
        #: when each replacement an agent announced stops being waited for (oldest first)
        self._coming: list[float] = []
        self._lsock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host
                                           else socket.AF_INET, backlog=max(64, max_members))
        self.address = f"{host}:{self._lsock.getsockname()[1]}"
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._lsock, selectors.EVENT_READ)
        self._members: dict[socket.socket, _Member] = {}
        self._next_id = 0
        self.generation = -1
        self.current: list[_Member] = []
        self.history: list[dict[str, Any]] = []   # one entry per generation formed
        self.failed: str | None = None
        self.finished = False
        self._min_reached: float | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="ferro-elastic", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the loop
    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for m in list(self._members.values()):
            m.sock.close()
        self._lsock.close()
        self._sel.close()

    def snapshot(self) -> dict[str, Any]:
        """What the coordinator knows now (for ferrorun and tests)."""
        with self._lock:
            return {"generation": self.generation, "failed": self.failed,
                    "finished": self.finished, "history": list(self.history),
                    "members": {m.id: m.status for m in self._members.values() if m.id >= 0}}

    def expect(self) -> None:
        """A replacement is starting (ferrorun on this node started it): below the minimum,
        the job waits for it up to ``join_deadline`` seconds instead of ``settle``."""
        with self._lock:
            self._coming.append(time.monotonic() + self.join_deadline)

    def _awaited(self, now: float) -> bool:
        """Whether an announced replacement may still come."""
        self._coming = [t for t in self._coming if t > now]
        return bool(self._coming)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(0.05):
                if key.fileobj is self._lsock:
                    self._accept()
                else:
                    self._read(self._members[key.fileobj])
            with self._lock:
                self._decide()

    def _accept(self) -> None:
        try:
            sock, _ = self._lsock.accept()
        except OSError:
            return
        m = _Member(sock, nonce=secrets.token_hex(16))
        self._members[sock] = m
        self._sel.register(sock, selectors.EVENT_READ)
        try:
            send_line(sock, {"op": "challenge", "nonce": m.nonce})
        except OSError:
            self._drop(m)

    def _read(self, m: _Member) -> None:
        try:
            chunk = m.sock.recv(65536)
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(m)
            return
        m.buf += chunk
        while b"\n" in m.buf:
            line, m.buf = m.buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
                if not isinstance(msg, dict):
                    raise ValueError("not an object")
            except ValueError:
                self._drop(m)
                return
            with self._lock:
                self._handle(m, msg)
            if m.sock not in self._members:
                return
        if len(m.buf) > MAX_LINE:
            self._drop(m)

    def _drop(self, m: _Member) -> None:
        """The connection closed: a member that had not said ``done`` is gone."""
        self._close(m)
        with self._lock:
            if m.status != "done":
                m.status = "gone"

    def _tell(self, m: _Member, msg: dict[str, Any]) -> None:
        try:
            send_line(m.sock, msg)
        except OSError:
            pass  # its reader sees the closed connection

    # ------------------------------------------------------------------ messages
    def _handle(self, m: _Member, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if m.id < 0:
            if op not in ("hello", "coming") or not hmac.compare_digest(
                    str(msg.get("mac", "")), mac(self.token, m.nonce)):
                self._tell(m, {"op": "refused", "why": "authentication failed (FERRO_TOKEN)"})
                m.status = "done"
                self._close(m)
                return
            if op == "coming":  # an agent on another node started a replacement
                self._coming.append(time.monotonic() + self.join_deadline)
                self._tell(m, {"op": "noted"})
                m.status = "done"
                self._close(m)
                return
            if self.failed or self.finished:
                self._tell(m, {"op": "refused", "why": self.failed or "the job has finished",
                               "finished": self.failed is None})
                m.status = "done"
                self._close(m)
                return
            m.id, self._next_id = self._next_id, self._next_id + 1
            m.node, m.pid = str(msg.get("node", "")), int(msg.get("pid", 0))
            m.addr, m.step, m.status, m.since = str(msg.get("addr", "")), -1, "waiting", \
                time.monotonic()
            self._tell(m, {"op": "welcome", "id": m.id})
            if self.generation >= 0:  # a replacement: the members take it in at a step boundary
                if self._coming:
                    self._coming.pop(0)  # (the one announced first has come)
                self._announce()
            return
        if op == "ready" and m.status in ("active", "waiting"):
            m.step, m.addr = int(msg.get("step", -1)), str(msg.get("addr", ""))
            m.status, m.since = "waiting", time.monotonic()
        elif op == "done":
            m.status = "done"
            self.finished = True

    def _announce(self) -> None:
        """Tell the members that a newcomer waits, if the job has room for it."""
        if len(self.current) < self.max:
            for other in self.current:
                if other.status == "active":
                    self._tell(other, {"op": "pending"})

    def _close(self, m: _Member) -> None:
        if m.sock in self._members:
            self._sel.unregister(m.sock)
            del self._members[m.sock]
        m.sock.close()

    # ------------------------------------------------------------------ decisions
    def _decide(self) -> None:
        if self.failed or self.finished and not any(
                m.status == "active" for m in self.current):
            return
        now = time.monotonic()
        newcomers = sorted((m for m in self._members.values()
                            if m.status == "waiting" and m not in self.current),
                           key=lambda m: m.id)
        if self.generation < 0:
            if len(newcomers) >= self.min and self._min_reached is None:
                self._min_reached = now
            if len(newcomers) >= self.expected or (
                    self._min_reached is not None and now - self._min_reached > self.last_call):
                self._form(newcomers[:self.max], "start")
            return
        living = [m for m in self.current if m.status in ("active", "waiting")]
        ready = [m for m in living if m.status == "waiting"]
        lost = len(self.current) - len(living) - sum(m.status == "done" for m in self.current)
        if not ready:
            if lost and not living and newcomers:   # nobody left to agree: newcomers carry on
                self._form(newcomers[:self.max], "every member lost")
            elif lost and not living:
                self._fail(f"every member of generation {self.generation} is gone")
            return
        silent = [m for m in living if m.status == "active"]
        oldest = min(m.since for m in ready)
        if silent:
            if now - oldest <= self.settle:
                return
            for m in silent:   # stopped or cut off: excluded, and told if it ever reads
                self._tell(m, {"op": "fenced", "generation": self.generation})
                m.status = "gone"
        reason = "a member failed" if lost or silent else "members joined"
        members = ready + newcomers[:max(0, self.max - len(ready))]
        if len(members) < self.min and (now - oldest <= self.settle or (
                self._awaited(now) and now - oldest <= self.join_deadline)):
            return   # too few for now: a replacement may be (or is) on its way
        if len(members) < self.min and self.unseen_deaths is not None and self.unseen_deaths():
            return   # the agent has yet to see a death; it may announce a replacement (expect)
        self._form(members, reason)

    def _form(self, members: list[_Member], reason: str) -> None:
        if len(members) < self.min:
            self._fail(f"{len(members)} members left, fewer than the minimum {self.min}")
            return
        self.generation += 1
        self.current = members
        best = max(m.step for m in members)
        source = next(i for i, m in enumerate(members) if m.step == best) if best >= 0 else None
        nodes = [m.node for m in members]
        self.history.append({"generation": self.generation, "world_size": len(members),
                             "step": best, "reason": reason, "members": [m.id for m in members]})
        for rank, m in enumerate(members):
            m.status = "active"
            m.since = time.monotonic()
            self._tell(m, {"op": "generation", "generation": self.generation, "rank": rank,
                           "world": len(members), "addr": members[0].addr, "nodes": nodes,
                           "step": best, "source": source, "reason": reason,
                           "members": [x.id for x in members]})
        if any(m.status == "waiting" for m in self._members.values()):
            self._announce()   # newcomers that did not fit, or came during the change

    def _fail(self, why: str) -> None:
        self.failed = why
        for m in self._members.values():
            if m.status in ("active", "waiting"):
                self._tell(m, {"op": "failed", "why": why})


def announce_replacement(address: str, token: str, timeout: float = 10.0) -> None:
    """Tell the coordinator at ``address`` that this node's agent started a replacement (so
    that, below the minimum, the job waits for it up to the coordinator's ``join_deadline``).

    Raises
    ------
    OSError
        The coordinator cannot be reached, or did not take the message within ``timeout``.
    """
    host, _, port = address.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
        buf = b""

        def line() -> dict[str, Any]:
            nonlocal buf
            while b"\n" not in buf:
                chunk = sock.recv(4096)
                if not chunk or len(buf) > MAX_LINE:
                    raise OSError(f"the coordinator at {address} closed the connection")
                buf += chunk
            raw, buf = buf.split(b"\n", 1)
            return json.loads(raw)

        challenge = line()
        send_line(sock, {"op": "coming", "mac": mac(token, str(challenge.get("nonce", "")))})
        answer = line()
        if answer.get("op") != "noted":
            raise OSError(f"the coordinator at {address} refused: {answer.get('why', answer)}")


__all__ = ["Coordinator", "announce_replacement", "mac", "send_line"]
