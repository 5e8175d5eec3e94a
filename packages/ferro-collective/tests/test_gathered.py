"""Calls of three ranks or more over point-to-point messages whose small data rides the header
exchange's rounds (:mod:`ferro_collective.gathered`): ``ceil(log2 n)`` messages a rank, the
bits of the star (allreduce) and the ring (reduce_scatter), every disagreement raised on every
rank with the next call in step, and rounds that number the ranks node by node, so that their
cost does not depend on how a job names them."""

import dataclasses
import functools
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_ranks import run_mpi
from pair_fns import DISAGREEMENTS, TWO_ONLY, disagree, sends

from ferro_backend.testing import run_processes, run_ranks
from ferro_collective import (
    ReduceOp,
    all_gather,
    allreduce,
    broadcast,
    costmodel,
    reduce_scatter,
)
from ferro_collective import message_schedule as ms
from ferro_collective.gathered import GATHER_MAX, PAD
from ferro_collective.header import HEADER_SIZE
from ferro_collective.ops import BFLOAT16

pytestmark = pytest.mark.timeout(150)


def _check_disagreements(res: list[dict], n: int) -> None:
    assert len(res) == n
    for name, _, _, names in DISAGREEMENTS:
        if name in TWO_ONLY:
            continue
        for r in range(n):
            (kind, msg), took, after = res[r][name]
            assert kind == "CollectiveMismatchError", (name, r, kind, msg)
            for part in names:
                assert part in msg, (name, r, msg)
            assert took < 4.0, (name, r, took)  # (their deadline: 8 s)
            assert after == [float(n)] * 3, (name, r, after)


@pytest.mark.parametrize("n, odd", [(3, 1), (4, 2), (5, 4), (6, 3)])
def test_disagreements_raise_on_every_rank_threads(n, odd):
    _check_disagreements(run_ranks(lambda b: disagree(b, odd=odd), n, timeout=120), n)


def test_disagreements_raise_on_every_rank_tcp():
    _check_disagreements(run_processes(functools.partial(disagree, odd=2), 4, timeout=120), 4)


def test_disagreements_raise_on_every_rank_mpi(tmp_path):
    _check_disagreements(run_mpi("pair_fns", "disagree", 3, tmp_path, timeout=120), 3)


def _counted(b, sizes):
    calls = []
    for nbytes in sizes:
        x = np.ones(nbytes // 4 // b.world_size * b.world_size, np.float32)
        calls += [(f"allreduce {nbytes}", lambda x=x: allreduce(x, b)),
                  (f"all_gather {nbytes}", lambda x=x: all_gather(x, b)),
                  (f"reduce_scatter {nbytes}", lambda x=x: reduce_scatter(x, b)),
                  (f"ring {nbytes}", lambda x=x: allreduce(x, b, algorithm="ring")),
                  (f"broadcast {nbytes}", lambda x=x: broadcast(x, b, 0))]
    mid = np.ones(GATHER_MAX // 8, np.float32)  # (n x its bytes is over GATHER_MAX)
    calls.append(("broadcast mid", lambda: broadcast(mid, b, 0)))
    return {name: count for name, (_, count) in sends(b, calls).items()}


@pytest.mark.parametrize("n", [3, 4, 8])
def test_ceil_log2_n_messages_a_rank_for_small_calls(n):
    small, large = 512, 2 * GATHER_MAX  # (what "auto" gathers on one node's links at 8 ranks)
    rounds = (n - 1).bit_length()
    for res in run_ranks(lambda b: _counted(b, [small, large]), n, timeout=60):
        assert res[f"allreduce {small}"] == rounds, res
        assert res[f"all_gather {small}"] == rounds, res
        assert res[f"reduce_scatter {small}"] == rounds, res
        assert res[f"reduce_scatter {large}"] > rounds, res
        assert res[f"allreduce {large}"] > rounds, res  # the header alone first
        assert res[f"ring {small}"] > rounds, res  # a forced algorithm keeps its own messages
        assert res[f"broadcast {small}"] == rounds, res
        assert res["broadcast mid"] == rounds, res  # (it gathers the root's bytes alone)


@pytest.mark.parametrize("n", [3, 4, 6])
def test_a_gathered_broadcast_sends_the_root_s_data_once_to_each_rank(n):
    """Only the root's unit carries data: the ranks together send its bytes ``n - 1`` times,
    as the tree does (not every rank's array to every rank), with the headers, in
    ``ceil(log2 n)`` messages a rank; every rank returns the root's array."""
    nbytes = 4096

    def fn(b):
        sent, real = [0, 0], b.send

        def send(data, dst, *, tag=0):
            sent[0] += 1
            sent[1] += np.asarray(data).nbytes
            return real(data, dst, tag=tag)

        b.send = send
        got = broadcast(np.full(nbytes // 8, float(b.rank)), b, 1)
        return sent, got

    res = run_ranks(fn, n, timeout=60)
    assert all(r[0][0] == (n - 1).bit_length() for r in res), res
    total = sum(r[0][1] for r in res)
    assert (n - 1) * nbytes <= total <= (n - 1) * (nbytes + n * (HEADER_SIZE + PAD)), total
    assert all((got == 1.0).all() for _, got in res)


DTYPES = [np.float32, np.float64, np.float16, BFLOAT16, np.int32, np.int64]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(3, 6), dtype=st.sampled_from(DTYPES), size=st.integers(1, 200),
       op=st.sampled_from([ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX,
                           ReduceOp.MEAN]),
       use_out=st.booleans(), dealt=st.booleans(), seed=st.integers(0, 2**16))
def test_bits_equal_the_algorithms_they_stand_for(n, dtype, size, op, use_out, dealt, seed):
    """A gathered allreduce gives the star's rank-order fold's bits on every rank (an allreduce
    the model keeps header-first, its own algorithm's), a reduce_scatter the ring's, an
    all_gather every rank's block in rank order, with and without ``out=``, on ranks named
    consecutively or dealt out over two nodes."""
    dtype = np.dtype(dtype)
    if op is ReduceOp.MEAN and dtype.kind == "i":
        op = ReduceOp.SUM
    rng = np.random.default_rng(seed)
    xs = [rng.uniform(-4, 4, n * size).astype(dtype) for _ in range(n)]
    nodes = tuple("ab"[r % 2] if dealt else "ab"[2 * r // n] for r in range(n))

    def fn(b):
        b.nodes = nodes
        x = xs[b.rank]
        got = {}
        for name, call, shape in (
                ("allreduce", lambda **k: allreduce(x, b, op, **k), x.shape),
                ("reduce_scatter", lambda **k: reduce_scatter(x, b, op, **k), (size,)),
                ("all_gather", lambda **k: all_gather(x, b, **k), (n * n * size,))):
            out = np.empty(shape, dtype) if use_out else None
            mine = call(out=out) if use_out else call()
            assert out is None or mine is out
            got[name] = mine.tobytes()
        # (the star's bits where the allreduce gathers; where the model keeps it header-first
        # at this size and layout, the bits of the algorithm auto runs then)
        p = costmodel.params_for(b)
        gathers = costmodel.gathers("allreduce", x.nbytes, n, p)
        got["star"] = allreduce(x, b, op, algorithm="star" if gathers else costmodel.auto_pick(
            "allreduce", x.nbytes, n, p)).tobytes()
        got["ring"] = reduce_scatter(x, b, op, algorithm="ring").tobytes()
        return got

    res = run_ranks(fn, n, timeout=60)
    for r in range(n):
        assert res[r]["allreduce"] == res[r]["star"], r
        assert res[r]["reduce_scatter"] == res[r]["ring"], r
        assert res[r]["all_gather"] == np.concatenate(xs).tobytes(), r
    assert len({res[r]["allreduce"] for r in range(n)}) == 1


def test_rounds_number_the_ranks_node_by_node():
    """On nodes that hold ranks dealt out (a, b, a, b, ...), each rank sends to the ranks a
    node-by-node numbering (0, 2, 4, 1, 3, 5) names: round 1 to the position before its own,
    round 2 to the one two before; the model rates those rounds the same for either naming."""
    n = 6
    dealt = tuple("ab"[r % 2] for r in range(n))
    order = (0, 2, 4, 1, 3, 5)

    def fn(b):
        b.nodes = dealt
        seen = []
        real = b.send

        def send(data, dst, *, tag=0):
            seen.append(dst)
            return real(data, dst, tag=tag)

        b.send = send
        try:
            got = allreduce(np.full(4, b.rank + 1.0, np.float32), b)
        finally:
            del b.send
        return seen, got.tolist()

    for r, (seen, got) in enumerate(run_ranks(fn, n, timeout=60)):
        me = order.index(r)
        assert seen == [order[(me - d) % n] for d in (1, 2, 4)], (r, seen)
        assert got == [21.0] * 4
    p = costmodel.params_for(type("B", (), {"nodes": dealt})())
    assert p.node_of is not None and p.node_major(n) == order
    consecutive = dataclasses.replace(p, node_of=None)
    for nbytes in (8, 4096, 65536):
        for name in ("allreduce", "all_gather"):
            assert costmodel.gathered_time(name, nbytes, n, p) == pytest.approx(
                costmodel.gathered_time(name, nbytes, n, consecutive), rel=1e-12)
    assert ms.header_time(p, n) == pytest.approx(ms.header_time(consecutive, n), rel=1e-12)


@pytest.mark.parametrize("n", [3, 4])
def test_a_refused_call_raises_on_every_rank(n):
    """A rank whose own arguments are wrong (an ``out=`` of another shape) raises its own
    error; its peers, whose small allreduce rides the header exchange's rounds, raise the
    mismatch naming its refusal; the next call works on every rank."""
    def fn(b):
        x = np.ones(16, np.float32)
        try:
            allreduce(x, b, out=np.empty(15 if b.rank == 1 else 16, np.float32), timeout=8)
            got = "returned"
        except Exception as exc:  # (the test compares what each rank raised)
            got = f"{type(exc).__name__}: {exc}"
        return got, allreduce(x, b, timeout=8).tolist()

    res = run_ranks(fn, n, timeout=60)
    for r, (got, after) in enumerate(res):
        assert after == [float(n)] * 16, (r, after)
        if r == 1:
            assert not got.startswith("CollectiveMismatchError") and "out" in got, got
        else:
            assert got.startswith("CollectiveMismatchError") and "rank 1 refused" in got, got


def test_a_metadata_round_costs_the_check_no_message_of_its_own():
    """The collectives with a metadata round (the all-to-alls, all_gather_v, the object
    collectives) send their metadata in the header exchange's rounds: as many messages with
    the mismatch check on as with it off."""
    from ferro_collective import (
        all_gather_object,
        all_gather_v,
        all_to_all_single,
        set_mismatch_check,
    )

    sync = threading.Barrier(4, timeout=30)  # (the setting is the process's: every rank's)

    def fn(b):
        x = np.ones(8, np.float32)
        calls = [("all_to_all_single", lambda: all_to_all_single(x, b)),
                 ("all_gather_v", lambda: all_gather_v(x[:b.rank + 1], b)),
                 ("all_gather_object", lambda: all_gather_object({"r": b.rank}, b))]
        on = sends(b, calls)
        if sync.wait() == 0:
            set_mismatch_check(False)
        sync.wait()
        try:
            off = sends(b, calls)
        finally:
            if sync.wait() == 0:
                set_mismatch_check(True)
            sync.wait()
        return {k: (on[k][1], off[k][1]) for k in on}

    try:
        for res in run_ranks(fn, 4, timeout=60):
            for name, (on, off) in res.items():
                assert on == off >= 2, (name, on, off)
    finally:
        set_mismatch_check(True)


#: broadcasts from rank 0, ``(nbytes, the non-roots pass None)`` (0: bfloat16 of shape (2, 3)),
#: and how rank 0 runs each on three ranks or more: gathered in the header exchange's rounds
#: ("g"), the header exchange then the data ("h"), or gathered, met a non-root that passed None
#: and went on as the header's settling and the data ("m"); a small call after one with such
#: a non-root exchanges its header first, every rank remembering it alike, until one where
#: every rank passed an array; a call over the limit changes nothing
BIG = 2 * GATHER_MAX + 8
NONE_STEPS = [((4096, False), "g"), ((BIG, True), "h"), ((4096, False), "g"),
              ((4096, True), "m"), ((4096, True), "h"), ((BIG, False), "h"), ((0, True), "h"),
              ((4096, False), "h"), ((0, False), "g"), ((4096, True), "m"), ((BIG, False), "h"),
              ((4096, False), "h"), ((4096, False), "g")]


@pytest.mark.parametrize("n, ranks", [(3, "threads"), (4, "threads"), (5, "threads"),
                                      (3, "tcp")])
def test_non_roots_that_pass_none_get_the_root_s_array(n, ranks):
    from pair_fns import from_root

    steps = [step for step, _ in NONE_STEPS]
    res = run_ranks(lambda b: from_root(b, steps), n, timeout=60) if ranks == "threads" else \
        run_processes(from_root, n, steps, timeout=90)
    shapes = [(nb // 4,) if nb else (2, 3) for nb, _ in steps]
    for r, out in enumerate(res):
        assert [o[:2] for o in out] == [(shape, True) for shape in shapes], (r, out)
    rounds = (n - 1).bit_length()
    root = [o[2] for o in res[0]]
    # (the root's sends of a 4 KiB call's own algorithm: the tree's or the star's)
    data = root[NONE_STEPS.index(((4096, True), "h"))] - rounds
    assert data >= 1, root
    for (step, how), sent in zip(NONE_STEPS, root):
        if step[0] == BIG:
            assert how == "h" and sent >= rounds + 1, (step, how, root)  # (its own algorithm)
        elif step[0] == 4096:
            assert sent == {"g": rounds, "h": rounds + data, "m": 2 * rounds + data}[how], \
                (step, how, root)
        else:  # (12 bytes: the same forms, the data in as many sends or fewer)
            assert (sent == rounds) if how == "g" else (sent > rounds), (step, how, root)
