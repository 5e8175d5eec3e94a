"""A close wakes every thread of the rank waiting on what it closed: all waiters of one failed
receive raise its error (not only the first), and a closed SubBackend view ends the receives
its rank's threads wait in, as closing the root backend does."""

import threading
import time

import numpy as np
import pytest

from ferro_backend import SimulatedBackend, SubBackend
from ferro_backend.testing import run_processes

pytestmark = pytest.mark.timeout(120)


def _waiters_of_one_receive(b):
    """Rank 0: two threads wait on one ``irecv`` from rank 1, which never sends; the main
    thread closes the backend. Every waiter, and a later wait, raises PeerClosedError at once
    (the waiters' times are taken from the close, not from their start)."""
    if b.rank != 0:
        # stay open until rank 0 has closed (its close ends this receive), so that the close
        # the waiters see is rank 0's own, not this rank's (on a loaded host rank 0 may reach
        # its close seconds after this rank started)
        try:
            b.recv(np.empty(1), 0, tag=9, timeout=30)
        except Exception:  # (rank 0 closed)
            pass
        b.close()
        return None
    req = b.irecv(np.empty(4), 1, tag=3)
    got = {}

    def wait(name):
        try:
            req.wait(10)
            got[name] = "returned"
        except Exception as exc:  # (checked below)
            got[name] = (type(exc).__name__, time.monotonic())

    threads = [threading.Thread(target=wait, args=(f"t{i}",), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    closed = time.monotonic()
    b.close()
    for t in threads:
        t.join(15)
    for name in ("t0", "t1"):  # (how long after the close each raised)
        if isinstance(got.get(name), tuple):
            got[name] = (got[name][0], round(got[name][1] - closed, 1))
    t0 = time.monotonic()
    try:
        req.wait(10)
        later = "returned"
    except Exception as exc:  # (checked below)
        later = type(exc).__name__
    # (at once: well under its 10 s, with room for a loaded host's scheduling stalls)
    return got, later, time.monotonic() - t0 < 5.0, req.is_completed()


def _blocked_in_a_closed_view(b):
    """Rank 0: a thread waits in ``sub.recv`` from rank 1 (which never sends); the main thread
    closes the view. The thread raises PeerClosedError at once (it waited out its timeout)."""
    sub = SubBackend(b, [0, 1])
    if b.rank != 0:
        time.sleep(2.5)
        b.barrier(timeout=20)
        return None
    got = {}

    def blocked():
        try:
            sub.recv(np.empty(3), 1, tag=1, timeout=10)
            got["recv"] = "returned"
        except Exception as exc:  # (checked below)
            got["recv"] = (type(exc).__name__, time.monotonic())

    t = threading.Thread(target=blocked, daemon=True)
    t.start()
    time.sleep(0.3)
    closed = time.monotonic()
    sub.close()
    t.join(15)
    if isinstance(got.get("recv"), tuple):  # (how long after the close it raised)
        got["recv"] = (got["recv"][0], round(got["recv"][1] - closed, 1))
    b.barrier(timeout=20)  # (the parent goes on)
    return got


def _run(fn, transport):
    if transport == "threads":
        group = SimulatedBackend.create_group(2)
        out = [None, None]

        def rank(i):
            out[i] = fn(group[i])

        threads = [threading.Thread(target=rank, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for b in group:
            b.close()
        return out
    return run_processes(fn, 2, transport=transport, timeout=60)


@pytest.mark.parametrize("transport", ["threads", "tcp", "shm"])
def test_every_waiter_of_a_receive_a_close_failed_raises_at_once(transport):
    got, later, prompt, completed = _run(_waiters_of_one_receive, transport)[0]
    # each raised within 5 s of the close: far less than its 10 s wait, with room for a loaded
    # host's scheduling stalls
    for name in ("t0", "t1"):
        assert got[name][0] == "PeerClosedError" and got[name][1] < 5.0, got
    assert later == "PeerClosedError" and prompt, (later, prompt)
    assert completed


@pytest.mark.parametrize("transport", ["threads", "tcp", "shm"])
def test_a_closed_view_ends_the_receives_its_threads_wait_in(transport):
    got = _run(_blocked_in_a_closed_view, transport)[0]
    # within 5 s of the close: far less than its 10 s wait (room for a loaded host's stalls)
    assert got["recv"][0] == "PeerClosedError" and got["recv"][1] < 5.0, got
