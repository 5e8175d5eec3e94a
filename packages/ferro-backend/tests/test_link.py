"""The link probe between the ranks' cores (engine/_probe.h, engine/link.py): run as the job
forms, again on request, the same on every rank, shown by describe() and the timeline."""

import json
import time

import numpy as np
import pytest

from ferro_backend import CollectiveTimeoutError
from ferro_backend.engine import _segment
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
            out[r] = maps[r].probe_links(run, 30.0, rounds=40, copies=4)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(nranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(set(out.values())) == 1 and len(out) == nranks
        rtt, gbps = out[0]
        assert rtt > 0 and gbps > 0


def test_the_state_follows_the_round_trip():
    assert Link(SHARED_CACHE_NS - 1, 20.0, 0).shared_cache
    assert not Link(SHARED_CACHE_NS + 1, 20.0, 0).shared_cache
    assert "share no cache (a cache line's round trip 110 ns, copies from core to core 5.8 " \
        "GB/s)" in Link(110.0, 5.8, 0).describe()


def _one_rank_probes(b):
    if b.rank == 0:
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match="link probe timed out after 0.5s"):
            b.engine.probe_link(timeout=0.5)
        return time.monotonic() - t0
    time.sleep(2.0)  # never takes part
    return None


def test_a_rank_that_does_not_take_part_times_the_probe_out():
    took, _ = run_processes(_one_rank_probes, 2, transport="shm", timeout=60)
    assert 0.5 <= took < 1.8


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
    assert m.probe_links(0, 1.0, nbytes=4096) == (0.0, 0.0)  # one rank: no pair to probe
    for bad in ({"rounds": 0}, {"copies": 2000}, {"nbytes": 8192}):
        with pytest.raises(ValueError, match="rounds .* copies .* bytes"):
            m.probe_links(1, 1.0, **bad)


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
