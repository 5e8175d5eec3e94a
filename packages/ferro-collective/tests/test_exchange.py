"""all_gather_v, all_to_all, all_to_all_single (and async): hypothesis against numpy references
over simulated ranks (world 1..8, uneven dim 0 incl. zero rows on some ranks, 0-d, dtypes),
split checks, mismatches, invalid arguments and timeouts."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_rooted import collect

from ferro_backend import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    SimulatedBackend,
    SizeMismatchError,
)
from ferro_backend.testing import run_ranks
from ferro_collective import (
    Work,
    all_gather_v,
    all_gather_v_async,
    all_to_all,
    all_to_all_async,
    all_to_all_single,
    all_to_all_single_async,
    gather,
)
from ferro_collective.ops import BFLOAT16

SETTINGS = settings(max_examples=40, deadline=None)
DTYPES = [np.float16, np.float32, np.float64, np.int8, np.uint16, np.int64, np.bool_] + (
    [BFLOAT16] if BFLOAT16 is not None else [])
tails = hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3)


def arr(rng, dtype, shape):
    return rng.integers(-100, 100, size=shape).astype(dtype)


@SETTINGS
@given(n=st.integers(1, 8), tail=tails, dtype=st.sampled_from(DTYPES), zero_d=st.booleans(),
       data=st.data())
def test_all_gather_v_property(n, tail, dtype, zero_d, data):
    rows = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    rng = np.random.default_rng(sum(rows))
    xs = [arr(rng, dtype, () if zero_d else (k, *tail)) for k in rows]
    keep = [x.copy() for x in xs]
    results = run_ranks(lambda b: all_gather_v(xs[b.rank], b), n, timeout=30)
    for res in results:
        assert len(res) == n
        for got, x in zip(res, xs):
            assert got.dtype == x.dtype and got.shape == x.shape
            np.testing.assert_array_equal(got, x)
    assert all(x.tobytes() == k.tobytes() for x, k in zip(xs, keep))


@SETTINGS
@given(n=st.integers(1, 8), tail=tails, dtype=st.sampled_from(DTYPES), zero_d=st.booleans(),
       data=st.data())
def test_all_to_all_property(n, tail, dtype, zero_d, data):
    rows = data.draw(st.lists(st.lists(st.integers(0, 3), min_size=n, max_size=n), min_size=n,
                              max_size=n))  # rows[src][dst]
    rng = np.random.default_rng(n)
    sends = [[arr(rng, dtype, () if zero_d else (rows[s][d], *tail)) for d in range(n)]
             for s in range(n)]
    results = run_ranks(lambda b: all_to_all(sends[b.rank], b), n, timeout=30)
    for d, res in enumerate(results):
        assert len(res) == n
        for s in range(n):
            assert res[s].dtype == np.dtype(dtype) and res[s].shape == sends[s][d].shape
            np.testing.assert_array_equal(res[s], sends[s][d])


@SETTINGS
@given(n=st.integers(1, 8), tail=tails, dtype=st.sampled_from(DTYPES), equal=st.booleans(),
       give_recv=st.booleans(), data=st.data())
def test_all_to_all_single_property(n, tail, dtype, equal, give_recv, data):
    if equal:
        k = data.draw(st.integers(0, 3))
        splits = [[k] * n for _ in range(n)]
    else:
        splits = data.draw(st.lists(st.lists(st.integers(0, 3), min_size=n, max_size=n),
                                    min_size=n, max_size=n))  # splits[src][dst]
    rng = np.random.default_rng(n)
    xs = [arr(rng, dtype, (sum(splits[s]), *tail)) for s in range(n)]

    def fn(b):
        r = b.rank
        send = None if equal else splits[r]
        recv = [splits[s][r] for s in range(n)] if give_recv or not equal else None
        return all_to_all_single(xs[r], b, send_splits=send, recv_splits=recv)

    results = run_ranks(fn, n, timeout=30)
    for d, res in enumerate(results):
        pieces = []
        for s in range(n):
            start = sum(splits[s][:d])
            pieces.append(xs[s][start:start + splits[s][d]])
        expected = np.concatenate(pieces)
        assert res.dtype == np.dtype(dtype) and res.shape == expected.shape
        np.testing.assert_array_equal(res, expected)


def test_async_forms_out_and_inputs_kept():
    def fn(b):
        r = b.rank
        w1 = all_gather_v_async(np.full(r, r), b)
        w2 = all_to_all_async([np.full(2, 10 * r + d) for d in range(3)], b)
        out = np.empty(3, np.int64)
        w3 = all_to_all_single_async(np.arange(3) + 10 * r, b, out=out)
        x = np.arange(3) + 100 * r
        same = all_to_all_single(x, b, out=x)  # out may be the input: the result lands there
        assert all(isinstance(w, Work) for w in (w1, w2, w3))
        return ([a.tolist() for a in w1.wait(30)], [a.tolist() for a in w2.wait(30)],
                w3.wait(30) is out, out.tolist(), same is x, x.tolist())

    res = run_ranks(fn, 3, timeout=30)
    for r, (agv, a2a, is_out, out, is_x, x) in enumerate(res):
        assert agv == [[], [1], [2, 2]]
        assert a2a == [[10 * s + r] * 2 for s in range(3)]
        assert is_out and out == [r, 10 + r, 20 + r]
        assert is_x and x == [r, 100 + r, 200 + r]


def _list_outs(b):
    """The list collectives' ``out=`` (a list of one array a rank), sync and async, and a
    wrong one, which raises on its rank alone after the call: the next call is in step."""
    r, n = b.rank, b.world_size
    agv = [np.empty(s, np.int64) for s in range(n)]
    got = all_gather_v(np.full(r, r), b, out=agv, timeout=20)
    a2a = [np.empty(2, np.int64) for _ in range(n)]
    work = all_to_all_async([np.full(2, 10 * r + d) for d in range(n)], b, out=a2a, timeout=20)
    late = all_gather_v_async(np.full(r, r), b, out=agv[::-1] if r == 1 else agv, timeout=20)
    agv2 = [np.empty(s, np.int64) for s in range(n)]
    a2a2 = [np.empty(2, np.int64) for _ in range(n)]
    res = (all(g is o for g, o in zip(got, agv)), [a.tolist() for a in agv],
           all(g is o for g, o in zip(work.wait(20), a2a)), [a.tolist() for a in a2a])
    try:
        late.wait(20)
        wrong = None
    except SizeMismatchError as exc:
        wrong = str(exc)
    all_gather_v_async(np.full(r, r), b, out=agv2).wait(20)
    all_to_all([np.full(2, 10 * r + d) for d in range(n)], b, out=a2a2, timeout=20)
    return res + (wrong, [a.tolist() for a in agv2], [a.tolist() for a in a2a2])


def test_list_collectives_fill_a_list_out():
    for r, (same, agv, same2, a2a, wrong, agv2, a2a2) in enumerate(run_ranks(_list_outs, 3,
                                                                              timeout=60)):
        assert same and same2
        assert agv == agv2 == [[], [1], [2, 2]]
        assert a2a == a2a2 == [[10 * s + r] * 2 for s in range(3)]
        assert (wrong is None) == (r != 1)
        if r == 1:
            assert "all_gather_v: out[0]: out is int64[2], the result is int64[0]" in wrong
    (b,) = SimulatedBackend.create_group(1)
    with pytest.raises(TypeError, match="out must be a list of 1 numpy arrays, got ndarray"):
        all_gather_v(np.ones(2), b, out=np.empty(2))
    with pytest.raises(ValueError, match="out has 2 arrays, the result 1"):
        all_to_all([np.ones(2)], b, out=[np.empty(2), np.empty(2)])


def test_all_gather_v_mismatched_dtype_or_trailing_shape_on_every_rank():
    def fn(b):
        x = np.zeros((b.rank + 1, 3), np.float32) if b.rank != 2 else np.zeros((1, 4), np.float32)
        return all_gather_v(x, b, timeout=10)

    errors = collect(fn, 3)
    assert set(errors) == {0, 1, 2}
    for e in errors.values():
        assert isinstance(e, CollectiveMismatchError)
        assert "ranks [0, 1] called all_gather_v(float32[*, 3])" in str(e)
        assert "ranks [2] called all_gather_v(float32[*, 4])" in str(e)

    def dtypes(b):
        return all_gather_v(np.zeros(2, np.int32 if b.rank else np.int64), b, timeout=10)

    errors = collect(dtypes, 2)
    assert all(isinstance(e, CollectiveMismatchError) for e in errors.values()) and len(errors) == 2
    assert "all_gather_v(int64[*])" in str(errors[1]) and "all_gather_v(int32[*])" in str(errors[1])


def test_all_to_all_invalid_lists_fail_their_rank_and_every_peer():
    def wrong_length(b):
        return all_to_all([np.ones(1)] * (2 if b.rank == 1 else 3), b, timeout=10)

    errors = collect(wrong_length, 3)
    assert isinstance(errors[1], ValueError)
    assert "got 2 tensors, expected world_size 3" in str(errors[1])
    for r in (0, 2):
        assert isinstance(errors[r], CollectiveMismatchError)
        assert ("all_to_all (seq 0): rank 1 refused the call (ValueError: got 2 tensors, "
                "expected world_size 3)") in str(errors[r])

    def mixed(b):
        return all_to_all([np.ones(1), np.ones((1, 2))], b, timeout=10)

    errors = collect(mixed, 2)
    assert all("tensors[1] is float64[1, 2], tensors[0] is float64[1]" in str(e)
               for e in errors.values())

    with pytest.raises(TypeError, match="list of world_size .* use all_to_all_single"):
        all_to_all(np.ones((1, 3)), SimulatedBackend.create_group(1)[0])


def test_all_to_all_single_split_errors_are_the_same_on_every_rank():
    def disagree(b):  # rank 0 sends 2 rows to rank 1, which expects 1 from it
        send = [1, 2] if b.rank == 0 else [1, 1]
        recv = [1, 1]
        return all_to_all_single(np.zeros(sum(send)), b, send_splits=send, recv_splits=recv,
                                 timeout=10)

    errors = collect(disagree, 2)
    assert len(errors) == 2 and str(errors[0]) == str(errors[1])
    assert isinstance(errors[0], SizeMismatchError)
    assert "rank 0 sends 2 rows to rank 1, whose recv_splits[0] is 1" in str(errors[0])

    def unequal(b):
        return all_to_all_single(np.zeros(3), b, send_splits=[1, 2] if b.rank == 0 else [2, 1],
                                 timeout=10)

    errors = collect(unequal, 2)
    assert len(errors) == 2 and "recv_splits=None (equal splits)" in str(errors[0])

    def bad_sum(b):
        return all_to_all_single(np.zeros(4), b, send_splits=[1, 1] if b.rank else [2, 2],
                                 timeout=10)

    errors = collect(bad_sum, 2)
    assert "send_splits [1, 1] add up to 2, dim 0 of the tensor is 4" in str(errors[1])
    assert isinstance(errors[0], CollectiveMismatchError)

    g = SimulatedBackend.create_group(1)
    with pytest.raises(SizeMismatchError, match="0-d tensor"):
        all_to_all_single(np.float32(1), g[0])
    with pytest.raises(ValueError, match="send_splits must be 1 integers"):
        all_to_all_single(np.zeros(2), g[0], send_splits=[1, 1])
    with pytest.raises(ValueError, match="negative"):
        all_to_all_single(np.zeros(2), g[0], send_splits=[2], recv_splits=[-1])


def test_exchange_called_against_gather_is_a_mismatch():
    def fn(b):
        if b.rank == 0:
            return gather(np.zeros(2), b, timeout=10)
        return all_to_all([np.zeros(1)] * 2, b, timeout=10)

    errors = collect(fn, 2)
    for e in errors.values():
        assert isinstance(e, CollectiveMismatchError)
        assert "gather(float64[2], root=0)" in str(e) and "all_to_all(float64[*])" in str(e)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("call", [
    lambda b: all_gather_v(np.ones(3), b, timeout=0.4),
    lambda b: all_to_all([np.ones(1)] * 2, b, timeout=0.4),
    lambda b: all_to_all_single(np.ones(2), b, timeout=0.4),
    lambda b: all_to_all_async([np.ones(1)] * 2, b, timeout=0.4).wait(10),
], ids=["all_gather_v", "all_to_all", "all_to_all_single", "all_to_all_async"])
def test_silent_peer_times_out(call):
    rank0, _silent = SimulatedBackend.create_group(2)
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="timed out after 0.4s"):
        call(rank0)
    assert time.monotonic() - t0 < 5  # gave up at its deadline (a loaded host's room)


@pytest.mark.parametrize("name", ["all_gather_v", "all_to_all", "all_to_all_single", "scatter",
                                  "all_gather_object"])
def test_a_peer_gone_is_named_by_the_call(name):
    """The collectives with a metadata round name themselves in a peer's failure, as the others
    do (``all_to_all_single (seq 0) on rank 1: recv: ...``; before: ``recv: rank 1 <-> 2: peer
    rank 2 is gone`` with no call)."""
    import threading

    import ferro_collective as fc

    closed = threading.Event()
    x = np.arange(6, dtype=np.float32)
    calls = {"all_gather_v": lambda b: fc.all_gather_v(x, b, timeout=30),
             "all_to_all": lambda b: fc.all_to_all([x[:2], x[2:4], x[4:]], b, timeout=30),
             "all_to_all_single": lambda b: fc.all_to_all_single(x, b, timeout=30),
             "scatter": lambda b: fc.scatter(x.reshape(3, 2) if b.rank == 0 else None, b,
                                             timeout=30),
             "all_gather_object": lambda b: fc.all_gather_object({"r": b.rank}, b, timeout=30)}

    def body(b):
        if b.rank == 2:
            b.close()
            closed.set()
            return None
        assert closed.wait(60)
        try:
            calls[name](b)
        except fc.PeerClosedError as exc:
            return exc
        return "returned"

    for rank, error in enumerate(run_ranks(body, 3, timeout=60)[:2]):
        assert isinstance(error, fc.PeerClosedError), error
        assert str(error).startswith(f"{name} (seq 0) on rank {rank}: "), error
        assert "peer rank 2 is gone" in str(error), error
