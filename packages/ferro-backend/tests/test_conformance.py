"""check_backend: ferro's transports pass it, and a transport that breaks a promise is named."""

import threading
import time

import pytest

from ferro_backend import Backend, ShmBackend, SimulatedBackend, SizeMismatchError, TcpBackend
from ferro_backend.testing import check_backend, free_port

pytestmark = pytest.mark.timeout(180)


def _socket_group(cls):
    def make(n):
        addr = f"127.0.0.1:{free_port()}"
        group = [None] * n

        def build(r):
            group[r] = cls(r, n, addr, timeout=30)

        threads = [threading.Thread(target=build, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(b is not None for b in group), "the group did not form"
        return group

    return make


def test_simulated_passes():
    check_backend(SimulatedBackend.create_group, world_sizes=(2, 3, 4))


@pytest.mark.parametrize("cls", [TcpBackend, ShmBackend])
def test_socket_backends_pass(cls):
    check_backend(_socket_group(cls), world_sizes=(1, 3))  # the 2-rank promises run in 3


class _SwallowsSizeErrors(SimulatedBackend):
    """A broken transport: a wrong-size message is dropped silently."""

    def recv(self, out, src, *, tag=0, timeout=None):
        try:
            super().recv(out, src, tag=tag, timeout=timeout)
        except SizeMismatchError:
            pass


def test_a_broken_promise_is_named():
    with pytest.raises(AssertionError, match="SizeMismatchError.*raised nothing"):
        check_backend(_SwallowsSizeErrors.create_group, world_sizes=(2,))


class _OnlyTheFive(Backend):
    """A transport with only what the protocol requires (the default irecv, a lazy receive),
    over a simulated rank."""

    def __init__(self, inner):
        self.inner = inner

    rank = property(lambda self: self.inner.rank)
    world_size = property(lambda self: self.inner.world_size)

    def send(self, data, dst, *, tag=0):
        self.inner.send(data, dst, tag=tag)

    def recv(self, out, src, *, tag=0, timeout=None):
        self.inner.recv(out, src, tag=tag, timeout=timeout)

    def close(self):
        self.inner.close()


def test_the_default_irecv_polls_the_receive_itself():
    """poll() on the default irecv makes the receive (0.3 looked at is_completed alone, which
    nothing sets: poll waited its whole timeout, and every collective on an outside transport
    stalled until half its deadline)."""
    a, b = (_OnlyTheFive(x) for x in SimulatedBackend.create_group(2))
    out = bytearray(3)
    req = b.irecv(out, 0, tag=4)
    t0 = time.monotonic()
    assert req.poll(0.05) is False and not req.is_completed()  # nothing sent yet
    a.send(b"abc", 1, tag=4)
    assert req.poll(10.0) is True and req.is_completed() and bytes(out) == b"abc"
    assert time.monotonic() - t0 < 5.0
    req.wait(1.0)  # completed: returns at once
    with pytest.raises(ValueError):
        b.irecv(bytearray(1), 0).poll(float("nan"))
    a.close()
    b.close()
