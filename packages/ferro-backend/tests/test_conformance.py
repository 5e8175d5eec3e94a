"""check_backend: ferro's transports pass it, and a transport that breaks a promise is named."""

import threading

import pytest

from ferro_backend import ShmBackend, SimulatedBackend, SizeMismatchError, TcpBackend
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
    check_backend(_socket_group(cls), world_sizes=(3,))  # the 2-rank promises run in it too


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
