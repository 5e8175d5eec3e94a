"""Async handles interleaved with sync calls, mismatch detection, timeouts and stall reports."""

import logging
import re
import threading
import time

import numpy as np
import pytest

from ferro_backend import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerAbortedError,
    SimulatedBackend,
    SubBackend,
)
from ferro_backend.testing import run_ranks, run_threads
from ferro_collective import (
    ReduceOp,
    Work,
    all_gather,
    all_gather_async,
    allreduce,
    allreduce_async,
    barrier,
    broadcast,
    broadcast_async,
    reduce_scatter_async,
    set_stall_report,
)


def test_async_handles_interleaved_with_sync_calls():
    def fn(b):
        r, n = b.rank, b.world_size
        works = [allreduce_async(np.full(1000, float(r + i)), b) for i in range(5)]
        sync = allreduce(np.ones(7), b)
        ag = all_gather_async(np.array([r, r]), b)
        rs = reduce_scatter_async(np.arange(2.0 * n), b, ReduceOp.MEAN)
        bc = broadcast_async(np.array([r]), b, root=1)
        sync2 = all_gather(np.array(r * 3), b)
        assert all(isinstance(w, Work) for w in works)
        results = [w.wait(30) for w in reversed(works)][::-1]
        return results, sync, ag.wait(30), rs.wait(30), bc.wait(30), sync2

    n = 4
    for r, (results, sync, ag, rs, bc, sync2) in enumerate(run_ranks(fn, n, timeout=60)):
        for i, res in enumerate(results):
            np.testing.assert_array_equal(res, np.full(1000, sum(k + i for k in range(n))))
        np.testing.assert_array_equal(sync, np.full(7, 4.0))
        np.testing.assert_array_equal(ag, np.repeat(np.arange(n), 2))
        np.testing.assert_array_equal(rs, [2.0 * r, 2.0 * r + 1])
        np.testing.assert_array_equal(bc, [1])
        np.testing.assert_array_equal(sync2, [0, 3, 6, 9])


def test_work_is_completed_and_wait_is_repeatable():
    def fn(b):
        w = allreduce_async(np.ones(3), b)
        out = w.wait(30)
        assert w.is_completed()
        np.testing.assert_array_equal(w.wait(), out)
        return out

    run_ranks(fn, 2)


def test_work_wait_reraises_the_collective_error():
    def fn(b):
        if b.rank == 0:
            w = allreduce_async(np.ones(3), b, timeout=0.3)
            with pytest.raises(CollectiveTimeoutError, match="allreduce"):
                w.wait(10)
        return "ok"

    run_ranks(fn, 2)


def test_work_wait_timeout_shorter_than_collective():
    g = SimulatedBackend.create_group(2)
    w = allreduce_async(np.ones(3), g[0], timeout=5)
    with pytest.raises(CollectiveTimeoutError, match=r"not complete after 0.1s"):
        w.wait(0.1)
    assert not w.is_completed()
    allreduce(np.ones(3), g[1])
    np.testing.assert_array_equal(w.wait(10), [2, 2, 2])


@pytest.mark.parametrize("world", [2, 3, 5])
def test_mismatched_collectives_raise_on_every_rank(world):
    def fn(b):
        if b.rank == 1:
            return broadcast(np.zeros(4, np.float32), b, root=0, timeout=10)
        return allreduce(np.zeros(4, np.float32), b, timeout=10)

    errors = run_ranks_collect(fn, world)
    assert set(errors) == set(range(world))
    for e in errors.values():
        assert isinstance(e, CollectiveMismatchError)
        assert "ranks [1] called broadcast(float32[4], root=0)" in str(e)
        assert "allreduce(float32[4], SUM)" in str(e)


def test_mismatched_dtype_and_shape_are_named():
    def fn(b):
        x = np.zeros((2, 3), np.float64) if b.rank == 0 else np.zeros((3, 2), np.float32)
        return all_gather(x, b, timeout=10)

    errors = run_ranks_collect(fn, 2)
    msg = str(errors[0])
    assert "all_gather(float64[2, 3])" in msg and "all_gather(float32[3, 2])" in msg
    assert str(errors[1]) == msg


def run_ranks_collect(fn, world):
    errors = {}

    def wrap(b):
        try:
            fn(b)
        except Exception as exc:
            errors[b.rank] = exc

    run_ranks(wrap, world, timeout=30)
    return errors


def test_timeout_fires_and_names_missing_ranks():
    def fn(b):
        if b.rank == 2:
            time.sleep(1.0)  # never calls the collective
            return None
        t0 = time.monotonic()
        # the first rank to time out aborts the group (no peer completes the call without
        # it): the other raises PeerAbortedError carrying that timeout
        with pytest.raises((CollectiveTimeoutError, PeerAbortedError)) as info:
            allreduce(np.ones(3), b, timeout=0.4)
        assert time.monotonic() - t0 < 5  # at the 0.4 s deadline (a loaded host's room)
        return type(info.value).__name__, str(info.value)

    msgs = run_ranks(fn, 3, timeout=20)[:2]
    assert "CollectiveTimeoutError" in {kind for kind, _ in msgs}, msgs
    assert all("allreduce (seq 0)" in m and "timed out after 0.4s" in m and "2" in m
               for _, m in msgs)


def test_stall_report_is_logged_before_the_timeout(caplog):
    # rank 0 calls once rank 1's stall report is logged (at 0.5 s), long before rank 1's
    # 10 s deadline: an event set by a log handler, not a sleep that load could outlast
    reported = threading.Event()

    class _Seen(logging.Handler):
        def emit(self, record):
            if "still waiting" in record.getMessage():
                reported.set()

    seen = _Seen()
    set_stall_report(0.05)
    logging.getLogger("ferro_collective").addHandler(seen)
    try:
        def fn(b):
            if b.rank == 0:
                assert reported.wait(30), "no stall report within 30 s"
            return allreduce(np.ones(2), b, timeout=10)

        with caplog.at_level(logging.WARNING, logger="ferro_collective"):
            run_ranks(fn, 2, timeout=60)
    finally:
        logging.getLogger("ferro_collective").removeHandler(seen)
        set_stall_report(0.5)
    stalls = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert stalls and "allreduce (seq 0) on rank 1" in stalls[0] and "[0]" in stalls[0]


def test_stall_report_fraction_is_validated():
    with pytest.raises(ValueError, match="not in"):
        set_stall_report(1.5)


def test_peer_abort_reaches_a_waiting_collective():
    g = SimulatedBackend.create_group(3)

    def fn(b):
        if b.rank == 0:
            time.sleep(0.2)
            raise RuntimeError("rank 0 blew up")
        return allreduce(np.ones(3), b, timeout=30)

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="blew up"):
        run_threads(fn, g, timeout=20)
    assert time.monotonic() - t0 < 5


def test_peer_aborted_error_surfaces():
    def fn(b):
        if b.rank == 1:
            b.abort("bad data")
            return None
        with pytest.raises(PeerAbortedError, match="bad data"):
            allreduce(np.ones(3), b, timeout=30)
        return "ok"

    run_ranks(fn, 3, timeout=20, abort_on_error=False)


def test_collectives_on_subgroups_and_parent_concurrently():
    def fn(b):
        sub = SubBackend(b, [0, 1] if b.rank < 2 else [2, 3])
        w = allreduce_async(np.full(5, b.rank + 1.0), sub)
        whole = allreduce(np.ones(5), b)
        part = w.wait(30)
        barrier(sub)
        return whole, part

    res = run_ranks(fn, 4, timeout=30)
    for r, (whole, part) in enumerate(res):
        np.testing.assert_array_equal(whole, np.full(5, 4.0))
        np.testing.assert_array_equal(part, np.full(5, 3.0 if r < 2 else 7.0))


def test_unknown_algorithm_and_op():
    # every rank makes the bad call (one rank's argument error reaches its peers in the call:
    # test_habits.py), and every rank raises at once
    for kwargs, match in [({"algorithm": "bogus"}, "unknown algorithm 'bogus'"),
                          ({"op": "median"}, "unknown reduce op")]:
        errors = run_ranks_collect(lambda b, kw=kwargs: allreduce(np.ones(2), b, **kw), 2)
        assert sorted(errors) == [0, 1]
        for exc in errors.values():
            assert isinstance(exc, ValueError) and re.search(match, str(exc)), exc
    with pytest.raises(TypeError, match="backend must be"):
        allreduce(np.ones(2), "not a backend")


def test_bfloat16_accumulates_in_float32():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = np.dtype(ml_dtypes.bfloat16)
    xs = [np.full(4, 1.0 / 3, bf) for _ in range(4)]
    res = run_ranks(lambda b: allreduce(xs[b.rank], b), 4)
    expected = (np.float32(xs[0][0]) * 4).astype(bf)
    for r in res:
        assert r.dtype == bf and (r == expected).all()
