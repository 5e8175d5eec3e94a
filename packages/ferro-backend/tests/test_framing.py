"""How a TCP link sends a frame: a large payload in calls of its own after the header (the
kernel copies one buffer per call at twice the speed of a header-and-payload pair), a small one
with its header in one call, and ``on_block`` only once the socket is full."""

import socket

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferro_backend.mesh import framing
from ferro_backend.mesh.framing import FRAME, HEADER_APART_FROM, K_DATA, Link


class FakeSocket:
    """Takes at most ``room`` bytes per call (then refuses once, as a full socket does)."""

    def __init__(self, room: int) -> None:
        self.room, self.calls, self.data, self.full = room, [], bytearray(), False

    def settimeout(self, _t):
        pass

    def fileno(self):
        return -1

    def setsockopt(self, *_a):
        pass

    def sendmsg(self, bufs, _anc=(), flags=0):
        if self.full and flags & socket.MSG_DONTWAIT:
            self.full = False
            raise BlockingIOError
        self.calls.append([len(b) for b in bufs])
        take = self.room
        for b in bufs:
            k = min(len(b), take)
            self.data += bytes(b[:k])
            take -= k
        sent = self.room - take
        self.full = sent < sum(len(b) for b in bufs)
        return sent


def send(room: int, payload: bytes) -> tuple[FakeSocket, int]:
    """The Python send loop on a fake socket (no descriptor: the compiled first call is off)."""
    sock = FakeSocket(room)
    blocked = []
    saved, framing._sockio = framing._sockio, None
    try:
        Link(0, 1, sock).send_frame(K_DATA, 5, memoryview(payload), None,
                                    on_block=lambda: blocked.append(len(sock.data)))
    finally:
        framing._sockio = saved
    return sock, len(blocked)


def test_a_large_payload_goes_apart_from_its_header_a_small_one_with_it():
    big = bytes(range(256)) * (HEADER_APART_FROM // 256)
    sock, blocked = send(1 << 30, big)
    assert sock.calls == [[FRAME.size], [len(big)]] and blocked == 0
    small = b"x" * (HEADER_APART_FROM - 1)
    sock, blocked = send(1 << 30, small)
    assert sock.calls == [[FRAME.size, len(small)]] and blocked == 0


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 3 * HEADER_APART_FROM), st.integers(1, 50_000))
def test_every_byte_arrives_in_order_and_on_block_comes_once_when_the_socket_fills(n, room):
    payload = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    sock, blocked = send(room, payload)
    assert bytes(sock.data) == FRAME.pack(K_DATA, 5, n) + payload
    full = any(sum(c) > room for c in sock.calls)  # some call found the socket full
    assert blocked == (1 if full else 0)
    if n >= HEADER_APART_FROM:
        assert all(len(c) == 1 for c in sock.calls)


@pytest.mark.timeout(30)
def test_frames_around_the_threshold_cross_a_real_socket_pair():
    a, b = socket.socketpair()
    try:
        link = Link(0, 1, a)
        for n in (HEADER_APART_FROM - 1, HEADER_APART_FROM, HEADER_APART_FROM + 7):
            payload = np.full(n, n % 251, np.uint8)
            link.send_frame(K_DATA, n, memoryview(payload), None)
            head = b.recv(FRAME.size, socket.MSG_WAITALL)
            assert FRAME.unpack(head) == (K_DATA, n, n)
            got = bytearray(n)
            view, k = memoryview(got), 0
            while k < n:
                k += b.recv_into(view[k:], n - k)
            assert bytes(got) == payload.tobytes()
    finally:
        a.close()
        b.close()
