"""The TCP mesh's receive loop (FERRO_TCP_READER=loop, the default): one thread per process
whatever the number of peers, the backend contract on both readers, a peer stalled mid-frame
holding up only its own link, large frames parked until their receive is posted (never ahead
of a frame another receive waits for), and a process
of 64 ranks over TCP with its thread count measured."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from test_lazy_mesh import close_all, group, run_all

from ferro_backend import PeerClosedError
from ferro_backend.mesh.framing import FRAME, K_DATA, LARGE_FRAME
from ferro_backend.testing import check_backend

pytestmark = pytest.mark.timeout(120)


def _loop_threads(rank: int) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(f"ferro-tcp-{rank}")]


@pytest.mark.parametrize("reader", ["loop", "threads"])
def test_both_readers_pass_the_conformance_kit(reader, monkeypatch):
    monkeypatch.setenv("FERRO_TCP_READER", reader)
    backends = group(2, connect="eager")
    try:
        assert all((b._reactor is not None) == (reader == "loop") for b in backends)
    finally:
        close_all(backends)
    check_backend(lambda n: group(n, connect="eager"), world_sizes=(3,))


def test_one_receive_thread_whatever_the_number_of_peers():
    before = set(threading.enumerate())
    backends = group(6, connect="eager")
    loops = {b._reactor._thread for b in backends}
    try:
        # the mesh's threads this group started: its six receive loops, no reader per peer
        # (other tests' backends may still be winding down: only new threads count)
        new = {t for t in set(threading.enumerate()) - before if t.name.startswith("ferro-tcp-")}
        assert new == loops and all(t.is_alive() for t in loops)
        for b in backends:
            assert b.connections == 5
            assert b._reactor._thread.name == f"ferro-tcp-{b.rank}-loop"
        # every pair still works at once: each rank sends to every other and receives from all
        def everyone(b):
            bufs = {p: np.empty(3, np.int64) for p in range(6) if p != b.rank}
            reqs = {p: b.irecv(buf, p, tag=7) for p, buf in bufs.items()}
            for p in range(6):
                if p != b.rank:
                    b.send(np.array([b.rank, p, 42]), p, tag=7)
            for r in reqs.values():
                r.wait(20)
            return all(list(bufs[p]) == [p, b.rank, 42] for p in bufs)

        assert all(run_all(everyone, backends))
    finally:
        close_all(backends)
    for t in loops:
        t.join(5)
    assert not any(t.is_alive() for t in loops), "a receive loop outlived its backend"


def test_a_peer_stalled_mid_frame_holds_up_only_its_own_link():
    b0, b1, b2 = group(3, connect="eager")
    try:
        payload = np.arange(1000, dtype=np.uint8)
        # rank 1 stops in the middle of a frame (as a SIGSTOPped process would)
        b1._links[0].sock.sendall(FRAME.pack(K_DATA, 5, payload.nbytes) + payload[:100].tobytes())
        b2.send(np.array([7.0]), 0, tag=3)
        got = np.empty(1)
        b0.recv(got, 2, tag=3, timeout=5)  # rank 2's message is not stuck behind rank 1's
        assert got[0] == 7.0
        partial = np.empty(1000, np.uint8)
        req = b0.irecv(partial, 1, tag=5)
        assert not req.poll(0.05)
        b1._links[0].sock.sendall(payload[100:].tobytes())
        req.wait(5)
        np.testing.assert_array_equal(partial, payload)
    finally:
        close_all([b0, b1, b2])


def test_a_large_frame_waits_for_its_receive_without_blocking_others():
    b0, b1, b2 = group(3, connect="eager")
    try:
        big = np.random.default_rng(1).integers(0, 255, 4 * LARGE_FRAME, dtype=np.uint8)
        sender = threading.Thread(target=b1.send, args=(big, 0), kwargs={"tag": 9})
        sender.start()
        time.sleep(0.01)  # the frame is parked: its receive is not posted yet
        small = np.empty(4)
        b2.send(np.ones(4), 0, tag=1)
        b0.recv(small, 2, tag=1, timeout=5)
        out = np.empty_like(big)
        b0.recv(out, 1, tag=9, timeout=10)
        sender.join(10)
        np.testing.assert_array_equal(out, big)
        # and one that nobody asks for in time is queued, then delivered
        b1.send(big, 0, tag=10)
        time.sleep(0.2)
        out2 = np.empty_like(big)
        b0.recv(out2, 1, tag=10, timeout=10)
        np.testing.assert_array_equal(out2, big)
    finally:
        close_all([b0, b1, b2])


@pytest.mark.parametrize("reader", ["loop", "threads"])
def test_a_large_frame_is_not_held_back_while_a_receive_behind_it_waits(reader, monkeypatch):
    """Rank 0 waits for a small frame on tag 1; rank 1 sends a large one on tag 9 (nobody asks
    for it yet), then the small one behind it on the same link. Held back until its receive
    is posted, the large frame would hold the small one up behind it: two collectives in
    flight at once (async workers, DDP's buckets) each sat out the wait. With the wait set to
    30 s, a held frame would time the small receive out."""
    from ferro_backend.mesh import framing, reactor

    monkeypatch.setattr(reactor, "LARGE_FRAME_WAIT", 30.0)
    monkeypatch.setattr(framing, "LARGE_FRAME_WAIT", 30.0)
    monkeypatch.setenv("FERRO_TCP_READER", reader)
    b0, b1 = group(2, connect="eager")
    try:
        big = np.random.default_rng(2).integers(0, 255, 4 * LARGE_FRAME, dtype=np.uint8)
        small = np.empty(4)
        waiting = b0.irecv(small, 1, tag=1)

        def send_both():
            b1.send(big, 0, tag=9)
            b1.send(np.arange(4.0), 0, tag=1)

        sender = threading.Thread(target=send_both)
        sender.start()
        waiting.wait(5)
        assert list(small) == [0.0, 1.0, 2.0, 3.0]
        out = np.empty_like(big)
        b0.recv(out, 1, tag=9, timeout=10)
        sender.join(10)
        np.testing.assert_array_equal(out, big)
    finally:
        close_all([b0, b1])


def test_a_wrong_length_frame_is_refused_and_the_link_goes_on():
    b0, b1 = group(2, connect="eager")
    try:
        b1.send(np.zeros(LARGE_FRAME, np.uint8), 0, tag=2)
        b1.send(np.arange(3.0), 0, tag=2)
        with pytest.raises(Exception, match="bytes"):
            b0.recv(np.empty(5, np.uint8), 1, tag=2, timeout=5)
        ok = np.empty(3)
        b0.recv(ok, 1, tag=2, timeout=5)
        np.testing.assert_array_equal(ok, np.arange(3.0))
    finally:
        close_all([b0, b1])


def test_a_dead_peer_fails_the_receive_waiting_for_it():
    b0, b1 = group(2, connect="eager")
    try:
        req = b0.irecv(np.empty(10), 1, tag=4)
        b1._links[0].sock.shutdown(2)  # the connection drops without a goodbye
        with pytest.raises(PeerClosedError, match="rank 1"):
            req.wait(5)
    finally:
        close_all([b0, b1])


JOB = """
    import threading
    import numpy as np
    import ferro_backend as fb
    b = fb.init_from_env()
    x = np.full(1000, b.rank + 1.0)
    out = np.empty_like(x)
    right, left = (b.rank + 1) % b.world_size, (b.rank - 1) % b.world_size
    for _ in range(3):
        req = b.irecv(out, left, tag=1)
        b.send(x, right, tag=1)
        req.wait(60)
    assert out[0] == left + 1
    print("threads", threading.active_count(), b.connections, flush=True)
    b.close()
"""


@pytest.mark.timeout(180)
def test_16_tcp_ranks_keep_a_few_threads_each(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    proc = subprocess.run([sys.executable, "-m", "ferro_backend.launch", "--nproc", "16",
                           "--transport", "tcp", str(script)], capture_output=True, text=True,
                          timeout=170, env={**os.environ, "FERRO_TCP_CONNECT": "eager"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split()[3:] for line in proc.stdout.splitlines() if "] threads " in line]
    assert len(rows) == 16
    # eager: 15 connections each, drained by one loop (the thread-per-peer reader had 16+);
    # 256 ranks: benchmarks/scale (scale/mesh_loop.json)
    assert all(int(r[1]) == 15 for r in rows), rows
    assert max(int(r[0]) for r in rows) <= 4, rows


def test_a_refused_frame_cut_off_by_its_peer_fails_its_receive_at_once():
    """A receive posted for 4 bytes, a frame of 100 that the peer stops sending after 10 and
    closes: the receive (claimed, its frame being skipped) fails with PeerClosedError at once,
    not by its timeout (found by test_fuzz_protocol)."""
    import socket

    b0, b1 = group(2, connect="eager")
    try:
        req = b0.irecv(np.empty(4, np.uint8), 1, tag=3)
        sock = b1._links[0].sock
        sock.sendall(FRAME.pack(K_DATA, 3, 100) + bytes(10))
        sock.shutdown(socket.SHUT_WR)
        start = time.monotonic()
        with pytest.raises(PeerClosedError, match="rank 0 <- 1: connection lost mid-message"):
            req.wait(10)
        assert time.monotonic() - start < 5
    finally:
        close_all([b0, b1])


def test_a_loop_thread_outliving_the_close_releases_its_epoll_and_pipe(monkeypatch):
    """close() joins the receive loop for a second; a loop thread later than that (a loaded
    host) must still close the epoll and the wake pipe as it ends, not leak them."""
    from ferro_backend.mesh import reactor

    plain = reactor.Reactor._turn

    def late(self, cap):
        plain(self, cap)
        if self._draining:
            time.sleep(1.6)  # past close()'s one-second join of this thread

    monkeypatch.setattr(reactor.Reactor, "_turn", late)
    backends = group(2, connect="eager")
    reactors = [b._reactor for b in backends]
    close_all(backends)
    assert all(r._thread.is_alive() and not r._ep.closed for r in reactors)  # close gave up
    for r in reactors:
        r._thread.join(10)
    assert all(r._ep.closed and r._wake_w == -1 for r in reactors)
