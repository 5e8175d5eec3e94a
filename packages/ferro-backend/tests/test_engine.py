"""The engine's shared segment: how it is made, shared, authenticated and released."""

import os
import socket
import struct
import threading
import time

import pytest
from _comms import comms
from hypothesis import given, settings
from hypothesis import strategies as st

from ferro_backend import RendezvousError, ShmBackend
from ferro_backend.engine import _comm, _segment, _steps
from ferro_backend.engine import segment as eng
from ferro_backend.testing import run_job

pytestmark = pytest.mark.timeout(60)


PAGE = 4096


def test_layout_is_aligned_and_holds_every_slot():
    lay = _segment.layout(5, 10_000, 1 << 16)
    assert lay["slot_off"] % PAGE == 0 and lay["parity_stride"] % PAGE == 0
    assert lay["ctrl_off"] == 128 and lay["slot_off"] >= lay["ctrl_off"] + 5 * 128
    assert lay["parity_stride"] >= lay["head_bytes"] + 10_000
    assert lay["slot_stride"] == 2 * lay["parity_stride"]
    assert lay["ring_off"] == lay["slot_off"] + 5 * lay["slot_stride"]
    assert lay["ring_off"] % PAGE == 0 and lay["ring_stride"] % PAGE == 0
    assert lay["ring_stride"] >= 128 + lay["ring_bytes"]
    # the door's point-to-point rings follow the Python messages' rings
    assert lay["door_ring_off"] == lay["ring_off"] + 5 * 5 * lay["ring_stride"]
    assert lay["size"] == lay["door_ring_off"] + 5 * 5 * lay["ring_stride"]


def test_a_communicator_refuses_a_segment_smaller_than_its_layout_and_a_bad_rank():
    need = _segment.layout(2, 4096, 4096)["size"]
    with pytest.raises(ValueError, match="smaller than its layout"):
        comms(2, size=need - 1)
    fd = os.memfd_create("ferro-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, need)
        with pytest.raises(ValueError, match="rank 2 is not one of 2 ranks"):
            _comm.Comm(fd, need, 2, 2, 4096, 4096, 0, 0, 1.0)
    finally:
        os.close(fd)


@settings(max_examples=60, deadline=None)
@given(slot=st.sampled_from([4096, 65536, 1 << 20]), span=st.integers(0, 1 << 20),
       step=st.integers(0, (1 << 32) - 3))
def test_a_steps_data_moves_through_its_slot_in_whole_pages_and_stays_inside(slot, span, step):
    e = _comms_by_slot(slot)
    at, stride = e.rot(step, span), -(-span // 4096) * 4096
    assert at % 4096 == 0 and at + span <= max(slot, span)
    if span < 8192 or slot < 2 * stride:
        assert at == 0  # small calls, and calls of over half a slot, stay put
    else:
        # both steps of a parity pair share a place; the next pair takes the next one
        assert e.rot(step ^ 1, span) == at
        assert e.rot(step + 2, span) in (at + stride, 0)


_BY_SLOT: dict = {}


def _comms_by_slot(slot: int):
    """Rank 0's communicator with ``slot``-byte slots (made once per size)."""
    if slot not in _BY_SLOT:
        _BY_SLOT[slot] = _steps.Steps(comms(2, slot)[0])
    return _BY_SLOT[slot]


def _two_slot_engines():
    return [_steps.Steps(c) for c in comms(2)]


def _both(fn0, fn1):
    out = [None, None]
    t = threading.Thread(target=lambda: out.__setitem__(1, fn1()))
    t.start()
    out[0] = fn0()
    t.join(10)
    assert not t.is_alive()
    return out


def _header(tag: bytes, seq: int) -> bytes:
    return tag.ljust(24, b".") + seq.to_bytes(4, "little") + b"tail" * 5


def test_header_hash_leaves_out_the_sequence_number_and_sees_every_other_byte():
    h = _steps.header_hash
    assert h(_header(b"a", 0)) == h(_header(b"a", 77)) != h(_header(b"b", 0))
    assert h(_header(b"a", 0) + b"x") != h(_header(b"a", 0) + b"y")
    assert h(b"") == h(memoryview(b""))


def test_steps_agree_on_equal_headers_however_they_were_published_and_catch_any_difference():
    deadline = time.monotonic() + 10
    a, b = _two_slot_engines()
    # the Python step (its header carries the number) and the one-call step (patched in)
    rc = _both(lambda: a.exchange(_header(b"x", 5), None, 0, None, deadline),
               lambda: b.step_barrier(_header(b"x", 0), 5, deadline))
    assert rc == [_comm.OK, _comm.OK] and a.step == b.step == 1
    # another sequence number is a mismatch, on both ranks
    rc = _both(lambda: a.step_barrier(_header(b"x", 0), 6, deadline),
               lambda: b.step_barrier(_header(b"x", 0), 7, deadline))
    assert rc == [_comm.MISMATCH, _comm.MISMATCH]
    assert [x[24] for x in a.headers()] == [6, 7]
    rc = _both(lambda: a.step_barrier(_header(b"x", 0), 8, deadline),
               lambda: b.step_barrier(_header(b"y", 0), 8, deadline))
    assert rc == [_comm.MISMATCH, _comm.MISMATCH]
    rc = _both(lambda: a.sync(deadline), lambda: b.sync(deadline))
    assert rc == [_comm.OK, _comm.OK]


@pytest.mark.parametrize("n", [2, 16, 17, 64, 256])
def test_ring_bytes_shrink_with_the_world_and_follow_the_environment(n, monkeypatch):
    size = eng.default_ring_bytes(n)
    assert size & (size - 1) == 0 and 4096 <= size <= 256 << 10
    assert size == 256 << 10 if n <= 8 else n * n * size <= 16 << 20 or size == 4096
    monkeypatch.setenv("FERRO_SHM_RING_BYTES", "8192")
    assert eng.default_ring_bytes(n) == 8192
    monkeypatch.setenv("FERRO_SHM_RING_BYTES", "5000")
    with pytest.raises(ValueError, match="FERRO_SHM_RING_BYTES '5000'"):
        eng.default_ring_bytes(n)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16, 64])
def test_split_threshold_rises_while_the_ranks_outnumber_the_cores(n, monkeypatch):
    """Unset: 32 KiB, or while oversubscribed 512 KiB / n when that is more (one step instead
    of a pipeline whose waits need ranks the scheduler has not run); set: the setting."""
    monkeypatch.delenv("FERRO_SHM_SPLIT_BYTES", raising=False)
    monkeypatch.setattr(eng, "oversubscribed", lambda nranks: False)
    assert eng.split_bytes(n) == 32 << 10
    monkeypatch.setattr(eng, "oversubscribed", lambda nranks: nranks == n)
    assert eng.split_bytes(n) == max(32 << 10, (512 << 10) // n)
    assert eng.split_bytes(4 if n != 4 else 2) == 32 << 10  # (another job, not oversubscribed)
    if n in (3, 4):
        assert eng.split_bytes(n) >= 128 << 10
    monkeypatch.setenv("FERRO_SHM_SPLIT_BYTES", "16k")
    assert eng.split_bytes(n) == 16 << 10
    monkeypatch.setenv("FERRO_SHM_SPLIT_BYTES", "0")
    assert eng.split_bytes(n) == 0


class _FakeRank0:
    """What _serve_fd needs of a backend: rank 0 of 3, whose sends we can read."""

    rank, world_size = 0, 3

    def __init__(self) -> None:
        self.sent: dict[int, bytes] = {}
        self.ready = threading.Event()

    def send(self, data, dst, *, tag=0):
        self.sent[dst] = bytes(data)
        if len(self.sent) == 2:
            self.ready.set()


def _connect(name: bytes, hello: bytes) -> list[int]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(name)
        s.sendall(hello)
        try:
            _, fds, _, _ = socket.recv_fds(s, 1, 1)
        except (ConnectionError, OSError):
            return []
        return fds


def test_a_stranger_without_the_secret_gets_nothing_and_the_ranks_get_the_segment():
    fake = _FakeRank0()
    fd = os.memfd_create("test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    os.pwrite(fd, b"segment", 0)
    server = threading.Thread(target=eng._serve_fd,
                              args=(fake, fd, time.monotonic() + 20))
    server.start()
    assert fake.ready.wait(10)
    msg1, msg2 = fake.sent[1], fake.sent[2]
    name = msg1[:eng._NAME_BYTES]
    assert name == msg2[:eng._NAME_BYTES] and msg1[eng._NAME_BYTES:] != msg2[eng._NAME_BYTES:]
    # strangers: a wrong secret, a right secret for the wrong rank, and silence
    assert _connect(name, struct.pack("<I", 1) + b"x" * 32) == []
    assert _connect(name, struct.pack("<I", 2) + msg1[eng._NAME_BYTES:]) == []
    got = []
    for rank, msg in ((1, msg1), (2, msg2)):
        fds = _connect(name, struct.pack("<I", rank) + msg[eng._NAME_BYTES:])
        assert len(fds) == 1
        got.append(os.pread(fds[0], 7, 0))
        os.close(fds[0])
    server.join(10)
    os.close(fd)
    assert got == [b"segment", b"segment"]
    # and a rank cannot be served twice
    assert not server.is_alive()


def test_segment_is_shared_has_no_name_and_checks_cross_memory_reads():
    body = """
seg = b.engine
seg.slot_data(b.rank, 0)[0] = 7 + b.rank
b.barrier()
result = [int(seg.slot_data(r, 0)[0]) for r in range(3)] + [
    seg.cma_ok, len(seg.pids), seg.layout["slot_bytes"]]
"""
    before = set(os.listdir("/dev/shm"))
    for res in run_job(body, 3, backend="ShmBackend", env={"FERRO_SHM_SLOT_BYTES": "8192"}):
        assert res == [7, 8, 9, True, 3, 8192]
    assert [n for n in set(os.listdir("/dev/shm")) - before if "ferro" in n] == []


def test_engine_can_be_turned_off():
    body = "result = b.engine is None"
    assert run_job(body, 2, backend="ShmBackend", env={"FERRO_SHM_ENGINE": "0"}) == [True, True]


def test_failure_flag_is_raised_when_a_peer_closes():
    body = """
if b.rank == 1:
    b.close()
    result = None
else:
    t0 = time.monotonic()
    while not b.engine.failed and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    result = int(b.engine.failed)
"""
    assert run_job(body, 2, backend="ShmBackend")[0] == 1


def test_a_failure_seen_before_its_callback_is_registered_still_reaches_it():
    # a peer can close while this rank is still joining the segment: the engine's flag,
    # registered afterwards, must be raised all the same
    from ferro_backend.mailbox import Mailbox

    box = Mailbox(0, lambda: 5.0)
    calls: list[str] = []
    box.add_failure_callback(lambda: calls.append("early"))
    assert calls == []  # nothing has failed yet
    box.peer_closed(1, "it closed its backend")
    assert calls == ["early"]
    box.add_failure_callback(lambda: calls.append("late"))
    assert calls == ["early", "late"]  # registered after the failure: called at once
    box.abort(1, "stop")
    assert calls == ["early", "late", "early", "late"]


def test_rendezvous_error_names_the_rank_when_rank0_sends_no_segment(monkeypatch):
    class _Peer:
        rank, world_size, timeout = 1, 2, 1.0

        def recv(self, out, src, *, tag=0, timeout=None):
            out[:] = b"\0ferro-engine-" + b"0" * 32 + b"k" * 32

    with pytest.raises(RendezvousError, match="rank 1: cannot fetch the engine segment"):
        eng._fetch_fd(_Peer(), time.monotonic() + 1)


def test_shm_backend_world_of_one_has_no_engine():
    with ShmBackend(0, 1, "127.0.0.1:1") as b:
        assert b.engine is None


def test_a_closed_engine_lets_its_segment_go_once_no_view_of_it_is_left():
    """Closed, the backend and its engine still referenced: the segment stays mapped while a
    view of it lives (reading it is safe) and goes with the last one (each closed backend kept
    its ~6 MiB mapping until it was garbage collected)."""
    body = """
import gc
try:
    import ferro_collective as fc
    fc.allreduce(np.ones(1000), b)  # (its state holds views of the slots)
except ImportError:
    pass
def mapped():
    gc.collect()
    return sum("ferro-engine" in line for line in open("/proc/self/maps"))
seen = [mapped()]
kept = b.engine.slot_data(b.rank, 0)
kept[:4] = 7
b.barrier()
b.close()
seen.append(mapped())
value = int(kept[0])
del kept
seen.append(mapped())
result = seen + [value, b.engine is not None]
"""
    assert run_job(body, 2, backend="ShmBackend") == [[1, 1, 0, 7, True]] * 2
