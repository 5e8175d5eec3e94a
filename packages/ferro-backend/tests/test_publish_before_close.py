"""``Backend.publish_before_close``: close() and abort() first wait, a short bounded while, for
the threads registered with it (the collectives' refusals: their reason goes out before the
goodbye), never for the closing thread itself, and cost nothing when none is registered."""

import threading
import time

from ferro_backend import SubBackend
from ferro_backend.testing import run_ranks


def _thread(target):
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def test_close_waits_for_a_registered_sender_whose_message_then_arrives_first():
    def fn(b):
        if b.rank == 0:
            t = _thread(lambda: (time.sleep(0.3), b.send(b"why", 1, tag=5)))
            b.publish_before_close(t)
            b.close()  # (would say goodbye before the send without the wait)
            return "closed"
        buf = bytearray(3)
        b.recv(buf, 0, tag=5, timeout=20)
        return bytes(buf)

    assert run_ranks(fn, 2, timeout=60) == ["closed", b"why"]


def test_the_wait_is_bounded_and_skips_the_closing_thread():
    def fn(b):
        if b.rank == 1:
            return None
        stop = threading.Event()
        b.publish_before_close(_thread(lambda: stop.wait(30)))  # (never ends by itself)
        b.publish_before_close(threading.current_thread())  # (closing from it: no self-join)
        start = time.monotonic()
        b.finish_publishing(limit=0.3)
        waited = time.monotonic() - start
        start = time.monotonic()
        b.close()  # (nothing left registered: at once)
        stop.set()
        return waited, time.monotonic() - start

    (waited, closing), _ = run_ranks(fn, 2, timeout=60)
    assert 0.25 <= waited < 5 and closing < 1


def test_a_subgroup_registers_on_its_transport_too():
    def fn(b):
        sub = SubBackend(b, [0, 1])
        if b.rank == 0:
            t = _thread(lambda: (time.sleep(0.3), sub.send(b"sub", 1, tag=5)))
            sub.publish_before_close(t)
            b.close()  # (closing the parent waits for the view's sender)
            return "closed"
        buf = bytearray(3)
        sub.recv(buf, 0, tag=5, timeout=20)
        return bytes(buf)

    assert run_ranks(fn, 2, timeout=60) == ["closed", b"sub"]
