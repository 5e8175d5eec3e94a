"""What torch builds on a group's CPU backend works on "ferro" (3 ranks under ferrorun, on the
compiled backend and on the Python one):
``_device_types``/``_get_backend``, all_gather_coalesced, all_reduce_coalesced, the coalescing
manager, batch_isend_irecv, get_future, object collectives, subgroups, sparse allreduce,
monitored_barrier in gloo's words, timeouts in torch's words, point-to-point messages (on the
compiled backend through the door alone)."""

from pathlib import Path

import pytest
from _launch import ferrorun
from ferro_torch._compiled import BACKEND

SCRIPT = str(Path(__file__).with_name("workers_torch_api.py"))
N = 3


@pytest.fixture(scope="module", params=["compiled", "python"])
def ranks(request) -> dict[int, dict]:
    run = ferrorun("torch_api", N, timeout=90, script=SCRIPT,
                   env={BACKEND.name: request.param, "TEST_KIND": request.param})
    assert run.returncodes == [0], run.output[-6000:]
    by_rank = run.by_rank()
    assert sorted(by_rank) == list(range(N)), run.output[-3000:]
    return by_rank


def test_monitored_barrier_names_the_missing_ranks_within_the_timeout(ranks):
    msg, secs = ranks[0]["monitored"]["all"]
    assert msg.startswith("[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 500 ms")
    assert 0.9 < secs < 3.5  # each missing rank is given the whole 0.5 s, as gloo gives it
    msg, secs = ranks[0]["monitored"]["one"]
    assert "Rank 2 failed to pass monitoredBarrier in 500 ms" in msg and secs < 2.5
    assert "CollectiveTimeoutError" in msg  # ferro's own detail follows torch's words
    msg, secs = ranks[1]["monitored"]["one"]
    assert msg.startswith("Rank 1 successfully reached monitoredBarrier") and secs < 4.5
    assert "Rank 0 timed out in monitoredBarrier after 0 ms" in ranks[0]["monitored"]["zero"][0]


def test_synchronous_calls_run_in_the_callers_thread(ranks):
    for r in range(N):
        if ranks[r]["kind"] == "compiled":  # (its own checks ran in the rank)
            assert ranks[r]["sync"]["inline_async"] == (N >= ranks[r]["sync"]["cores"])
            continue  # the group's worker thread is made by its first async call only
        sync = ranks[r]["sync"]
        assert sync["workers_before_async"] == [], sync
        # FERRO_BACKGROUND=auto: async calls in the issuing thread when the ranks fill the cores
        assert sync["inline_async"] == (N >= sync["cores"]), sync


def test_async_calls_on_two_groups_issued_in_other_orders_complete_as_on_gloo(ranks):
    total = float(sum(range(1, N + 1)))
    for r in range(N):
        got = ranks[r]["across"]
        assert got["world"] == [total, total], got
        assert got["pair"] == ([3.0, 3.0] if r < 2 else None), got
        assert got["seconds"] < 15, got  # (a deadlock met the group's 20 s deadline)


@pytest.mark.parametrize("kind", ["compiled", "python"])
def test_a_late_peer_never_completes_a_call_another_rank_gave_up_on(kind):
    run = ferrorun("late_peer", 2, timeout=90, script=SCRIPT,
                   args=("--transport", "shm"), env={BACKEND.name: kind})
    assert run.returncodes == [0], run.output[-4000:]
    got = run.by_rank()
    assert got[0]["kind"] == kind and "Timed out" in got[0]["got"], got
    assert got[1]["told"] is True, got  # rank 1 called once rank 0's abort had reached it
    assert isinstance(got[1]["got"], str) and "rank 0 aborted the job" in got[1]["got"], got


def test_a_timeout_is_worded_as_torch_words_it_with_ferros_detail_after(ranks):
    t = ranks[0]["timeout"]
    assert ": Timed out waiting 1000ms " in t["message"], t
    # ferro's detail: the Python backend's exception, the door's status and message
    assert "CollectiveTimeoutError" in t["message"] or "FERRO_TIMEOUT" in t["message"], t
    assert "rank 0" in t["message"], t
    assert 0.9 < t["seconds"] < 5, t


def test_receive_from_any_source_names_each_sender(ranks):
    got = ranks[0]["any_source"]
    per_sender = {}
    for src, values in got:
        assert values == [values[0]] * 3 and int(values[0]) // 10 == src, got
        per_sender.setdefault(src, []).append(int(values[0]) % 10)
    assert per_sender == {r: [0, 1] for r in range(1, N)}, got


def test_point_to_point_messages_keep_order_per_tag_and_never_wait_on_another_tag(ranks):
    # (the ordering, independence and exchange checks ran in ranks 0 and 1)
    p2p = ranks[0]["p2p"]
    assert "8" in p2p["size"] and "12" in p2p["size"], p2p
    msg, secs = p2p["timeout"]
    assert ": Timed out waiting 1000ms " in msg and 0.9 < secs < 5, p2p


def test_small_receives_complete_by_poll_future_or_wait_in_the_order_sent(ranks):
    # (the checks ran in rank 0; rank 1 sent)
    for r in (0, 1):
        made = ranks[r]["p2p"]["threads_made"]
        if ranks[r]["kind"] == "compiled":  # the receives ran in the waiting thread
            assert made == 0, ranks[r]["p2p"]


def test_a_receive_pending_when_its_group_ends_raises_instead_of_hanging(ranks):
    for r in range(N):
        p2p = ranks[r]["p2p"]
        assert p2p["pending_at_end"], p2p
        # at once (its group's deadline is 60 s off), on both backends: the Python one ends
        # its subgroup's pending receives when the group ends (it waited for their deadline)
        assert p2p["end_seconds"] < 10, p2p


def test_what_gloo_checks_is_checked(ranks):
    """all_to_all blocks against their receivers' outputs on every rank (a block smaller than
    its output was broadcast into it), outputs of another shape refused, complex reduce and
    reduce_scatter summed (they raised TypeError), a receive from this rank refused at once
    (it waited for the group's deadline)."""
    for r in range(N):
        h = ranks[r]["habits"]
        assert "rank 0 sends 1 rows to rank 1, whose recv_splits[0] is 2" in h["a2a"], h
        assert h["a2a_then"] == [10.0 * s + r for s in range(N)]
        assert "[3, 2]" in h["all_gather_shape"] and "[2, 3]" in h["all_gather_shape"]
        total = sum(k + 1 for k in range(N))
        assert h["complex_reduce_scatter"] == [[1.0 * total, 2.0 * total], [3.0 * total, -total]]
        assert h["recv_self"][1] < 20  # (not the group's 60 s deadline; room for stalls)
    assert ranks[0]["habits"]["complex_reduce"] == [[6.0, 12.0], [18.0, -6.0]]
    said = ranks[1]["habits"]["wait_timeout"]  # (the compiled backend's: c10d's bare words before)
    assert "Timed out waiting 300ms" in said
    assert "Work.wait's timeout" in said and "the work goes on" in said, said  # (both now)
    assert ranks[1]["habits"]["wait_then"] == [7.0, 7.0]
