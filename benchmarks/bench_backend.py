"""ferro-backend: send/recv round trips (simulated, TCP, shm), one frame through the mesh's
compiled socket calls (`_sockio`) and the `_wire` pack/unpack kernel.

ShmBackend's messages move through the `_ring` kernel (point-to-point rings in the engine
segment) and, when large, the `_shm` kernel (a single cross-memory copy); its round trips are
measured against the same raw-socket echo as TCP.

Baselines measured in the same run: two ``np.copyto`` for a simulated round trip (the copies an
in-process transport cannot avoid), raw-socket ``sendall``/``recv_into`` echo between two
processes for TCP, ``np.copyto`` into slices of one buffer for pack/unpack.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from ferro_backend import ShmBackend, SimulatedBackend, TcpBackend, pack, unpack
from ferro_backend.testing import free_port

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "64MiB": 64 << 20}


def _copy_twice(src: np.ndarray, dst: np.ndarray):
    """The memcpy baseline of a message's trip: ``src`` into a middle buffer, then into ``dst``."""
    mid = np.empty_like(src)

    def run() -> None:
        np.copyto(mid, src)
        np.copyto(dst, mid)
    return run


def _rounds(nbytes: int) -> int:
    return 200 if nbytes <= 1 << 20 else 8


# ---------------------------------------------------------------- simulated round trip
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("impl", ["memcpy", "simulated"])
def bench_simulated_round_trip(benchmark, impl, size):
    nbytes = SIZES[size]
    benchmark.group = f"roundtrip simulated {size}"
    benchmark.extra_info["bytes"] = 2 * nbytes
    a = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    back = np.empty_like(a)
    if impl == "memcpy":
        benchmark.extra_info["role"] = "baseline"
        benchmark.pedantic(_copy_twice(a, back), rounds=_rounds(nbytes), warmup_rounds=2)
    else:
        b0, b1 = SimulatedBackend.create_group(2)
        stop = threading.Event()
        mid = np.empty_like(a)

        def echo():
            while not stop.is_set():
                try:
                    b1.recv(mid, 0, timeout=30)
                except Exception:
                    return
                b1.send(mid, 0)

        t = threading.Thread(target=echo, daemon=True)
        t.start()

        def run():
            req = b0.irecv(back, 1)
            b0.send(a, 1)
            req.wait(30)

        benchmark.pedantic(run, rounds=_rounds(nbytes), warmup_rounds=2)
        stop.set()
        b0.close()
        b1.close()
        t.join(5)
    np.testing.assert_array_equal(back, a)


# ---------------------------------------------------------------- TCP round trip
RAW_ECHO = """
import socket, sys
n, port = int(sys.argv[1]), int(sys.argv[2])
s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
    s.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
buf = bytearray(n); view = memoryview(buf)
while True:
    got = 0
    while got < n:
        k = s.recv_into(view[got:], n - got)
        if k == 0:
            sys.exit(0)
        got += k
    s.sendall(buf)
"""

FERRO_ECHO = """
import sys
import numpy as np
import ferro_backend
n, port, cls = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
b = getattr(ferro_backend, cls)(1, 2, f"127.0.0.1:{port}", timeout=120)
buf = np.empty(n, dtype=np.uint8)
while True:
    try:
        b.recv(buf, 0, timeout=120)
    except Exception:
        break
    b.send(buf, 0)
b.close()
"""


def _spawn(script: str, nbytes: int, port: int, cls: str = "", **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), str(nbytes),
                             str(port), cls], env=dict(os.environ, **env))


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("impl", ["raw_socket", "tcp", "tcp_threads", "shm"])
def bench_tcp_round_trip(benchmark, impl, size, monkeypatch):
    """A round trip between two processes. ``tcp``: TcpBackend with its receive loop (one
    epoll thread per process); ``tcp_threads``: with a reader thread per peer
    (FERRO_TCP_READER=threads), the 0.2 design."""
    nbytes = SIZES[size]
    benchmark.group = f"roundtrip 2 processes {size}"
    benchmark.extra_info["bytes"] = 2 * nbytes
    a = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    back = np.empty_like(a)
    port = free_port()
    if impl == "raw_socket":
        benchmark.extra_info["role"] = "baseline"
        lsock = socket.create_server(("127.0.0.1", port))
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            lsock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        proc = _spawn(RAW_ECHO, nbytes, port)
        lsock.settimeout(30)
        conn, _ = lsock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(back)

        def run():
            conn.sendall(a)
            got = 0
            while got < nbytes:
                got += conn.recv_into(view[got:], nbytes - got)

        try:
            benchmark.pedantic(run, rounds=_rounds(nbytes), warmup_rounds=2)
        finally:
            conn.close()
            lsock.close()
            proc.wait(30)
    else:
        cls = ShmBackend if impl == "shm" else TcpBackend
        reader = "threads" if impl == "tcp_threads" else "loop"
        monkeypatch.setenv("FERRO_TCP_READER", reader)
        proc = _spawn(FERRO_ECHO, nbytes, port, cls.__name__, FERRO_TCP_READER=reader)
        b = cls(0, 2, f"127.0.0.1:{port}", timeout=120)

        def run():
            req = b.irecv(back, 1)
            b.send(a, 1)
            req.wait(60)

        try:
            benchmark.pedantic(run, rounds=_rounds(nbytes), warmup_rounds=2)
        finally:
            b.close()
            proc.wait(30)
    np.testing.assert_array_equal(back, a)


# ---------------------------------------------------------------- _sockio: one frame through a socket
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the compiled mesh calls: Linux")
@pytest.mark.parametrize("size", ["16B", "4KiB", "32KiB"])
@pytest.mark.parametrize("impl", ["raw_socket", "_sockio"])
def bench_frame_through_a_socket(benchmark, impl, size):
    """One frame (24-byte header + payload) sent and received over a connected TCP pair on
    127.0.0.1 with the mesh's socket options, in one thread: ``_sockio.send_frame`` +
    ``peek_frame`` + ``take_frame`` (what the mesh runs for a waiting receive) against the
    socket module's ``sendmsg`` of header and payload and two ``recv_into`` (header, then
    payload): the same bytes and system calls."""
    from ferro_backend.mesh import _sockio
    from ferro_backend.mesh.framing import FRAME, K_DATA

    nbytes = {"16B": 16, "4KiB": 4 << 10, "32KiB": 32 << 10}[size]
    benchmark.group = f"one frame through a socket {size}"
    benchmark.extra_info["bytes"] = nbytes
    from ferro_backend.mesh.rendezvous import _tune

    lsock = socket.create_server(("127.0.0.1", 0))
    _tune(lsock)  # the mesh's socket options (no delay, its buffer sizes), inherited on accept
    a = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    _tune(a)
    a.connect(lsock.getsockname())
    b, _ = lsock.accept()
    lsock.close()
    for s in (a, b):
        s.settimeout(10)
    payload = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    out = np.empty_like(payload)
    header, pv, ov = bytearray(FRAME.size), memoryview(payload), memoryview(out)
    if impl == "raw_socket":
        benchmark.extra_info["role"] = "baseline"

        def run():
            a.sendmsg([FRAME.pack(K_DATA, 7, nbytes), pv])
            b.recv_into(header, FRAME.size, socket.MSG_WAITALL)
            b.recv_into(ov, nbytes, socket.MSG_WAITALL)
    else:
        def run():
            assert _sockio.send_frame(a.fileno(), K_DATA, 7, pv) == FRAME.size + nbytes
            assert _sockio.peek_frame(b.fileno(), -1, header, 10.0) == _sockio.PEEKED
            got = _sockio.take_frame(b.fileno(), -1, ov, 0.0)
            while got < nbytes:  # a frame may come in pieces
                got += b.recv_into(ov[got:], nbytes - got)
    try:
        benchmark.pedantic(run, rounds=300, iterations=5, warmup_rounds=5)
        assert np.array_equal(out, payload)
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- _wire pack / unpack
def _arrays():
    rng = np.random.default_rng(1)
    per = (64 << 20) // 100 // 4
    return [rng.standard_normal(per, dtype=np.float32) for _ in range(100)]


@pytest.mark.parametrize("impl", ["copyto", "_wire.pack"])
def bench_pack_100_arrays_64MiB(benchmark, impl):
    arrays = _arrays()
    total = sum(a.nbytes for a in arrays)
    benchmark.group = "pack 100 arrays 64MiB"
    benchmark.extra_info["bytes"] = total
    out = np.empty(total, dtype=np.uint8)
    if impl == "copyto":
        benchmark.extra_info["role"] = "baseline"
        views, off = [], 0
        for a in arrays:
            views.append(out[off:off + a.nbytes].view(np.float32))
            off += a.nbytes

        def run():
            for v, a in zip(views, arrays):
                np.copyto(v, a)
    else:
        def run():
            pack(arrays, out=out)

    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    assert out[:arrays[0].nbytes].view(np.float32)[5] == arrays[0][5]


@pytest.mark.parametrize("impl", ["copyto", "_wire.unpack"])
def bench_unpack_100_arrays_64MiB(benchmark, impl):
    arrays = _arrays()
    buf = pack(arrays)
    outs = [np.empty_like(a) for a in arrays]
    benchmark.group = "unpack 100 arrays 64MiB"
    benchmark.extra_info["bytes"] = buf.nbytes
    if impl == "copyto":
        benchmark.extra_info["role"] = "baseline"
        views, off = [], 0
        for a in arrays:
            views.append(buf[off:off + a.nbytes].view(np.float32))
            off += a.nbytes

        def run():
            for o, v in zip(outs, views):
                np.copyto(o, v)
    else:
        def run():
            unpack(buf, outs)

    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    np.testing.assert_array_equal(outs[-1], arrays[-1])


@pytest.mark.parametrize("size", ["1MiB", "8MiB", "32MiB"])
@pytest.mark.parametrize("impl", ["memcpy", "_wire.stream_copy"])
def bench_stream_copy(benchmark, impl, size):
    """Non-temporal stores against memcpy (_wire.copy_bytes): the own block of a large
    all_gather (here: 32 MiB 3.1 ms against 5.1 ms)."""
    from ferro_backend import _wire

    nbytes = {"1MiB": 1 << 20, "8MiB": 8 << 20, "32MiB": 32 << 20}[size]
    src = np.ones(nbytes, np.uint8)
    dst = np.empty(nbytes, np.uint8)
    benchmark.group = f"stream copy {size}"
    benchmark.extra_info["bytes"] = nbytes
    if impl == "memcpy":
        benchmark.extra_info["role"] = "baseline"
        copy = _wire.copy_bytes
    else:
        copy = _wire.stream_copy
    benchmark.pedantic(copy, args=(src, dst), rounds=20, warmup_rounds=2)
    assert dst[-1] == 1


@pytest.mark.parametrize("size", ["64KiB", "1MiB", "16MiB"])
@pytest.mark.parametrize("impl", ["copyto", "_segment.cma_read", "_segment.cma_write"])
def bench_cross_memory_copy(benchmark, impl, size):
    """The engine's `_segment` kernel's single copies (here within one process: the same system
    calls) against numpy's copy of the same bytes."""
    from ferro_backend.engine import _segment

    nbytes = {"64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}[size]
    src = np.arange(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    benchmark.group = f"cross-memory copy {size}"
    benchmark.extra_info["bytes"] = nbytes
    pid = os.getpid()
    if impl == "copyto":
        benchmark.extra_info["role"] = "baseline"
        run = lambda: np.copyto(dst, src)
    elif impl == "_segment.cma_read":
        run = lambda: _segment.cma_read(pid, src.ctypes.data, dst)
    else:
        run = lambda: _segment.cma_write(pid, dst.ctypes.data, src)
    benchmark.pedantic(run, rounds=50 if nbytes <= 1 << 20 else 10, warmup_rounds=2)
    assert dst[-1] == src[-1]


@pytest.mark.parametrize("size", ["64B", "4KiB", "16KiB"])
@pytest.mark.parametrize("impl", ["2x copyto", "_ring.put+take"])
def bench_ring_put_take(benchmark, impl, size):
    """The engine's `_ring` kernel: one message into a point-to-point ring and out again (within
    one process), against the two numpy copies it makes (into the ring, out of it)."""
    from ferro_backend.engine import _ring, _segment

    nbytes = {"64B": 64, "4KiB": 4 << 10, "16KiB": (16 << 10) - 64}[size]
    src = np.arange(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    benchmark.group = f"ring put+take {size}"
    benchmark.extra_info["bytes"] = nbytes
    if impl == "2x copyto":
        benchmark.extra_info["role"] = "baseline"
        run = _copy_twice(src, dst)
    else:
        cap = 64 << 10
        segment = np.zeros(_segment.layout(2, 64, cap)["size"], dtype=np.uint8)
        failed = np.zeros(1, dtype=np.uint32)
        ring = _ring.Ring(segment, 2, 64, cap, 0, 1, failed.ctypes.data)
        far = time.monotonic() + 3600

        def run():
            ring.put(_ring.EAGER, 0, nbytes, 0, src, far)
            ring.take(dst)
    benchmark.pedantic(run, rounds=2000, warmup_rounds=20)
    np.testing.assert_array_equal(dst, src)


def test_time_is_monotonic():  # keeps `pytest benchmarks` from reporting "no tests" on --benchmark-skip
    assert time.monotonic() > 0
