"""Request.cancel: a pending receive ended from another thread (what a destroyed process group
does to its receives): its waiter raises the given error at once, and the message that comes
later goes to the next receive, on every transport."""

import threading
import time

import pytest

from ferro_backend import PeerClosedError, ShmBackend, SimulatedBackend, SubBackend, TcpBackend
from ferro_backend.engine import AVAILABLE as SAME_HOST_ENGINE
from ferro_backend.testing import free_port

pytestmark = pytest.mark.timeout(120)


def socket_pair(cls):
    addr, group = f"127.0.0.1:{free_port()}", [None, None]

    def build(r):
        group[r] = cls(r, 2, addr, timeout=60)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return group


MAKERS = {"simulated": lambda: SimulatedBackend.create_group(2, timeout=60),
          "tcp": lambda: socket_pair(TcpBackend)}
if SAME_HOST_ENGINE:
    MAKERS["shm"] = lambda: socket_pair(ShmBackend)


@pytest.mark.parametrize("transport", sorted(MAKERS))
def test_a_cancelled_receive_ends_its_wait_and_the_next_one_gets_the_message(transport):
    a, b = MAKERS[transport]()
    try:
        for sub in (False, True):  # on the transport and on a subgroup view of it
            x, y = (SubBackend(a, [0, 1]), SubBackend(b, [0, 1])) if sub else (a, b)
            req = y.irecv(bytearray(3), 0, tag=7)
            got = []

            def waiter(req=req, got=got):
                t0 = time.monotonic()
                try:
                    req.wait(60)
                except PeerClosedError as exc:
                    got.append((str(exc), time.monotonic() - t0))

            t = threading.Thread(target=waiter)
            t.start()
            time.sleep(0.3)  # the waiter is in its wait
            assert req.cancel(PeerClosedError("the group ended")) is True
            t.join(10)
            assert got and got[0][0] == "the group ended" and got[0][1] < 5, got
            assert req.cancel(PeerClosedError("again")) is False  # it has ended
            x.send(b"abc", 1, tag=7)
            nxt = bytearray(3)
            y.recv(nxt, 0, tag=7, timeout=30)
            assert bytes(nxt) == b"abc"
    finally:
        for g in (a, b):
            g.close()
