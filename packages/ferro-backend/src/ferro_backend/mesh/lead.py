"""Who reads a TCP backend's sockets: its receive loop's thread, or a thread that waits.

Woken by the loop thread, a waiting receive costs two trips through the scheduler per message
(the loop thread out of ``epoll``, then the waiter, which must also take the GIL from it): a
16-byte ping-pong between two processes took 190 us here, where raw sockets take 21. So a
thread that waits for a receive (:meth:`Lead.drive`) takes the *lead*, the right to read the
sockets, and runs the loop's turns itself (delivering any frame, other threads' too), while
the loop thread steps aside: one trip through the scheduler per message. The loop thread takes
the sockets back once no thread has waited for :data:`HAND_BACK_S` (for unexpected messages
and receives nobody waits on yet), or at once when a send must wait for room in a socket
(:meth:`Lead.resume`: two ranks that both send large messages before they wait must each be
drained meanwhile). A receive completed another way (a route's delivery) wakes a thread that
leads (:meth:`Lead.nudge`): it waits in ``epoll``, not on the mailbox.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..mailbox import Mailbox, PostedRecv

#: seconds the loop thread leaves the sockets to the threads that wait on them after the last
#: such wait (a job's next call mostly starts within it)
HAND_BACK_S = 2e-3
#: seconds the loop thread sleeps at a time while a thread waits. It looks up rarely: each look
#: takes the GIL (a 64 MiB exchange of 4 emulated nodes ran 1.2-1.7 s against 1.2 s while it
#: looked every 2 ms) and a core (256 ranks on 2 cores: 3 allreduces and a barrier took 56 s
#: while each looked every 20 ms, 32-37 s with the loop thread reading). After the last wait it
#: may sleep this long before it reads: unexpected messages and failures then wait for it, or
#: for the next wait, which reads at once.
REST_S = 0.25
#: seconds of a waiting thread's turn at most. Whatever ends a wait early wakes it: a failure
#: (the mailbox's callbacks), a receive completed another way (:meth:`Lead.nudge`), a new
#: link or a posted receive of a parked frame (the reactor's wake-up), the loop's stop.
TURN_S = 1.0


class Lead:
    """The lead of one receive loop: :class:`~.reactor.Reactor` provides ``_turn(cap)`` (one
    turn of the loop: wait up to ``cap`` seconds, None: until something happens, then read),
    ``_serve(req, cap)`` (a turn for a thread that waits for ``req``), ``_wake()`` (out of
    ``epoll`` now) and ``_stop``, ``_draining``."""

    _stop: bool
    _draining: bool
    _turn: Callable[[float | None], None]
    _serve: Callable[[PostedRecv, float], None]
    _wake: Callable[[], None]

    def __init__(self, box: Mailbox, lock: threading.Lock) -> None:
        self.box = box
        #: held by the thread that reads the sockets: the loop thread or one that waits
        self._lead = threading.Lock()
        self._loop_leads = False  # the loop thread holds the lead (maybe asleep in epoll)
        self._leader, self._waiters = 0, 0  # the lead's thread (0: none); threads in drive()
        self._led_at = 0.0  # when a waiting thread last gave the lead back
        self._rest = threading.Condition(lock)  # where the loop thread stands aside

    def drive(self, req: PostedRecv, limit: float) -> None:
        """Wait up to ``limit`` seconds for ``req`` (0: one look), reading the sockets from
        this thread while no other waiting thread does (the loop thread steps aside). Returns
        when ``req`` is done, a turn saw a failure, or the time is up; the caller checks."""
        end = time.monotonic() + limit
        with self._rest:
            self._waiters += 1
        led = False
        try:
            led = self._lead.acquire(blocking=False)
            if not led and self._loop_leads and limit > 0:
                self._wake()  # the loop thread out of epoll: it steps aside
                led = self._lead.acquire(timeout=min(limit, 0.01))
            if not led and limit > 0 and not self._stop:
                # another waiting thread reads: it completes ours too, or says when it leaves.
                # Look again under the mailbox's lock (a leader leaves, then notifies under it)
                # rather than ask ``locked()``: a thread that has just taken the lock reads
                # unlocked until it holds the GIL again, up to a switch interval (5 ms), and a
                # thread that believed it spun through here thousands of times meanwhile
                with self.box.cond:
                    if not req._done:
                        led = self._lead.acquire(blocking=False)
                        if not led:
                            self.box.cond.wait(max(0.0, min(end - time.monotonic(), 0.01)))
            if not led or self._stop:
                if led:
                    self._lead.release()
                    led = False
                return
            self._leader = threading.get_ident()
            try:
                looked = False  # the receive may have completed while the lead changed hands
                while not (req._done or self._stop or self.box.failure("recv", req.src)):
                    left = end - time.monotonic()
                    if left <= 0 and looked:
                        return
                    self._serve(req, max(0.0, min(left, TURN_S)))
                    looked = True
            finally:
                self._led_at = time.monotonic()
                self._leader = 0
                self._lead.release()
        finally:
            with self._rest:
                self._waiters -= 1
                others = self._waiters
            # one of them may lead now. Only a thread that led says so: were every waiting
            # thread to wake the others as it left, with several waiting (async collectives in
            # flight at once) they would wake each other without end and starve the one that
            # reads (FSDP over TCP with 4 async workers ran 2-70x slower than with 1)
            if others and led:
                with self.box.cond:
                    self.box.cond.notify_all()

    def resume(self) -> None:
        """A send of this process waits for room in a socket: the loop thread reads meanwhile."""
        if self._led_at:
            self._led_at = 0.0
            with self._rest:
                self._rest.notify()

    def _aside_for(self) -> float | None:
        """Seconds the loop thread stands aside from now (None: it reads now): while a thread
        waits, :data:`REST_S` at a time; after, until :data:`HAND_BACK_S` has passed."""
        if self._draining:
            return None
        if self._waiters > 0:
            return REST_S
        left = self._led_at + HAND_BACK_S - time.monotonic()
        return left if left > 0 else None

    def nudge(self) -> None:
        """A receive completed by another way than the sockets (a route's delivery): the
        thread that leads looks up from epoll (it does not wait on the mailbox)."""
        if self._leader not in (0, threading.get_ident()):
            self._wake()
