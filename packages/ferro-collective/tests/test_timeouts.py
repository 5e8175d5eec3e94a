"""Collectives take their deadline from ``Backend.timeout`` (one source); ``timeout=`` wins."""

import time

import numpy as np
import pytest

import ferro_collective as fc
from ferro_backend import CollectiveTimeoutError, PeerAbortedError, SimulatedBackend, SubBackend

CALLS = {
    "allreduce": lambda b, **kw: fc.allreduce(np.ones(4), b, **kw),
    "broadcast": lambda b, **kw: fc.broadcast(np.ones(4), b, **kw),
    "all_gather": lambda b, **kw: fc.all_gather(np.ones(4), b, **kw),
    "reduce_scatter": lambda b, **kw: fc.reduce_scatter(np.ones(4), b, **kw),
    "barrier": lambda b, **kw: fc.barrier(b, **kw),
    "allreduce_async": lambda b, **kw: fc.allreduce_async(np.ones(4), b, **kw).wait(),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", list(CALLS))
def test_collective_with_a_silent_peer_raises_within_the_backend_timeout(name):
    rank0, _silent = SimulatedBackend.create_group(2, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="0.5s"):
        CALLS[name](rank0)
    assert time.monotonic() - t0 < 5  # gave up at its deadline, with a loaded host's room


@pytest.mark.timeout(30)
def test_per_call_timeout_wins_and_subgroups_inherit_the_parent_timeout():
    rank0, _silent = SimulatedBackend.create_group(2, timeout=30)
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="0.2s"):
        fc.allreduce(np.ones(3), rank0, timeout=0.2)
    assert time.monotonic() - t0 < 5  # gave up at its deadline, with a loaded host's room
    rank0, _silent = SimulatedBackend.create_group(2, timeout=30)  # (a timeout ended the last)
    rank0.timeout = 0.3
    sub = SubBackend(rank0, [0, 1])
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="0.3s"):
        fc.allreduce(np.ones(3), sub)
    assert time.monotonic() - t0 < 5  # gave up at its deadline, with a loaded host's room


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [float("nan"), -1.0, "1s"], ids=repr)
@pytest.mark.parametrize("name", list(CALLS))
def test_bad_timeouts_raise_value_error_naming_the_collective(name, bad):
    # one rank: on several, a rank's bad argument is refused to its peers in the call
    # (test_habits.py), and every rank raises once they have all made it
    (rank0,) = SimulatedBackend.create_group(1)
    op = name.removesuffix("_async")
    with pytest.raises(ValueError, match=f"{op}: timeout"):
        CALLS[name](rank0, timeout=bad)


@pytest.mark.timeout(30)
def test_work_wait_refuses_bad_timeouts():
    rank0, _silent = SimulatedBackend.create_group(2, timeout=0.3)
    work = fc.allreduce_async(np.ones(2), rank0)
    with pytest.raises(ValueError, match="Work.wait: timeout"):
        work.wait(float("nan"))
    with pytest.raises(CollectiveTimeoutError):
        work.wait()
    assert work.is_completed() and work.future.done()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("forever", [float("inf"), 1e300, 1e10], ids=repr)
def test_work_wait_takes_an_unbounded_timeout_as_the_collectives_do(forever):
    # beyond threading.TIMEOUT_MAX, concurrent.futures.wait raised OverflowError
    group = SimulatedBackend.create_group(2, timeout=10)
    work = fc.allreduce_async(np.ones(2), group[0])
    late = fc.allreduce_async(np.ones(2), group[1])
    np.testing.assert_array_equal(work.wait(forever), [2.0, 2.0])
    np.testing.assert_array_equal(late.wait(forever), [2.0, 2.0])


@pytest.mark.timeout(30)
def test_the_timeout_names_the_ranks_not_heard_from_as_such():
    # with Bruck's relays one absent rank holds back others: the message says so
    group = SimulatedBackend.create_group(4, timeout=0.5)
    from ferro_backend.testing import run_threads

    def call(b):
        if b.rank == 2:
            return None
        try:
            fc.allreduce(np.ones(2), b)
        except (CollectiveTimeoutError, PeerAbortedError) as exc:  # (the first one's abort)
            return str(exc)
        return "no error"

    said = [m for m in run_threads(call, group, timeout=20) if m is not None]
    assert all("ranks not heard from yet" in m for m in said), said
    assert any("the absent one is among these" in m for m in said), said


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_late_peer_never_completes_a_call_another_rank_gave_up_on(how):
    # rank 0 timed out; rank 1's later call took rank 0's header and data, already sent, for
    # a live call and returned [102, 102] while rank 0 had raised (threads, TCP, the engine)
    import threading

    from ferro_backend.testing import run_threads

    group = SimulatedBackend.create_group(2, timeout=10)
    gave_up = threading.Event()

    def call(b, x):
        if how == "sync":
            return fc.allreduce(x, b, timeout=0.5 if b.rank == 0 else 5)
        return fc.allreduce_async(x, b, timeout=0.5 if b.rank == 0 else 5).wait()

    def body(b):
        if b.rank == 1:
            gave_up.wait(20)
        try:
            got = call(b, np.full(2, 100.0 if b.rank == 0 else 2.0))
            return ("result", got.tolist())
        except (CollectiveTimeoutError, PeerAbortedError) as exc:
            return (type(exc).__name__, str(exc))
        finally:
            gave_up.set()

    said = run_threads(body, group, timeout=40, abort_on_error=False, raise_first=False)
    assert said[0][0] == "CollectiveTimeoutError", said
    assert said[1][0] == "PeerAbortedError" and "rank 0" in said[1][1], said


def _subgroup_verdicts(said):
    first, outside, late = said
    assert late[0] is True, late  # rank 2 called once rank 0's abort notice had come
    late = late[1:]
    assert first[0][0] == "CollectiveTimeoutError", first
    assert late[0][0] == "PeerAbortedError" and "rank 0 gave up on this subgroup" in late[0][1], late
    assert late[0][2], late  # at once, not at its own deadline
    assert first[-1] == late[-1] == outside[-1] == [3.0, 3.0]  # the parent goes on


@pytest.mark.timeout(90)
def test_a_late_member_of_a_subgroup_never_completes_a_call_another_gave_up_on():
    """A subgroup's timeout aborts the subgroup alone (SubBackend.abort_group): its late
    member raises PeerAbortedError naming the rank, the parent and its other ranks go on."""
    import tcp_fns

    from ferro_backend.testing import run_threads

    said = run_threads(tcp_fns.subgroup_gave_up, SimulatedBackend.create_group(3, timeout=30),
                       timeout=60)
    _subgroup_verdicts(said)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport,engine", [("tcp", False), ("shm", False), ("shm", True)])
def test_a_subgroup_gives_up_alone_between_processes(transport, engine):
    import tcp_fns

    from ferro_backend.testing import run_processes

    _subgroup_verdicts(run_processes(tcp_fns.subgroup_gave_up, 3, engine, transport=transport,
                                     timeout=150, backend_timeout=30))
