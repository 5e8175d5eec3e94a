"""A large bf16/fp16 allreduce runs in pieces at once (ferro_collective.compressed): the same
bits as the reference in one piece, on every rank, now and in the background, into ``out=`` or
a new array; a blocking call made on an async worker runs its pieces in line (no wait on
itself); the timeline keeps one event for the call."""

from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
import wire_fns
from hypothesis import given, settings
from hypothesis import strategies as st
from test_wire import expected_allreduce, inputs, traced_on_rank_0

import ferro_collective as fc
from ferro_backend import settings as fsettings
from ferro_backend.testing import run_processes, run_ranks
from ferro_collective import ReduceOp, compressed
from ferro_collective.per_backend import state

pytest.importorskip("ml_dtypes")
pytestmark = pytest.mark.timeout(120)


@contextmanager
def small_pieces(piece_bytes=16):
    """Pieces of ``piece_bytes`` encoded bytes; yields the list of piece sizes each
    ``_allreduce`` call was given (pieces only: a call in one piece has no ``on_error``)."""
    sizes: list[int] = []
    real = compressed._allreduce

    def spy(x, *args, on_error=None, **kw):
        if on_error is not None:
            sizes.append(x.size)
        return real(x, *args, on_error=on_error, **kw)

    with mock.patch.object(compressed, "PIECE_BYTES", piece_bytes), \
            mock.patch.object(compressed, "_allreduce", spy):
        yield sizes


def test_the_pieces_cover_the_values_in_at_most_max_pieces():
    assert compressed._pieces(10**6, "int8") == [(0, 10**6)]  # blocks would move
    assert compressed._pieces(compressed.PIECE_BYTES - 1, "bf16") == [
        (0, compressed.PIECE_BYTES - 1)]  # under twice PIECE_BYTES encoded
    for count in (compressed.PIECE_BYTES, 3_000_001, 10**8):
        pieces = compressed._pieces(count, "fp16")
        assert 2 <= len(pieces) <= compressed.MAX_PIECES
        assert pieces[0][0] == 0 and pieces[-1][1] == count
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert all(2 * (hi - lo) >= compressed.PIECE_BYTES - 8 for lo, hi in pieces)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 4), size=st.integers(100, 3000), wire=st.sampled_from(["bf16", "fp16"]),
       op=st.sampled_from([ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX]),
       dtype=st.sampled_from([np.float32, np.float64, np.float16]),
       background=st.booleans())
def test_pieces_give_the_reference_on_every_rank(n, size, wire, op, dtype, background):
    xs = inputs(n, size, dtype, seed=size)

    def body(b):
        x = xs[b.rank].reshape(size, 1)
        if background:
            return fc.allreduce_async(x, b, op, wire=wire).wait(30)
        return fc.allreduce(x, b, op, wire=wire)

    with small_pieces() as sizes:
        got = run_ranks(body, n)
    assert len(sizes) == n * compressed.MAX_PIECES and sum(sizes) == n * size
    want = expected_allreduce(xs, wire, op).astype(dtype).reshape(size, 1)
    for g in got:
        assert g.dtype == dtype and g.shape == (size, 1)
        np.testing.assert_array_equal(g, want)


def test_in_place_and_into_out_and_a_bad_out_before_the_pieces():
    xs = inputs(3, 2000, np.float32, seed=7)
    want = expected_allreduce(xs, "bf16", ReduceOp.MEAN)

    def body(b):
        mine = xs[b.rank].copy()
        same = fc.allreduce(mine, b, ReduceOp.MEAN, wire="bf16", out=mine)  # DDP's bucket
        wide = np.empty(2000, np.float64)
        into = fc.allreduce_async(xs[b.rank].astype(np.float64), b, ReduceOp.MEAN, wire="bf16",
                                  out=wide).wait(30)
        strided = np.empty(4000, np.float32)[::2]
        fc.allreduce(xs[b.rank], b, ReduceOp.MEAN, wire="bf16", out=strided)
        with pytest.raises(fc.SizeMismatchError, match=r"float32\[1999\], the result is float32\[2000\]"):
            fc.allreduce(xs[b.rank], b, wire="bf16", out=np.empty(1999, np.float32))
        after = fc.allreduce(np.ones(3), b, timeout=10)  # (refused on every rank: the calls meet)
        return same is mine, mine, into is wide, wide, strided, after.tolist()

    with small_pieces() as sizes:
        got = run_ranks(body, 3)
    assert len(sizes) == 3 * 3 * compressed.MAX_PIECES  # (the bad out= is refused first)
    for is_mine, mine, is_wide, wide, strided, after in got:
        assert is_mine and is_wide and after == [3.0] * 3
        np.testing.assert_array_equal(mine, want)
        np.testing.assert_array_equal(wide, want.astype(np.float64))
        np.testing.assert_array_equal(strided, want)


def test_a_blocking_call_on_a_worker_runs_its_pieces_in_line():
    """With one async worker, a blocking pieced call made on it would wait for pieces queued
    behind itself; it runs them one after another there instead."""
    xs = inputs(2, 2000, np.float32, seed=3)

    def body(b):
        job = state(b).submit(lambda: fc.allreduce(xs[b.rank], b, wire="fp16", timeout=20))
        return job.result(timeout=60)

    with fsettings.override(ASYNC_WORKERS=1), small_pieces() as sizes:
        got = run_ranks(body, 2)
    assert len(sizes) == 2 * compressed.MAX_PIECES
    for g in got:
        np.testing.assert_array_equal(g, expected_allreduce(xs, "fp16", ReduceOp.SUM))


def test_the_timeline_has_one_event_for_a_call_in_pieces(tmp_path):
    with small_pieces():
        events = [args for name, args in traced_on_rank_0(
            tmp_path, lambda b: fc.allreduce(np.ones(1000, np.float32), b, wire="bf16"))
                  if name == "allreduce[bf16]"]
    assert len(events) == 1
    assert events[0]["bytes"] == 4000 and events[0]["wire_bytes"] == 2000
    assert events[0]["pieces"] == compressed.MAX_PIECES


def test_ranks_that_disagree_on_the_size_get_the_mismatch_error_at_once():
    """Rank 0 cuts its call in 4 pieces, rank 1's is one piece: both raise the mismatch of
    the first collective without waiting for rank 0's other pieces (which rank 1 never issues)
    to time out."""
    import time

    from test_rooted import collect

    def body(b):
        t0 = time.monotonic()
        try:
            fc.allreduce(np.ones(2000 if b.rank == 0 else 3, np.float32), b, wire="bf16",
                         timeout=30)
        finally:
            assert time.monotonic() - t0 < 15

    with small_pieces():
        errors = collect(body, 2)
    assert len(errors) == 2, errors
    assert all(isinstance(e, fc.CollectiveMismatchError) for e in errors.values()), errors


@pytest.mark.parametrize("transport", ["threads", "shm", "tcp", "2 nodes x 2"])
def test_a_compressed_call_the_ranks_disagree_on_leaves_the_group_in_step(transport):
    """Every compressed call takes the same count of sequence numbers on every rank whatever
    its size, wire and kind; a disagreement fails its first collective on every rank, which
    then give back the rest. Before, sizes that cut a call in different numbers of pieces
    left the ranks' numbers apart for good: every later call met a mismatch or waited for
    its timeout. (Rank 0 refuses the dtype and the wire itself: its peers read why.) On two
    nodes every such call starts with a check of the whole call over every rank: a node stage
    that fails inside one node only left the other node's ranks to go on with the cross-node
    stage, out of step. Rank 0's compressed call against its peers' exact one (flat jobs):
    the exact call takes one number, the compressed call its block; the decider's header says
    how many and the exact ranks catch up (before, every later call waited for its timeout,
    or on the engine met a mismatch of sequence numbers, for good)."""
    if transport == "threads":
        seen = run_ranks(wire_fns.disagreements, 2, timeout=120)
    elif transport == "2 nodes x 2":
        from ferro_backend.engine import AVAILABLE

        if not AVAILABLE:
            pytest.skip("the node stages need the engine (Linux)")
        seen = run_processes(wire_fns.disagreements, 4, ("a", "a", "b", "b"), timeout=150)
    else:
        seen = run_processes(wire_fns.disagreements, 2, transport=transport, timeout=150)
    cases = ["sizes that cut differently", "the same in the background",
             "sizes whose first pieces agree", "a refused dtype", "a refused wire",
             "another compressed collective"]
    if transport != "2 nodes x 2":
        cases += ["an exact call against one piece", "an exact call against pieces",
                  "both in the background", "an exact call against a refused wire",
                  "an exact all_gather", "an exact all_to_all_single"]
    own = {"a refused dtype": "TypeError", "a refused wire": "ValueError",
           "an exact call against a refused wire": "ValueError"}
    for rank in range(len(seen)):
        raised = [own.get(case, "CollectiveMismatchError") if rank == 0 else
                  "CollectiveMismatchError" for case in cases]
        assert seen[rank] == [f"rank {rank}, {case}: {error}"
                              for case, error in zip(cases, raised)], seen[rank]


@settings(max_examples=60, deadline=None)
@given(spans=st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=6), data=st.data())
def test_a_header_says_how_many_numbers_its_call_takes_and_who_owes_how_many(spans, data):
    """Bytes 6-7 of a header, its span (0: one number), round trip; after a mismatch a rank
    owes the most any rank's call takes less what its own takes. A backend's own count skips
    what is owed only where no call took a number after the failed one."""
    from ferro_collective._doorplan import SeqCounter
    from ferro_collective.header import encode, owed, span_of

    headers = [encode("allreduce", np.dtype(np.float32), (3,), ReduceOp.SUM, seq=7, span=s)
               for s in spans]
    assert [span_of(h) for h in headers] == [s or 1 for s in spans]
    rank = data.draw(st.integers(0, len(spans) - 1))
    assert owed(headers, rank) == max(s or 1 for s in spans) - (spans[rank] or 1)
    count = SeqCounter()
    seq = count()
    assert count.catch_up(seq, 8) and count() == seq + 9
    failed, after = count(), count()
    assert not count.catch_up(failed, 8) and count() == after + 1


_KINDS = {
    "allreduce": (fc.allreduce, fc.allreduce_async),
    "reduce_scatter": (fc.reduce_scatter, fc.reduce_scatter_async),
    "all_gather": (fc.all_gather, fc.all_gather_async),
}
_CALL = st.fixed_dictionaries({
    "kind": st.sampled_from(sorted(_KINDS)), "size": st.integers(1, 1500).map(lambda n: 4 * n),
    "wire": st.sampled_from(["bf16", "fp16", "int8", None]), "background": st.booleans(),
    "op": st.sampled_from([ReduceOp.SUM, ReduceOp.MAX]),
    "dtype": st.sampled_from([np.float32, np.float64]), "rows": st.sampled_from([1, 2])})


def _compressed_call(b, call):
    shape = (call["size"],) if call["rows"] == 1 else (2, call["size"] // 2)
    x = np.ones(shape, call["dtype"])
    now, later = _KINDS[call["kind"]]
    args = () if call["kind"] == "all_gather" else (call["op"],)
    wire = {} if call["wire"] is None else {"wire": call["wire"]}  # None: the exact call
    if call["background"]:
        return later(x, b, *args, timeout=10, **wire).wait(10)
    return now(x, b, *args, timeout=10, **wire)


def _same_call(a, b) -> bool:
    keys = ["kind", "size", "wire", "dtype", "rows"] + (["op"] if a["kind"] != "all_gather"
                                                        else [])
    return all(a[k] == b[k] for k in keys)


@settings(max_examples=40, deadline=None)
@given(first=_CALL, second=_CALL, same=st.booleans())
def test_compressed_calls_the_ranks_disagree_on_raise_on_both_and_the_next_calls_work(
        first, second, same):
    """Each rank makes its own drawn compressed call (kind, size, shape, dtype, op, wire, in the
    background or not), or an exact one (which takes one sequence number where a compressed
    call takes its block: the exact rank catches up). Calls that differ in anything but being
    in the background raise CollectiveMismatchError on both ranks, at once (rows of the same
    width included: the call's identity travels with its first collective), others succeed;
    the calls after them give the right values on both ranks."""
    calls = [first, dict(first, background=second["background"]) if same else second]

    def body(b):
        try:
            _compressed_call(b, calls[b.rank])
            raised = None
        except fc.CollectiveMismatchError:
            raised = "CollectiveMismatchError"
        exact = fc.allreduce(np.full(3, b.rank + 1.0), b, timeout=10)
        pieces = fc.allreduce(np.full(2000, b.rank + 1.0, np.float32), b, wire="bf16",
                              timeout=10)
        return raised, exact.tolist(), bool(np.all(pieces == 3.0))

    raised = None if _same_call(*calls) else "CollectiveMismatchError"
    with small_pieces():
        assert run_ranks(body, 2, timeout=60) == [(raised, [3.0] * 3, True)] * 2
