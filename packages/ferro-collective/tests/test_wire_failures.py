"""Compressed calls (``wire=``) that fail: a rank that gives up on one ends its group, as the
exact calls do; a bad argument on one rank is refused on every rank; each rank's error names
the user's call, not the exact collectives it is made of; a failed call leaves its error
feedback as it was."""

import threading
import time

import numpy as np
import pytest
import wire_fns

import ferro_collective as fc
from ferro_backend.testing import run_processes, run_ranks

pytestmark = pytest.mark.timeout(120)

CALLS = {
    "allreduce": lambda x, b, **kw: fc.allreduce_async(x, b, **kw),
    "reduce_scatter": lambda x, b, **kw: fc.reduce_scatter_async(x, b, **kw),
    "all_gather": lambda x, b, **kw: fc.all_gather_async(x, b, **kw),
}


def outcome(fn):
    """``fn()``'s error and how long it took (None: it returned)."""
    t = time.monotonic()
    try:
        fn()
        error = None
    except Exception as exc:
        error = exc
    return error, time.monotonic() - t


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_a_background_call_a_rank_gave_up_on_ends_the_group(name, wire):
    """Rank 0 gives up on ``*_async(..., wire=)`` (its deadline passed while rank 1 was late):
    it aborts the group, so the late rank 1 raises PeerAbortedError at once (not its own
    deadline later), and the group's later calls raise at once too."""
    def body(b):
        if b.rank:
            time.sleep(2.0)
        x = np.full(600 if name != "reduce_scatter" else 600 * 2, b.rank + 1.0, np.float32)
        first = outcome(lambda: CALLS[name](x, b, wire=wire,
                                            timeout=20 if b.rank else 1.0).wait(60))
        if not b.rank:
            time.sleep(1.5)  # (the late rank has met the call)
        after = outcome(lambda: fc.allreduce(np.ones(3), b, timeout=20))
        return first, after

    (first0, after0), (first1, after1) = run_ranks(body, 2, timeout=60)
    assert isinstance(first0[0], fc.CollectiveTimeoutError), first0
    assert isinstance(first1[0], fc.PeerAbortedError), first1
    assert first1[1] < 5, first1  # at once, not after its own deadline of 20 s
    assert "rank 0" in str(first1[0]) and "gave up" in str(first1[0])
    for error, took in (after0, after1):
        assert isinstance(error, (fc.PeerAbortedError, fc.PeerClosedError)), error
        assert took < 5


SIZES = {"allreduce": 8, "reduce_scatter": 4, "all_gather": 16}


@pytest.mark.parametrize("name", sorted(SIZES))
@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("bad", ["shape", "dtype", "list", "read-only"])
def test_a_bad_out_on_one_rank_is_refused_on_every_rank(name, background, bad):
    """A wrong ``out=`` on rank 1 of a compressed call: rank 1 raises its argument error when
    the call is made; rank 0 raises CollectiveMismatchError naming rank 1 and the reason (no
    rank returns a result from a call another rank refused), and the next call works."""
    size = SIZES[name]
    outs = {"shape": np.empty(size + 1, np.float32), "dtype": np.empty(size, np.float64),
            "list": [0.0] * size, "read-only": np.empty(size, np.float32)}
    outs["read-only"].flags.writeable = False
    expected = {"shape": fc.SizeMismatchError, "dtype": fc.SizeMismatchError,
                "list": TypeError, "read-only": ValueError}[bad]

    def body(b):
        x = np.arange(8, dtype=np.float32)
        out = outs[bad] if b.rank else np.empty(size, np.float32)
        if background:
            error = outcome(lambda: CALLS[name](x, b, wire="bf16", out=out,
                                                timeout=10).wait(30))[0]
        else:
            error = outcome(lambda: getattr(fc, name)(x, b, wire="bf16", out=out,
                                                      timeout=10))[0]
        return error, fc.allreduce(np.ones(2), b, timeout=10).tolist()

    (e0, next0), (e1, next1) = run_ranks(body, 2, timeout=60)
    assert type(e1) is expected, e1
    assert isinstance(e0, fc.CollectiveMismatchError), e0
    assert "rank 1 refused the call" in str(e0) and expected.__name__ in str(e0), e0
    assert next0 == next1 == [2.0, 2.0]


@pytest.mark.parametrize("name", sorted(SIZES))
def test_a_strided_out_is_still_written(name):
    size = SIZES[name]

    def body(b):
        out = np.zeros((size, 2), np.float32)[:, 0]
        got = getattr(fc, name)(np.arange(8, dtype=np.float32), b, wire="bf16", out=out,
                                timeout=10)
        return got is out, out.tolist()

    want = {"allreduce": [2.0 * i for i in range(8)], "reduce_scatter": None,
            "all_gather": list(range(8)) * 2}[name]
    for r, (same, values) in enumerate(run_ranks(body, 2, timeout=60)):
        assert same
        if want is not None:
            assert values == [float(v) for v in want]
        else:
            assert values == [2.0 * v for v in range(4 * r, 4 * r + 4)]


@pytest.mark.parametrize("name, wires", [
    ("allreduce", ("bf16", "int8")), ("allreduce", ("fp16", "int4")),
    ("reduce_scatter", ("bf16", "int4")), ("all_gather", ("fp16", "int8"))])
@pytest.mark.parametrize("background", [False, True])
def test_ranks_that_disagree_on_the_wire_are_named_by_their_calls(name, wires, background):
    """Wires whose rows differ in width: the mismatch met by the internal all-to-all's (or
    all-gather's) header check is told in the user's words on every rank, each rank's call
    named (before: ``all_to_all_single(uint8[*, 136])`` against ``(uint8[*, 388])``)."""
    def body(b):
        wire = wires[b.rank]
        x = np.arange(8, dtype=np.float32)
        if background:
            return outcome(lambda: CALLS[name](x, b, wire=wire, timeout=10).wait(30))[0]
        return outcome(lambda: getattr(fc, name)(x, b, wire=wire, timeout=10))[0]

    args = "(float32[8], SUM)" if name != "all_gather" else "(float32[8])"
    for rank, error in enumerate(run_ranks(body, 2, timeout=60)):
        assert isinstance(error, fc.CollectiveMismatchError), error
        text = str(error)
        assert text.startswith(f"{name}[{wires[rank]}]: ranks disagree on the call"), text
        assert f"ranks [{rank}] called {name}[{wires[rank]}]{args}" in text, text
        theirs = text.partition(f"ranks [{1 - rank}] called ")[2]
        assert f"{name}[{wires[1 - rank]}]{args}" in theirs.split("; ranks [")[0], text
        assert "all_to_all_single" not in text and "uint8" not in text, text


def test_an_exact_call_against_a_compressed_one_is_named_by_both_calls():
    def body(b):
        return outcome(lambda: fc.allreduce(np.ones(4, np.float32), b, timeout=10,
                                            wire="bf16" if b.rank else None))[0]

    errors = run_ranks(body, 2, timeout=60)
    assert all(isinstance(e, fc.CollectiveMismatchError) for e in errors), errors
    assert str(errors[1]) == ("allreduce[bf16]: ranks disagree on the call: ranks [0] called "
                              "allreduce(float32[4], SUM); ranks [1] called "
                              "allreduce[bf16](float32[4], SUM)")
    # the exact call's rank reads the peer's first collective as what begins a call of several
    # (it read as if the peer had called all_to_all_single)
    assert ("ranks [1] called all_to_all_single(uint8[*, 132]) (seq 0; the first of the 9 "
            "collectives of one call, as a compressed call with wire= begins)") in str(errors[0])


@pytest.mark.parametrize("name", ["allreduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("background", [False, True])
def test_a_bad_timeout_is_refused_in_the_calls_name(name, background):
    """``timeout=nan`` on rank 0 of a compressed call: ValueError naming the user's call there
    (not the internal all-to-all), CollectiveMismatchError naming the call and rank 0 on the
    peer, at once; the next call works."""
    def body(b):
        x = np.arange(8, dtype=np.float32)
        timeout = float("nan") if b.rank == 0 else 10
        if background:
            error, took = outcome(lambda: CALLS[name](x, b, wire="bf16", timeout=timeout).wait(30))
        else:
            error, took = outcome(lambda: getattr(fc, name)(x, b, wire="bf16", timeout=timeout))
        return error, took, fc.allreduce(np.ones(2), b, timeout=10).tolist()

    (e0, _, next0), (e1, took1, next1) = run_ranks(body, 2, timeout=60)
    assert type(e0) is ValueError and str(e0).startswith(f"{name}: timeout nan is invalid"), e0
    assert isinstance(e1, fc.CollectiveMismatchError), e1
    assert str(e1).startswith(f"{name}[bf16] (seq "), e1
    assert "rank 0 refused the call (ValueError: timeout nan" in str(e1), e1
    assert took1 < 5 and next0 == next1 == [2.0, 2.0]


KILLED = """
import os, signal
import ferro_collective as fc
from ferro_backend.hierarchy import attach_hierarchy
attach_hierarchy(b, ["a", "a", "b", "b"])
fc.barrier(b)
if b.rank == 3:
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
t = time.monotonic()
try:
    fc.allreduce(np.ones(300_000, np.float32), b, wire="bf16", timeout=20)
    result = ["returned"]
except Exception as exc:
    result = [type(exc).__name__, str(exc), getattr(exc, "peer", None), time.monotonic() - t]
"""


def test_a_rank_killed_in_a_multi_node_call_is_a_peer_failure_on_every_survivor():
    """Nodes a a b b over TCP, rank 3 SIGKILLed in a compressed allreduce: rank 2's node stage
    fails, and the rank of node a that meets it in the cross-node collective (rank 0) raises
    PeerClosedError naming rank 2 (the job's rank, not the cross-node group's 1) and the dead
    rank 3, as the exact hierarchical call does (it raised a disagreement on the call)."""
    from ferro_backend.engine import AVAILABLE
    from ferro_backend.testing import Job

    if not AVAILABLE:
        pytest.skip("the node stages need the engine (Linux)")
    with Job(KILLED, 4, timeout=20) as job:
        results = job.finish(60)
    got = {r.rank: r.result for r in results if r.rank != 3}
    for rank, (name, *_rest) in got.items():
        assert name in ("PeerClosedError", "PeerAbortedError"), (rank, got[rank])
        assert _rest[-1] < 10, (rank, got[rank])
    name, text, peer, _ = got[0]
    assert text.startswith("allreduce[bf16]: rank 2 met a failure"), text
    assert "peer rank 3" in text and peer == 3, text


def test_a_multi_node_disagreement_names_the_jobs_ranks():
    """Nodes a a b b, node b's ranks in fp16, node a's in bf16: the cross-node collective's
    check names the job's ranks (0 and 2 on rank 0), not the cross-node group's (0 and 1)."""
    from ferro_backend.hierarchy import attach_hierarchy

    def body(b):
        attach_hierarchy(b, ("a", "a", "b", "b"))
        return outcome(lambda: fc.allreduce(np.ones(1000, np.float32), b, timeout=10,
                                            wire="bf16" if b.rank < 2 else "fp16"))[0]

    errors = run_ranks(body, 4, timeout=60)
    assert all(isinstance(e, fc.CollectiveMismatchError) for e in errors), errors
    assert "ranks [0] called allreduce[bf16](float32[1000], SUM); ranks [2] called " \
           "allreduce[fp16](float32[1000], SUM)" in str(errors[0]), errors[0]
    assert "ranks [1] called allreduce[bf16](float32[1000], SUM); ranks [3] called " \
           "allreduce[fp16](float32[1000], SUM)" in str(errors[1]), errors[1]


@pytest.mark.parametrize("wire", ["int4", "bf16"])
def test_a_failed_call_leaves_the_error_feedback_as_it_was(wire):
    """A fed-back compressed allreduce that fails (rank 1 refuses it: an int dtype; rank 0
    meets the refusal) leaves both residuals as they were, so the next call goes on with the
    same bits as a series without the failed call (its residuals were replaced before)."""
    from ferro_collective.wire import Feedback

    def series(b, fail):
        g = np.linspace(-1, 1, 1000).astype(np.float32) * (b.rank + 1)
        fb = Feedback()
        fc.allreduce(g, b, wire=wire, feedback=fb, timeout=10)
        before = fb.sent.copy(), fb.folded.copy()
        if fail:
            bad = g if b.rank == 0 else g.astype(np.int32)
            with pytest.raises((fc.CollectiveMismatchError, TypeError)):
                fc.allreduce(bad * 3, b, wire=wire, feedback=fb, timeout=10)
            assert np.array_equal(fb.sent, before[0]) and np.array_equal(fb.folded, before[1])
        after = fc.allreduce(g, b, wire=wire, feedback=fb, timeout=10)
        return after, fb.sent, fb.folded

    failed = run_ranks(lambda b: series(b, True), 2, timeout=60)
    plain = run_ranks(lambda b: series(b, False), 2, timeout=60)
    for got, want in zip(failed, plain):
        for a, w in zip(got, want):
            assert a.tobytes() == w.tobytes()


@pytest.mark.parametrize("wire", ["int8", "bf16"])
def test_the_residuals_take_no_new_memory_per_call(wire):
    """Each residual lives in one of two buffers that the calls swap (kept aside until the call
    succeeded, without an array of the input's size made per call), and the series gives the
    bits of a Feedback started afresh from the same residuals."""
    from ferro_collective.wire import Feedback

    def body(b):
        g = np.linspace(-1, 1, 4096).astype(np.float32) * (b.rank + 1)
        fb = Feedback()
        fc.allreduce(g, b, wire=wire, feedback=fb, timeout=10)
        fc.allreduce(g, b, wire=wire, feedback=fb, timeout=10)
        buffers = {id(fb.sent), id(fb.spare("sent", g.size))}
        outs = []
        for _ in range(4):
            copy = Feedback(fb.sent, fb.folded)
            outs.append((fc.allreduce(g, b, wire=wire, feedback=fb, timeout=10),
                         fc.allreduce(g, b, wire=wire, feedback=copy, timeout=10)))
            assert {id(fb.sent), id(fb.spare("sent", g.size))} == buffers
            assert fb.sent is not fb.spare("sent", g.size)
        return all(a.tobytes() == c.tobytes() for a, c in outs)

    assert run_ranks(body, 2, timeout=60) == [True, True]


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("wire", ["bf16", "int8"])
@pytest.mark.parametrize("background", [False, True])
def test_a_timeout_and_a_peer_gone_are_named_by_the_users_call(name, wire, background):
    """A compressed call that times out, or whose peer closed its backend, raises in the user's
    call's name and wire (``allreduce[bf16] (seq 0) on rank 0: timed out ...``; before: the
    internal ``all_to_all_single (seq 0) ...``, and a peer gone read ``recv: rank 0 <-> 2``
    with no call at all)."""
    x = np.arange(12, dtype=np.float32)

    def call(b, timeout):
        if background:
            return outcome(lambda: CALLS[name](x, b, wire=wire, timeout=timeout).wait(60))[0]
        return outcome(lambda: getattr(fc, name)(x, b, wire=wire, timeout=timeout))[0]

    answered = threading.Event()

    def late(b):  # rank 1 never calls: rank 0's deadline passes
        if b.rank == 0:
            error = call(b, 0.5)
            answered.set()
            return error
        assert answered.wait(60)  # (open until rank 0 has its error: not a peer gone)

    timed_out = run_ranks(late, 2, timeout=60)[0]
    assert isinstance(timed_out, fc.CollectiveTimeoutError), timed_out
    assert str(timed_out).startswith(f"{name}[{wire}] (seq "), timed_out
    assert " on rank 0: timed out after 0.5s" in str(timed_out), timed_out

    closed = threading.Event()

    def gone(b):  # rank 2 has closed its backend: ranks 0 and 1 meet it in the call
        if b.rank == 2:
            b.close()
            closed.set()
            return None
        assert closed.wait(60)  # (a peer that fails first would leave the other to wait for
        return call(b, 30)      # its deadline, for that peer's part it never sent)

    for rank, error in enumerate(run_ranks(gone, 3, timeout=60)[:2]):
        assert isinstance(error, fc.PeerClosedError), error
        assert str(error).startswith(f"{name}[{wire}] (seq "), error
        assert f"on rank {rank}: " in str(error) and "peer rank 2 is gone" in str(error), error
        assert "all_to_all_single" not in str(error), error


@pytest.mark.parametrize("transport, name, wire", [
    ("shm", "allreduce", "bf16"), ("shm", "reduce_scatter", "int8"),
    ("tcp", "all_gather", "int4")])
def test_a_peer_gone_is_named_by_the_users_call_on_real_processes(transport, name, wire,
                                                                  tmp_path):
    """On the engine (its words: ``allreduce[bf16]: rank 0 <-> 2: peer rank 2 is gone``) and
    over TCP, as on simulated ranks."""
    got = run_processes(wire_fns.peer_gone, 3, name, wire, str(tmp_path / "closed"),
                        transport=transport, timeout=90)
    for rank, text in enumerate(got[:2]):
        assert text.startswith(f"PeerClosedError: {name}[{wire}]"), text
        assert f"rank {rank} <-> 2: peer rank 2 is gone" in text, text


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_reason_a_rank_gives_up_with_names_the_users_call(name):
    """Rank 0's compressed call times out (rank 2 never calls): rank 0 ends the job, and rank
    1 reads the reason in the user's call's words (it read ``it gave up on a collective:
    all_to_all_single (seq 0) ...``)."""
    done = threading.Event()
    x = np.arange(12, dtype=np.float32)

    def body(b):
        if b.rank == 2:  # never calls; open until both others have their errors
            assert done.wait(60)
            return None
        error = outcome(lambda: getattr(fc, name)(x, b, wire="bf16",
                                                  timeout=1 if b.rank == 0 else 30))[0]
        if b.rank == 1:
            done.set()
        return error

    gave_up, told = run_ranks(body, 3, timeout=60)[:2]
    assert isinstance(gave_up, fc.CollectiveTimeoutError), gave_up
    assert str(gave_up).startswith(f"{name}[bf16] (seq 0) on rank 0: timed out"), gave_up
    assert isinstance(told, fc.PeerAbortedError), told
    assert f"it gave up on a collective: {name}[bf16] (seq 0) on rank 0" in str(told), told
    assert "all_to_all_single" not in str(told), told


@pytest.mark.parametrize("size", [12, 3 << 20], ids=["one piece", "in pieces"])
def test_a_peer_abort_met_anywhere_in_the_call_names_the_users_call(size):
    """Rank 1 has aborted. Rank 0's compressed allreduce meets it at its entry check, or (the
    abort arriving just after that check: here the check is made to miss it once) where the
    call numbers its collectives (a call in pieces numbers them all at once): either way the
    error names ``allreduce[bf16]`` (the second read ``all_to_all_single: rank 1 aborted``)."""
    aborted = threading.Event()

    def body(b):
        if b.rank == 1:
            b.abort("gone for good")
            aborted.set()
            return None
        assert aborted.wait(60)
        deadline = time.monotonic() + 30
        while b.peer_failure("allreduce", 1) is None and time.monotonic() < deadline:
            time.sleep(0.01)  # (the notice has arrived)
        x = np.ones(size, np.float32)
        errors = [outcome(lambda: fc.allreduce(x, b, wire="bf16", timeout=30))[0]]
        real, missed = b.peer_failure, []

        def late_notice(op, peer):
            if not missed:
                missed.append(op)
                return None
            return real(op, peer)

        b.peer_failure = late_notice
        try:
            errors.append(outcome(lambda: fc.allreduce(x, b, wire="bf16", timeout=30))[0])
        finally:
            del b.peer_failure
        return errors

    for error in run_ranks(body, 2, timeout=60)[0]:
        assert isinstance(error, fc.PeerAbortedError), error
        assert str(error).startswith("allreduce[bf16]"), error
        assert "gone for good" in str(error), error
