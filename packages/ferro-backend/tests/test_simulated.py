"""SimulatedBackend: the 0.1 crate's tests, ported, plus tags, failures and the buffer protocol."""

import threading
import time

import numpy as np
import pytest

from ferro_backend import (
    Backend,
    CollectiveTimeoutError,
    InvalidRankError,
    InvalidWorldSizeError,
    PeerAbortedError,
    PeerClosedError,
    SimulatedBackend,
    SizeMismatchError,
)
from ferro_backend.testing import RankFailure, run_ranks, run_threads


# ---- ported from backend.rs ------------------------------------------------------------
def test_simulated_send_recv():
    b0, b1 = SimulatedBackend.create_group(2)
    t = threading.Thread(target=b0.send, args=(bytes([1, 2, 3, 4]), 1))
    t.start()
    buf = bytearray(4)
    b1.recv(buf, 0, timeout=5)
    t.join(5)
    assert bytes(buf) == bytes([1, 2, 3, 4])


def test_simulated_barrier():
    assert run_ranks(lambda b: b.barrier(timeout=5), 4, timeout=10) == [None] * 4


def test_simulated_rank_world_size():
    group = SimulatedBackend.create_group(3)
    assert [b.rank for b in group] == [0, 1, 2]
    assert group[0].world_size == 3
    assert isinstance(group[0], Backend)


def test_invalid_world_size():
    with pytest.raises(InvalidWorldSizeError, match="world_size 0"):
        SimulatedBackend.create_group(0)


def test_send_to_invalid_rank():
    group = SimulatedBackend.create_group(2)
    with pytest.raises(InvalidRankError, match="5"):
        group[0].send(b"\x01", 5)


# ---- beyond the seed ---------------------------------------------------------------------
def test_send_to_self_is_refused():
    (b,) = SimulatedBackend.create_group(1)
    with pytest.raises(InvalidRankError, match="itself"):
        b.send(b"x", 0)


def test_fifo_per_pair_and_tag():
    def fn(b):
        if b.rank == 0:
            for i in range(50):
                b.send(np.array([i], dtype=np.int64), 1, tag=i % 3)
            return None
        got = {0: [], 1: [], 2: []}
        out = np.empty(1, dtype=np.int64)
        for tag in (2, 0, 1):  # drain tags in a different order than sent
            for _ in range(len(range(tag, 50, 3))):
                b.recv(out, 0, tag=tag, timeout=5)
                got[tag].append(int(out[0]))
        return got

    got = run_ranks(fn, 2, timeout=20)[1]
    for tag in range(3):
        assert got[tag] == list(range(tag, 50, 3))


def test_numpy_arrays_and_memoryviews_are_buffers():
    def fn(b):
        if b.rank == 0:
            b.send(np.arange(12, dtype=np.float64).reshape(3, 4), 1)
            b.send(memoryview(b"hello"), 1, tag=7)
            return None
        out = np.empty((3, 4))
        b.recv(out, 0, timeout=5)
        m = bytearray(5)
        b.recv(memoryview(m), 0, tag=7, timeout=5)
        return out, bytes(m)

    out, m = run_ranks(fn, 2, timeout=10)[1]
    np.testing.assert_array_equal(out, np.arange(12.0).reshape(3, 4))
    assert m == b"hello"


def test_recv_posted_before_send_lands_in_place():
    b0, b1 = SimulatedBackend.create_group(2)
    out = np.zeros(1000, dtype=np.float32)
    req = b1.irecv(out, 0, tag=3)
    assert not req.test()
    b0.send(np.ones(1000, dtype=np.float32), 1, tag=3)
    req.wait(5)
    assert req.test() and out.sum() == 1000


def test_size_mismatch_names_sizes():
    b0, b1 = SimulatedBackend.create_group(2)
    b0.send(b"12345678", 1)
    with pytest.raises(SizeMismatchError, match=r"8 bytes.*has 4"):
        b1.recv(bytearray(4), 0, timeout=5)
    # posted first, then a wrong-size message arrives
    req = b1.irecv(bytearray(4), 0, tag=1)
    b0.send(b"123", 1, tag=1)
    with pytest.raises(SizeMismatchError):
        req.wait(5)


def test_non_contiguous_and_readonly_buffers_are_refused():
    b0, b1 = SimulatedBackend.create_group(2)
    with pytest.raises(ValueError, match="C-contiguous"):
        b0.send(np.zeros((4, 4))[:, 1], 1)
    ro = np.zeros(4)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        b1.recv(ro, 0, timeout=1)
    with pytest.raises(ValueError, match="read-only"):
        b1.recv(b"abcd", 0, timeout=1)


def test_recv_timeout_names_peer_and_tag():
    b0, b1 = SimulatedBackend.create_group(2)
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"rank 0 \(tag 9"):
        b1.recv(bytearray(1), 0, tag=9, timeout=0.2)
    assert time.monotonic() - t0 < 2
    # the timed-out receive is withdrawn: the next message goes to the next receive
    b0.send(b"z", 1, tag=9)
    out = bytearray(1)
    b1.recv(out, 0, tag=9, timeout=5)
    assert out == b"z"


def test_default_timeout_applies():
    b0, b1 = SimulatedBackend.create_group(2, timeout=0.2)
    with pytest.raises(CollectiveTimeoutError):
        b1.recv(bytearray(1), 0)


def test_closed_peer_fails_waiting_recv_promptly_after_draining():
    b0, b1 = SimulatedBackend.create_group(2)
    b0.send(b"a", 1)
    b0.close()
    out = bytearray(1)
    b1.recv(out, 0, timeout=5)  # queued before close: still delivered
    assert out == b"a"
    t0 = time.monotonic()
    with pytest.raises(PeerClosedError, match="peer rank 0"):
        b1.recv(out, 0, timeout=30)
    assert time.monotonic() - t0 < 1
    with pytest.raises(PeerClosedError):
        b1.send(b"x", 0)


def test_abort_wakes_every_blocked_rank_with_the_reason():
    group = SimulatedBackend.create_group(3)
    errors = {}

    def wait(b):
        try:
            b.recv(bytearray(1), 0, timeout=30)
        except Exception as exc:
            errors[b.rank] = exc

    threads = [threading.Thread(target=wait, args=(b,)) for b in group[1:]]
    for t in threads:
        t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    group[0].abort("out of memory in step 7")
    for t in threads:
        t.join(5)
    assert time.monotonic() - t0 < 1
    for r in (1, 2):
        assert isinstance(errors[r], PeerAbortedError)
        assert errors[r].peer == 0 and "out of memory in step 7" in str(errors[r])


def test_context_manager_aborts_on_exception():
    group = SimulatedBackend.create_group(2)
    with pytest.raises(KeyError):
        with group[0]:
            raise KeyError("boom")
    with pytest.raises(PeerAbortedError, match="boom"):
        group[1].recv(bytearray(1), 0, timeout=5)


def test_run_threads_reports_the_root_cause():
    def fn(b):
        if b.rank == 1:
            raise ZeroDivisionError("rank 1 failed")
        b.recv(bytearray(1), 1, timeout=30)

    with pytest.raises(ZeroDivisionError, match="rank 1 failed"):
        run_threads(fn, SimulatedBackend.create_group(3), timeout=10)


def test_barrier_many_rounds_and_sizes():
    for n in (1, 2, 3, 5, 8):
        run_ranks(lambda b: [b.barrier(timeout=5) for _ in range(5)], n, timeout=20)


def test_zero_length_messages():
    def fn(b):
        if b.rank == 0:
            b.send(b"", 1)
        else:
            b.recv(bytearray(0), 0, timeout=5)

    run_ranks(fn, 2, timeout=10)


def _ring_loop(b, rounds=50):
    """A ring exchange per round (every rank sends and receives), returns rounds done."""
    out = bytearray(1)
    for i in range(rounds):
        b.send(bytes([i % 256]), (b.rank + 1) % b.world_size, tag=7)
        b.recv(out, (b.rank - 1) % b.world_size, tag=7)
    return rounds


@pytest.mark.timeout(30)
def test_injected_kill_fails_the_peers_promptly():
    group = SimulatedBackend.create_group(3, timeout=10)
    group[1].inject(after_messages=5, fault="kill")
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:  # a failing rank aborts, as a dying process would
        run_threads(_ring_loop, group, raise_first=False)
    errors = info.value.errors
    assert set(errors) == {0, 1, 2}
    assert all(isinstance(e, PeerClosedError) for e in errors.values())
    assert "killed by fault injection" in str(errors[2])
    assert time.monotonic() - t0 < 2.5


@pytest.mark.timeout(30)
def test_injected_freeze_makes_the_peers_time_out_and_delay_only_slows():
    group = SimulatedBackend.create_group(2, timeout=0.5)
    group[0].inject(after_messages=3, fault="freeze")
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_threads(_ring_loop, group, abort_on_error=False, raise_first=False)
    assert all(isinstance(e, CollectiveTimeoutError) for e in info.value.errors.values())
    assert time.monotonic() - t0 < 5
    group = SimulatedBackend.create_group(2, timeout=10)
    group[1].inject(after_messages=0, fault="delay", delay=0.01)
    t0 = time.monotonic()
    assert run_threads(lambda b: _ring_loop(b, 20), group) == [20, 20]
    assert time.monotonic() - t0 >= 0.2
    with pytest.raises(ValueError, match="fault 'explode'"):
        group[0].inject(fault="explode")
    with pytest.raises(ValueError, match="after_messages -1"):
        group[0].inject(after_messages=-1)
