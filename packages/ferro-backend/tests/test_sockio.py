"""The TCP mesh's compiled per-message system calls (``ferro_backend.mesh._sockio``, Linux):
each against its Python reference on real sockets, and the receive loop's direct path
(``Reactor._serve``) keeping every rule of the general one: frames for other tags or other
receives, receives from any rank posted first, a payload still on its way, a peer that ends
mid-frame, a wrong length."""

import importlib.machinery
import socket
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lazy_mesh import close_all, group

from ferro_backend import PeerClosedError, SizeMismatchError
from ferro_backend.mesh import framing, reactor
from ferro_backend.mesh.framing import FRAME, K_ABORT, K_DATA, Link

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]

if sys.platform.startswith("linux"):
    from ferro_backend.mesh import _sockio


def test_the_compiled_module_is_the_one_in_use():
    assert _sockio.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    assert framing._sockio is _sockio and reactor._sockio is _sockio


def _pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(10)
    b.settimeout(10)
    return a, b


def _read(sock: socket.socket, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        assert chunk, "connection closed early"
        got += chunk
    return bytes(got)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([K_DATA, K_ABORT]), st.integers(0, (1 << 64) - 1), st.integers(0, 5000))
def test_send_frame_writes_what_the_python_frame_is(kind, tag, n):
    a, b = _pair()
    try:
        payload = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        sent = _sockio.send_frame(a.fileno(), kind, tag, memoryview(payload))
        assert sent == FRAME.size + n
        assert _read(b, FRAME.size + n) == FRAME.pack(kind, tag, n) + payload.tobytes()
    finally:
        a.close()
        b.close()


def test_send_frame_reports_a_full_socket_and_a_closed_peer():
    a, b = _pair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        big = np.zeros(1 << 20, np.uint8)
        first = _sockio.send_frame(a.fileno(), K_DATA, 1, memoryview(big))
        assert 0 < first < FRAME.size + big.nbytes  # what fit
        assert _sockio.send_frame(a.fileno(), K_DATA, 1, memoryview(big[:10])) == 0  # full
        b.close()
        assert _sockio.send_frame(a.fileno(), K_DATA, 1, memoryview(big[:10])) < 0  # -EPIPE
    finally:
        a.close()


def test_peek_frame_answers_and_leaves_the_header_in_the_socket():
    a, b = _pair()
    r, w = socket.socketpair()
    try:
        header = bytearray(FRAME.size)
        t0 = time.monotonic()
        assert _sockio.peek_frame(b.fileno(), r.fileno(), header, 0.05) == _sockio.TIMEOUT
        assert time.monotonic() - t0 >= 0.04
        w.send(b"x")  # the other descriptor readable, nothing on ours
        assert _sockio.peek_frame(b.fileno(), r.fileno(), header, 5.0) == _sockio.OTHER
        r.recv(1)
        a.sendall(FRAME.pack(K_DATA, 9, 3)[:10])  # a partial header: the general path's
        assert _sockio.peek_frame(b.fileno(), -1, header, 5.0) == _sockio.UNSURE
        a.sendall(FRAME.pack(K_DATA, 9, 3)[10:] + b"abc")
        assert _sockio.peek_frame(b.fileno(), -1, header, 5.0) == _sockio.PEEKED
        assert FRAME.unpack(header) == (K_DATA, 9, 3)
        assert _read(b, FRAME.size + 3) == FRAME.pack(K_DATA, 9, 3) + b"abc"  # still there
        a.close()
        assert _sockio.peek_frame(b.fileno(), -1, header, 5.0) == _sockio.UNSURE  # its end
    finally:
        for s in (a, b, r, w):
            s.close()


def test_take_frame_reads_what_has_arrived_and_leaves_the_rest():
    a, b = _pair()
    try:
        payload = bytes(range(200))
        header = bytearray(FRAME.size)
        a.sendall(FRAME.pack(K_DATA, 4, 200) + payload[:70])
        assert _sockio.peek_frame(b.fileno(), -1, header, 5.0) == _sockio.PEEKED
        out = bytearray(200)
        assert _sockio.take_frame(b.fileno(), -1, out, 0.0) == 70  # no wait: what is there
        assert bytes(out[:70]) == payload[:70]
        a.sendall(payload[70:] + b"next")
        assert _read(b, 130 + 4) == payload[70:] + b"next"
    finally:
        a.close()
        b.close()


def test_take_frame_waits_for_the_rest_while_nothing_else_is_readable():
    a, b = _pair()
    r, w = socket.socketpair()
    try:
        payload = bytes(range(200)) * 5
        header, out = bytearray(FRAME.size), bytearray(1000)
        a.sendall(FRAME.pack(K_DATA, 4, 1000) + payload[:300])
        assert _sockio.peek_frame(b.fileno(), r.fileno(), header, 5.0) == _sockio.PEEKED
        rest = threading.Timer(0.05, lambda: a.sendall(payload[300:]))
        rest.start()
        assert _sockio.take_frame(b.fileno(), r.fileno(), out, 5.0) == 1000
        assert bytes(out) == payload
        rest.join(5)
        # the other descriptor readable: the call gives up the wait at once, with what it has
        a.sendall(FRAME.pack(K_DATA, 4, 1000) + payload[:300])
        assert _sockio.peek_frame(b.fileno(), r.fileno(), header, 5.0) == _sockio.PEEKED
        threading.Timer(0.05, lambda: w.send(b"x")).start()
        t0 = time.monotonic()
        assert _sockio.take_frame(b.fileno(), r.fileno(), out, 5.0) == 300
        assert time.monotonic() - t0 < 2.0
    finally:
        for s in (a, b, r, w):
            s.close()


def test_a_send_the_compiled_call_started_is_finished_by_the_loop_in_order():
    a, b = _pair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        link = Link(0, 1, a)
        payload = np.random.default_rng(3).integers(0, 256, 60_000, dtype=np.uint8)
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(_read(b, FRAME.size + 60_000)))
        blocked = []
        reader.start()
        link.send_frame(K_DATA, 8, memoryview(payload), time.monotonic() + 10,
                        on_block=lambda: blocked.append(1))
        reader.join(10)
        assert got == [FRAME.pack(K_DATA, 8, 60_000) + payload.tobytes()]
        assert blocked == [1] and link.sent == 60_000
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------------ the direct path, end to end
class TakeSpy:
    """``reactor._sockio`` with every ``take_frame``'s answer recorded."""

    def __init__(self) -> None:
        self.takes: list[int] = []

    def __getattr__(self, name):
        return getattr(_sockio, name)

    def take_frame(self, fd, other, out, timeout):
        got = _sockio.take_frame(fd, other, out, timeout)
        self.takes.append(got)
        return got


def test_frames_of_other_tags_and_any_source_receives_keep_their_order():
    b0, b1 = group(2, connect="eager")
    try:
        b0.send(np.array([5.0]), 1, tag=5)  # for a receive posted later
        b0.send(np.array([6.0]), 1, tag=6)
        got6 = np.empty(1)
        b1.recv(got6, 0, tag=6, timeout=10)  # the tag-5 frame comes first: the general path
        got5 = np.empty(1)
        b1.recv(got5, 0, tag=5, timeout=10)
        assert (got5[0], got6[0]) == (5.0, 6.0)
        first, second = np.empty(1), np.empty(1)
        any_req = b1.irecv_any(first, tag=7)  # posted before the receive from rank 0
        req = b1.irecv(second, 0, tag=7)
        b0.send(np.array([1.0]), 1, tag=7)
        b0.send(np.array([2.0]), 1, tag=7)
        req.wait(10)
        any_req.wait(10)
        assert (first[0], second[0], any_req.source) == (1.0, 2.0, 0)
        before = b1._reactor.direct_frames
        for i in range(200):  # the frame sent while the receive waits; the loop thread may
            # still take it first on a loaded host: tried until one wait finds its own frame
            sender = threading.Timer(0.002, b0.send, (np.array([float(i)]), 1), {"tag": 9})
            sender.start()
            b1.recv(first, 0, tag=9, timeout=10)
            sender.join(10)
            assert first[0] == i
            if b1._reactor.direct_frames > before:
                break
        assert b1._reactor.direct_frames > before  # waits that found their own frame next
    finally:
        close_all([b0, b1])


def test_a_payload_in_pieces_is_read_by_the_waiting_thread_while_all_else_is_quiet(monkeypatch):
    spy = TakeSpy()
    monkeypatch.setattr(reactor, "_sockio", spy)
    b0, b1 = group(2, connect="eager")
    try:
        payload = np.arange(1000, dtype=np.uint8) % 251
        raw = b1._links[0].sock
        got = np.empty(1000, np.uint8)
        direct = b0._reactor.direct_frames
        req = b0.irecv(got, 1, tag=5)  # posted, then waited on: the waiting thread reads
        first = threading.Timer(0.05, lambda: raw.sendall(FRAME.pack(K_DATA, 5, 1000)
                                                          + payload[:300].tobytes()))
        later = threading.Timer(0.3, lambda: raw.sendall(payload[300:].tobytes()))
        first.start()
        later.start()
        req.wait(10)
        first.join(10)
        later.join(10)
        assert np.array_equal(got, payload) and b0._reactor.direct_frames == direct + 1
        assert spy.takes == [1000]
    finally:
        close_all([b0, b1])


def test_a_payload_on_its_way_goes_to_the_general_path_when_another_link_speaks(monkeypatch):
    spy = TakeSpy()
    monkeypatch.setattr(reactor, "_sockio", spy)
    b0, b1, b2 = group(3, connect="eager")
    try:
        payload = np.arange(1000, dtype=np.uint8) % 251
        raw = b1._links[0].sock
        got = np.empty(1000, np.uint8)
        direct = b0._reactor.direct_frames
        req = b0.irecv(got, 1, tag=5)
        timers = [threading.Timer(0.05, lambda: raw.sendall(FRAME.pack(K_DATA, 5, 1000)
                                                            + payload[:300].tobytes())),
                  threading.Timer(0.2, lambda: b2.send(np.array([2.0]), 0, tag=6)),
                  threading.Timer(0.4, lambda: raw.sendall(payload[300:].tobytes()))]
        for t in timers:
            t.start()
        req.wait(10)
        for t in timers:
            t.join(10)
        assert np.array_equal(got, payload) and b0._reactor.direct_frames == direct
        assert spy.takes == [300]  # rank 2's frame ended the wait: the general path went on
        two = np.empty(1)
        b0.recv(two, 2, tag=6, timeout=10)
        assert two[0] == 2.0
        b1.send(np.array([3.0]), 0, tag=6)  # the link goes on
        b0.recv(two, 1, tag=6, timeout=10)
        assert two[0] == 3.0
    finally:
        close_all([b0, b1, b2])


def test_a_peer_that_ends_mid_frame_fails_the_receive(monkeypatch):
    spy = TakeSpy()
    monkeypatch.setattr(reactor, "_sockio", spy)
    b0, b1 = group(2, connect="eager")
    try:
        raw = b1._links[0].sock
        req = b0.irecv(np.empty(1000, np.uint8), 1, tag=5)
        threading.Timer(0.05, lambda: raw.sendall(FRAME.pack(K_DATA, 5, 1000) + bytes(300))).start()
        threading.Timer(0.3, lambda: raw.shutdown(socket.SHUT_WR)).start()
        t0 = time.monotonic()
        with pytest.raises(PeerClosedError, match="connection lost mid-message"):
            req.wait(10)
        assert time.monotonic() - t0 < 5 and spy.takes == [300]
    finally:
        close_all([b0, b1])


def test_a_wrong_length_still_fails_as_a_size_mismatch():
    b0, b1 = group(2, connect="eager")
    try:
        b0.send(np.zeros(3), 1, tag=2)
        with pytest.raises(SizeMismatchError, match="24 bytes"):
            b1.recv(np.empty(4), 0, tag=2, timeout=10)
        b0.send(np.array([4.0]), 1, tag=2)  # the link goes on
        one = np.empty(1)
        b1.recv(one, 0, tag=2, timeout=10)
        assert one[0] == 4.0
    finally:
        close_all([b0, b1])
