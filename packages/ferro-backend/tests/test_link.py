"""The link probe between the ranks' cores (engine/_probe.h, engine/link.py): run as the job
forms, again on request, the same on every rank, shown by describe() and the timeline."""

import json
import time

import numpy as np
import pytest

from ferro_backend import CollectiveTimeoutError
from ferro_backend.engine import _calls, _comm, _segment
from ferro_backend.engine.link import SHARED_CACHE_NS, Link
from ferro_backend.testing import run_processes


def _links(b):
    first = b.engine.link
    again = [b.engine.probe_link(timeout=20) for _ in range(2)]
    return first, again, b.engine.link, b.describe()


def test_every_rank_gets_the_same_probe_as_the_job_forms_and_again_on_request():
    res = run_processes(_links, 2, transport="shm", timeout=90)
    firsts = [r[0] for r in res]
    assert all(isinstance(f, Link) for f in firsts)
    # rank 0 stamps the slowest pair's figures; every rank reads the same
    assert len({(f.rtt_ns, f.copy_gbps) for f in firsts}) == 1
    f = firsts[0]
    assert 1.0 < f.rtt_ns < 1e6 and 0.01 < f.copy_gbps < 1e4
    for r in range(2):
        assert len({(x[1][r].rtt_ns, x[1][r].copy_gbps) for x in res}) == 1
        assert res[0][1][r].at >= f.at
    assert all(x[2] is x[1][1] for x in res)  # the latest probe is the engine's link
    for *_, text in res:
        assert "at the last link probe, the ranks' cores share" in text and "round trip" in text


@pytest.mark.parametrize("nranks", [2, 3, 5])
def test_rank_0_probes_every_peer_in_turn_and_stamps_the_slowest(nranks):
    """The protocol itself, ranks as threads over one segment (more ranks than cores: the
    waits yield), three runs of the same segment in a row."""
    import threading

    slot = 65536
    seg = np.zeros(_segment.layout(nranks, slot, 4096)["size"], np.uint8)
    flag = np.zeros(1, np.uint32)
    maps = [_segment.SegmentMap(seg, nranks, r, slot, 4096, flag.ctypes.data)
            for r in range(nranks)]
    for run in range(3):
        out: dict = {}

        def rank(r, run=run, out=out):
            out[r] = maps[r].probe_links(30.0, rounds=40, copies=4)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(nranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(set(out.values())) == 1 and len(out) == nranks
        rtt, gbps = out[0]
        assert rtt > 0 and gbps > 0
        # the segment counts its probes; every rank reads rank 0's stamp
        assert {m.link_state() for m in maps} == {(run + 1, rtt, gbps, maps[0].link_state()[3])}


def test_the_state_follows_the_round_trip():
    assert Link(SHARED_CACHE_NS - 1, 20.0, 0).shared_cache
    assert not Link(SHARED_CACHE_NS + 1, 20.0, 0).shared_cache
    assert "share no cache (a cache line's round trip 110 ns, copies from core to core 5.8 " \
        "GB/s)" in Link(110.0, 5.8, 0).describe()


def _one_rank_probes(b, path):
    done = path / "probed"
    if b.rank == 0:
        t0 = time.monotonic()
        try:
            with pytest.raises(CollectiveTimeoutError, match="link probe timed out after 0.5s"):
                b.engine.probe_link(timeout=0.5)
            return time.monotonic() - t0
        finally:
            done.write_text("")
    # never takes part, and holds its backend open until rank 0's probe has ended (not a fixed
    # sleep that a slow start of rank 0 could outlast): a file flag, polled for at most 30 s
    deadline = time.monotonic() + 30
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return None


def test_a_rank_that_does_not_take_part_times_the_probe_out(tmp_path):
    took, _ = run_processes(_one_rank_probes, 2, tmp_path, transport="shm", timeout=60)
    # at its 0.5 s timeout: the upper bound only allows for a loaded host (rank 1 would have
    # held it for 30 s)
    assert 0.5 <= took < 5


def _small_slots(b):
    return b.engine.slot_bytes, b.engine.link.copy_gbps > 0, b.engine.probe_link().rtt_ns > 0


def test_slots_smaller_than_the_probe_copy_probe_with_a_slot(monkeypatch):
    monkeypatch.setenv("FERRO_SHM_SLOT_BYTES", "4096")
    assert run_processes(_small_slots, 2, transport="shm", timeout=60) == [(4096, True, True)] * 2


def _oversubscribed(b):
    return b.engine.link, b.engine.probe_link(timeout=5)


def test_no_probe_where_the_ranks_outnumber_the_cores(monkeypatch):
    # (ferrorun --emulate-nodes tells a rank how many share its host: here more than its cores)
    monkeypatch.setenv("FERRO_HOST_RANKS", "4096")
    assert run_processes(_oversubscribed, 2, transport="shm", timeout=60) == [(None, None)] * 2


def test_probe_arguments_out_of_range_are_refused():
    seg = np.zeros(_segment.layout(1, 4096, 4096)["size"], np.uint8)
    flag = np.zeros(1, np.uint32)
    m = _segment.SegmentMap(seg, 1, 0, 4096, 4096, flag.ctypes.data)
    assert m.probe_links(1.0, nbytes=4096) == (0.0, 0.0)  # one rank: no pair to probe
    for bad in ({"rounds": 0}, {"copies": 2000}, {"nbytes": 8192}):
        with pytest.raises(ValueError, match="rounds .* copies .* bytes"):
            m.probe_links(1.0, **bad)


def _traced_probe(b, path):
    from ferro_backend import timeline

    with timeline.trace(path / f"rank{b.rank}.json", backend=b):
        b.engine.probe_link(timeout=20)
    return json.loads((path / f"rank{b.rank}.json").read_text())["traceEvents"]


def test_the_timeline_says_where_the_ranks_landed(tmp_path):
    for events in run_processes(_traced_probe, 2, tmp_path, transport="shm", timeout=90):
        (label,) = [e for e in events if e["name"] == "process_labels"]
        assert label["args"]["labels"].startswith("at the last link probe, the ranks' cores share")
        (probe,) = [e for e in events if e["name"] == "link probe"]
        assert probe["cat"] == "engine" and probe["args"]["rtt_ns"] > 0
        assert isinstance(probe["args"]["shared_cache"], bool)


def _allreduce(b, x: np.ndarray, general: bool = False) -> np.ndarray:
    """x summed over the ranks by the engine's door (float32); ``general``: in a turn of its
    own first (``comm.begin``), as ferro-collective's general path runs a door call."""
    comm, out = b.engine.comm, np.empty_like(x)
    call = _calls.Call(comm, _calls.ALLREDUCE, 0)  # (float32, SUM)
    if not general:
        assert call.run(x, out, timeout=20.0) == _comm.OK, _comm.last_error()
        return out
    ticket = comm.reserve()
    try:
        assert comm.begin(ticket, 20.0, "allreduce") == _comm.OK, _comm.last_error()
        assert call.run(x, out, ticket, 20.0) == _comm.OK, _comm.last_error()
    finally:
        comm.end(ticket)
    return out


def _reprobes(b, seconds, general_on=None):
    """Door calls (allreduces) for ``seconds``; the probes seen. ``general_on``: that rank runs
    each in a turn of its own first (ferro_comm_begin), as ferro's general path does."""
    first = b.engine.link
    x = np.ones(1024, np.float32)
    seen, end = {first.probe}, time.monotonic() + seconds
    while True:
        x[1] = time.monotonic() > end  # (every rank stops after the same call)
        got = _allreduce(b, x, b.rank == general_on)
        assert got[0] == b.world_size  # (the calls around each probe stay right)
        seen.add(b.engine.link.probe)
        if got[1]:
            break
    last = b.engine.link
    return first, last, sorted(seen), b.engine.comm.reprobe_seconds


def test_the_engine_probes_again_by_itself_while_calls_run(monkeypatch):
    monkeypatch.setenv("FERRO_SHM_REPROBE", "0.2")
    res = run_processes(_reprobes, 2, 2.0, transport="shm", timeout=90)
    (f0, l0, seen0, every0), (f1, l1, seen1, every1) = res
    assert f0 == f1 and f0.probe == 1  # the join's
    assert l0 == l1 and l0.probe >= 4  # every 0.2 s for 2 s, both ranks after the same call
    assert l0.at > f0.at and 1.0 < l0.rtt_ns < 1e6
    assert len(seen0) >= 3 and set(seen0) <= set(range(1, l0.probe + 1))
    assert (every0, every1) == (0.2, 0.0)  # rank 0 asks; the others follow


@pytest.mark.parametrize("general_on", [0, 1])
def test_re_probes_where_one_rank_takes_the_general_path(monkeypatch, general_on):
    monkeypatch.setenv("FERRO_SHM_REPROBE", "0.2")
    (f0, l0, *_), (f1, l1, *_) = run_processes(_reprobes, 2, 1.5, general_on, transport="shm",
                                               timeout=90)
    assert l0 == l1 and l0.probe >= 3


def test_no_re_probe_when_it_is_turned_off(monkeypatch):
    monkeypatch.setenv("FERRO_SHM_REPROBE", "0")
    for first, last, seen, every in run_processes(_reprobes, 2, 1.0, transport="shm",
                                                  timeout=90):
        assert first is last and seen == [1] and every == 0.0


def _copies_changed_speed(b):
    """Rank 0's copies "slowed down": its reference is made 4x faster than they run."""
    x = np.ones(64 << 8, np.float32)  # 64 KiB: copies into the slot timed (_put.h)
    for _ in range(50):
        _allreduce(b, x)
    comm = b.engine.comm
    before = b.engine.link.probe
    if b.rank == 0:
        assert comm.copy_ns_per_kib > 0
        comm.copy_ns_at_probe = comm.copy_ns_per_kib / 4
    time.sleep(0.6)  # (past the shortest gap between probes)
    for _ in range(40):
        _allreduce(b, x)
    return before, b.engine.link.probe, comm.copy_ns_at_probe > 0


def test_a_re_probe_follows_copies_that_change_speed(monkeypatch):
    monkeypatch.setenv("FERRO_SHM_REPROBE", "1000")  # (not by the clock here)
    (b0, a0, ref0), (b1, a1, _) = run_processes(_copies_changed_speed, 2, transport="shm",
                                                timeout=90)
    assert b0 == b1 and a0 == a1 and a0 > b0 and ref0
