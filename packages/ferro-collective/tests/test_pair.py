"""Calls of two ranks over point-to-point messages that send their header with their data
(:mod:`ferro_collective.pair`): one message each way, the bits of the algorithms they stand
for, and every disagreement raised on both ranks at once, the next call in step."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_ranks import run_mpi
from pair_fns import DISAGREEMENTS, counted, disagree, from_root, other_form

from ferro_backend import SimulatedBackend, SizeMismatchError
from ferro_backend.testing import run_processes, run_ranks
from ferro_collective import (
    ReduceOp,
    all_gather,
    all_to_all,
    allreduce,
    gather,
    reduce,
    reduce_scatter,
)
from ferro_collective.ops import BFLOAT16
from ferro_collective.pair import FUSE_MAX

pytestmark = pytest.mark.timeout(120)


def _check_disagreements(res: list[dict]) -> None:
    for name, _, _, names in DISAGREEMENTS:
        for r in range(2):
            (kind, msg), took, after = res[r][name]
            assert kind == "CollectiveMismatchError", (name, r, kind, msg)
            for part in names:
                assert part in msg, (name, r, msg)
            assert took < 4.0, (name, r, took)  # (their deadline: 8 s)
            assert after == [2.0] * 3, (name, r, after)


def test_disagreements_raise_on_both_ranks_threads():
    _check_disagreements(run_ranks(disagree, 2, timeout=90))


def test_disagreements_raise_on_both_ranks_tcp():
    _check_disagreements(run_processes(disagree, 2, timeout=100))


def test_disagreements_raise_on_both_ranks_mpi(tmp_path):
    _check_disagreements(run_mpi("pair_fns", "disagree", 2, tmp_path))


def test_a_root_without_data_meets_a_peer_of_another_form():
    """A gather's or reduce's root sends no data: its message is not the header exchange's,
    so a peer that runs the call in another form raises at once, as the root does."""
    for res in run_processes(other_form, 2, timeout=100):
        for name, ((kind, msg), took, after) in res.items():
            assert kind == "CollectiveMismatchError" and "another form" in msg, (name, msg)
            assert took < 4.0, (name, took)  # (their deadline: 8 s)
            assert after == [2.0] * 3, (name, after)


#: (nbytes, rank 1 passes None), and the messages each rank sends: a root sends its data with
#: its header (1, 1); a non-root that passed None cannot receive a message of a length it does
#: not know: it drops it and the root sends its header alone and its data again (3, 2); both
#: ranks remember it, so the next broadcast exchanges its header first (2, 1, as over FUSE_MAX),
#: until one where the non-root passed an array; a call over FUSE_MAX changes nothing
BIG = 2 * FUSE_MAX + 8
BROADCASTS = [((BIG, True), (2, 1)), ((4096, False), (1, 1)), ((4096, True), (3, 2)),
              ((BIG, True), (2, 1)), ((0, True), (2, 1)), ((4096, False), (2, 1)),
              ((0, False), (1, 1)), ((BIG, False), (2, 1))]


@pytest.mark.parametrize("ranks", ["threads", "tcp"])
def test_a_non_root_that_passes_none_gets_the_root_s_array(ranks):
    steps = [step for step, _ in BROADCASTS]
    res = run_ranks(lambda b: from_root(b, steps), 2, timeout=60) if ranks == "threads" else \
        run_processes(from_root, 2, steps, timeout=60)
    shapes = [(n // 4,) if n else (2, 3) for n, _ in steps]
    for r, out in enumerate(res):
        assert [o[:2] for o in out] == [(shape, True) for shape in shapes], (r, out)
        assert [o[2] for o in out] == [sends[r] for _, sends in BROADCASTS], (r, out)


def test_a_refused_call_with_a_metadata_round_raises_on_both_ranks():
    """A rank whose own arguments are wrong (an all_to_all list of the wrong length) raises
    its own error; its peer raises the mismatch naming it; the next call works."""
    def fn(b):
        tensors = [np.ones(2)] * (3 if b.rank == 1 else 2)
        try:
            all_to_all(tensors, b, timeout=8)
            got = "returned"
        except Exception as exc:  # (the test compares what each rank raised)
            got = f"{type(exc).__name__}: {exc}"
        return got, allreduce(np.full(3, b.rank + 1.0), b, timeout=8).tolist()

    (mine, after0), (theirs, after1) = run_ranks(fn, 2, timeout=60)
    assert mine.startswith("CollectiveMismatchError") and "rank 1 refused" in mine, mine
    assert not theirs.startswith("CollectiveMismatchError") and "2" in theirs, theirs
    assert after0 == after1 == [3.0] * 3


def test_one_message_each_way_up_to_fuse_max():
    small, large = 4096, 2 * FUSE_MAX + 8
    both = run_ranks(lambda b: counted(b, [small, large]), 2, timeout=60)
    for name in ("gather", "reduce", "broadcast"):  # (one rank sends its header alone)
        assert [res[f"{name} {small}"] for res in both] == [1, 1], (name, both)
        assert sum(res[f"{name} {large}"] for res in both) >= 3, (name, both)
    for res in both:
        for name in ("allreduce", "all_gather", "reduce_scatter"):
            assert res[f"{name} {small}"] == 1, (name, res)
            assert res[f"{name} {large}"] >= 2, (name, res)  # the header alone first
        assert res[f"ring {small}"] >= 2, res  # a forced algorithm keeps its own messages
        # header and metadata in one message, then the data
        assert res[f"all_to_all_single {small}"] == 2, res


DTYPES = [np.float32, np.float64, np.float16, BFLOAT16, np.int32, np.int64]


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(DTYPES), size=st.integers(1, 300),
       op=st.sampled_from([ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX,
                           ReduceOp.MEAN]),
       use_out=st.booleans(), seed=st.integers(0, 2**16))
def test_bits_equal_the_algorithms_they_stand_for(dtype, size, op, use_out, seed):
    """allreduce, reduce_scatter, all_gather, reduce and gather of two ranks give the bits
    of the algorithms they stand for (the star's rank-order folds, the tree's) on both ranks,
    with and without ``out=``."""
    dtype = np.dtype(dtype)
    if op is ReduceOp.MEAN and dtype.kind == "i":
        op = ReduceOp.SUM
    rng = np.random.default_rng(seed)
    xs = [rng.uniform(-4, 4, 2 * size).astype(dtype) for _ in range(2)]

    def fn(b):
        x = xs[b.rank]
        got = {}
        for name, call, shape in (
                ("allreduce", lambda **k: allreduce(x, b, op, **k), x.shape),
                ("reduce_scatter", lambda **k: reduce_scatter(x, b, op, **k), (size,)),
                ("all_gather", lambda **k: all_gather(x, b, **k), (4 * size,))):
            out = np.empty(shape, dtype) if use_out else None
            mine = call(out=out) if use_out else call()
            assert out is None or mine is out
            ref = call(algorithm="star") if name != "all_gather" else np.concatenate(xs)
            got[name] = (mine.tobytes(), np.asarray(ref).tobytes(), mine.dtype.str)
        for name, call, shape in (
                ("reduce", lambda **k: reduce(x, b, 1, op, **k), x.shape),
                ("gather", lambda **k: gather(x, b, 1, **k), (4 * size,))):
            out = np.empty(shape, dtype) if use_out and b.rank == 1 else None
            mine = call(out=out) if out is not None else call()
            ref = allreduce(x, b, op, algorithm="star") if name == "reduce" else \
                np.concatenate(xs)
            if b.rank == 1:
                assert out is None or mine is out
                got[name] = (mine.tobytes(), np.asarray(ref).tobytes(), mine.dtype.str)
            else:
                assert mine is None
        return got

    res = run_ranks(fn, 2, timeout=60)
    for name in ("allreduce", "reduce_scatter", "all_gather", "reduce", "gather"):
        for r in (1,) if name in ("reduce", "gather") else range(2):
            mine, ref, kind = res[r][name]
            assert kind == dtype.str and mine == ref, (name, r)
    assert res[0]["allreduce"][0] == res[1]["allreduce"][0]


def test_a_receive_that_failed_raises_in_the_wait():
    """A receive that failed before the call waited for it (a message of another length)
    raises there: the wait no longer takes a poll that saw it done for its success."""
    from ferro_collective.p2p import Ctx

    b0, b1 = SimulatedBackend.create_group(2, timeout=5)
    ctx = Ctx(b1, "allreduce", 0, 1 << 20, 5.0)
    req = ctx.irecv(np.empty(4, np.uint8), 0, (1 << 20) + 1)
    b0.send(np.zeros(8, np.uint8), 1, tag=(1 << 20) + 1)  # (fails the posted receive)
    with pytest.raises(SizeMismatchError, match="has 8 bytes"):
        ctx.wait(req, 0, "the data")
    for b in (b0, b1):
        b.close()
