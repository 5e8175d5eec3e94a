"""Rank functions for the tests of the compiled one-call path of scatter, the all-to-alls,
all_gather_v and the object collectives (``_metacall.Twin``, ``_exchange_twin``,
``_objects_twin``) against their general path (spawned processes import them)."""

import numpy as np

import ferro_collective as fc
from ferro_collective.api import SCATTER
from ferro_collective.api_uneven import (
    ALL_GATHER_OBJECT,
    ALL_GATHER_V,
    ALL_TO_ALL,
    ALL_TO_ALL_SINGLE,
    BROADCAST_OBJECT,
)
from ferro_collective.dispatch import run
from ferro_collective.engine_group import group_of
from ferro_collective.executors import general

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is in the test extra
    BF16 = None

DTYPES = [np.float32, np.float64, np.float16, np.int8, np.uint16, np.int64, np.bool_]


def _cases(seed: int, n: int, count: int):
    """The same random cases on every rank: (dtype, rows[src][dst], trailing shape, root).
    Small ones move in the slot, large ones (rows up to 60,000) are read from the peers."""
    rng = np.random.default_rng(seed)
    dtypes = DTYPES + ([BF16] if BF16 is not None else [])
    for i in range(count):
        dt = np.dtype(dtypes[rng.integers(len(dtypes))])
        trailing = tuple(int(k) for k in rng.integers(1, 4, size=rng.integers(0, 3)))
        top = [3, 40, 600, 60_000][i % 4]
        rows = rng.integers(0, top + 1, size=(n, n))
        rows[rng.random((n, n)) < 0.2] = 0
        yield dt, rows.tolist(), trailing, int(rng.integers(n))


def _piece(src: int, dst: int, rows: int, trailing, dt):
    """What rank ``src`` sends rank ``dst`` (every rank can rebuild it)."""
    vals = np.arange(rows * int(np.prod(trailing)), dtype=np.int64) * 7 + 1000 * src + dst
    if dt.kind == "b":
        return (vals % 3 == 0).reshape(rows, *trailing)
    return vals.astype(dt).reshape(rows, *trailing)


def twin_meets_general(b, seed: int, count: int) -> list[str]:
    """Every mix of paths: in call ``k`` of a case, rank ``r`` takes the twin where bit ``r``
    of ``k`` is set and the general path otherwise; all_to_all_single, scatter, all_to_all and
    all_gather_v against numpy, bit for bit, with and without ``out=``. Returns the failures, and checks the
    twin counted its calls (and only those)."""
    g, n, r, bad = group_of(b), b.world_size, b.rank, []
    fc.barrier(b)
    for c, (dt, rows, trailing, root) in enumerate(_cases(seed, n, count)):
        sends = [_piece(r, d, rows[r][d], trailing, dt) for d in range(n)]
        x = np.concatenate(sends)
        wants = [_piece(s, r, rows[s][r], trailing, dt) for s in range(n)]
        want = np.concatenate(wants)
        splits = ([rows[r][d] for d in range(n)], [rows[s][r] for s in range(n)])
        k = rows[root][0]
        full = np.concatenate([_piece(root, d, k, trailing, dt) for d in range(n)])
        mine = full[r * k:(r + 1) * k]
        keep = (x.tobytes(), full.tobytes())
        for mix in range(2 ** n):
            twin = bool(mix >> r & 1)
            for use_out in (False, True):
                label = f"case {c} ({dt}, {trailing}, root {root}) mix {mix} out={use_out}"
                before = g.twin.taken if g.twin is not None else 0
                out = np.empty(want.shape, dt) if use_out else None
                got = (fc.all_to_all_single(x, b, send_splits=splits[0],
                                            recv_splits=splits[1], out=out) if twin else
                       run(ALL_TO_ALL_SINGLE, x, b, splits, None, "auto", out))
                if got.tobytes() != want.tobytes() or got.shape != want.shape or \
                        got.dtype != dt or (use_out and got is not out):
                    bad.append(f"all_to_all_single {label}")
                out = np.empty(mine.shape, dt) if use_out else None
                src = full if r == root else None
                got = (fc.scatter(src, b, root, out=out) if twin else
                       run(SCATTER, src, b, root, None, "auto", out))
                if got.tobytes() != mine.tobytes() or got.shape != mine.shape or \
                        got.dtype != dt or (use_out and got is not out):
                    bad.append(f"scatter {label}")
                got = (fc.all_to_all(sends, b) if twin else
                       run(ALL_TO_ALL, sends, b, None, None, "auto"))
                if [a.tobytes() for a in got] != [w.tobytes() for w in wants] or \
                        [a.shape for a in got] != [w.shape for w in wants] or \
                        {a.dtype for a in got} != {dt}:
                    bad.append(f"all_to_all {label}")
                mine_v = sends[(r + 1) % n]  # (its rows differ from rank to rank)
                got = (fc.all_gather_v(mine_v, b) if twin else
                       run(ALL_GATHER_V, mine_v, b, None, None, "auto"))
                want_v = [_piece(s, (s + 1) % n, rows[s][(s + 1) % n], trailing, dt)
                          for s in range(n)]
                if [a.tobytes() for a in got] != [w.tobytes() for w in want_v] or \
                        [a.shape for a in got] != [w.shape for w in want_v]:
                    bad.append(f"all_gather_v {label}")
                taken = g.twin.taken if g.twin is not None else 0
                if taken - before != 4 * twin:
                    bad.append(f"the twin ran {taken - before} calls, not {4 * twin}: {label}")
        if (x.tobytes(), full.tobytes()) != keep:
            bad.append(f"input modified in case {c}")
    fc.barrier(b)
    return bad


def twin_errors(b, twin_ranks: list) -> list[str]:
    """Wrong calls with the ranks in ``twin_ranks`` on the twin and the others on the general
    path: every rank raises the error the general path gives (the same text everywhere), and
    the group stays usable after each."""
    n, r = b.world_size, b.rank
    twin = r in twin_ranks
    got = []

    def scatter(x, root=0, out=None):
        return fc.scatter(x, b, root, out=out) if twin else \
            run(SCATTER, x, b, root, None, "auto", out)

    def a2a(x, send=None, recv=None, out=None):
        return fc.all_to_all_single(x, b, send_splits=send, recv_splits=recv, out=out) \
            if twin else run(ALL_TO_ALL_SINGLE, x, b, (send, recv), None, "auto", out)

    def a2a_list(xs):
        return fc.all_to_all(xs, b) if twin else run(ALL_TO_ALL, xs, b, None, None, "auto")

    calls = [
        ("scatter: dim 0 not divisible", lambda: scatter(np.ones(2 * n + 1) if r == 0 else None)),
        ("scatter: a 0-d root tensor", lambda: scatter(np.float32(3) if r == 0 else None)),
        ("scatter: the root passes None", lambda: scatter(None, root=n - 1)),
        ("scatter: a bad out on rank 1", lambda: scatter(
            np.arange(4 * n) if r == 0 else None,
            out=np.empty(3, np.int64) if r == 1 else None)),
        ("all_to_all_single: splits that disagree", lambda: a2a(
            np.ones(2 * n), [2] * n, [1] * n if r == 1 else [2] * n)),
        ("all_to_all_single: recv_splits=None against uneven sends", lambda: a2a(
            np.ones(n + r), [1] * (n - 1) + [1 + r])),
        ("all_to_all_single: rank 1's send_splits do not add up", lambda: a2a(
            np.ones(2 * n), [2] * n if r != 1 else [3] * n)),
        ("all_to_all_single: a bad out on rank 0", lambda: a2a(
            np.ones(2 * n), out=np.empty(5) if r == 0 else None)),
        ("all_to_all: rank 1 passes too few tensors", lambda: a2a_list(
            [np.ones(2)] * (n - 1 if r == 1 else n))),
        ("all_to_all: rank 2 mixes dtypes", lambda: a2a_list(
            [np.ones(2, np.float32 if r == 2 and d == 1 else np.float64) for d in range(n)])),
    ]
    for what, call in calls:
        try:
            call()
            got.append(f"{what}: no error")
        except (fc.CollectiveMismatchError, ValueError, TypeError) as exc:
            got.append(f"{what}: {type(exc).__name__}: {exc}")
        ok = fc.allreduce(np.ones(3), b)
        if ok.tolist() != [n] * 3:
            got.append(f"{what}: the group is not usable after it ({ok})")
    return got


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("no pickling here")


def _objects(r: int, n: int):
    """The objects rank ``r`` passes, case by case (the same cases on every rank): None, small
    ones, pickles of 1 to 200,000 bytes (past a 4 KiB slot), sizes that differ from rank to
    rank, and an empty bytes."""
    return [None, {"lr": 0.1, "rank": r}, b"", ("x" * (7 + 3000 * r), r),
            np.arange(25_000 * (r + 1), dtype=np.int64), [r] * (r * 40_000)]


def twin_objects(b, twin_runs: bool = True) -> list[str]:
    """broadcast_object from every root and all_gather_object, in every mix of paths (rank
    ``r`` takes the twin in call ``k`` where bit ``r`` of ``k`` is set): every rank gets the
    objects, equal to the senders' and not the same objects (the root keeps its own); the twin
    counts its calls and only those (none where ``twin_runs`` is False: an engine without
    cross-memory reads, whose large pickles go over messages). Returns the failures."""
    g, n, r, bad = group_of(b), b.world_size, b.rank, []
    fc.barrier(b)
    every = [_objects(s, n) for s in range(n)]
    for c, mine in enumerate(every[r]):
        for mix in range(2 ** n):
            twin = bool(mix >> r & 1)
            before = g.twin.taken if g.twin is not None else 0
            label = f"case {c} mix {mix}"
            for root in range(n):
                sent = mine if r == root else "ignored"
                got = (fc.broadcast_object(sent, b, root) if twin else
                       general(BROADCAST_OBJECT, sent, b, root, None, None, None))
                want = every[root][c]
                if not _same(got, want) or (r == root and got is not mine) or \
                        (r != root and _mutable(want) and got is want):
                    bad.append(f"broadcast_object from {root} {label}: {got!r:.60}")
            got = (fc.all_gather_object(mine, b) if twin else
                   general(ALL_GATHER_OBJECT, mine, b, None, None, None, None))
            if len(got) != n or not all(_same(a, e[c]) for a, e in zip(got, every)) or \
                    (_mutable(mine) and got[r] is mine):
                bad.append(f"all_gather_object {label}")
            taken = g.twin.taken if g.twin is not None else 0
            if taken - before != (n + 1) * twin * twin_runs:
                bad.append(f"the twin ran {taken - before} calls, not "
                           f"{(n + 1) * twin * twin_runs}: {label}")
    fc.barrier(b)
    return bad


def _mutable(obj) -> bool:
    """Whether a copy of ``obj`` is a new object (None and b"" unpickle as themselves)."""
    return isinstance(obj, (dict, list, np.ndarray))


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def twin_object_errors(b, twin_ranks: list) -> list[str]:
    """Objects that cannot be pickled, with the ranks in ``twin_ranks`` on the twin: every rank
    raises the general path's error (a TypeError naming the rank and the reason; the rank
    that passed it its own), and the group stays usable after each."""
    n, r = b.world_size, b.rank
    twin = r in twin_ranks
    got = []

    def bcast(obj, root):
        return fc.broadcast_object(obj, b, root) if twin else \
            general(BROADCAST_OBJECT, obj, b, root, None, None, None)

    def agather(obj):
        return fc.all_gather_object(obj, b) if twin else \
            general(ALL_GATHER_OBJECT, obj, b, None, None, None, None)

    calls = [
        ("broadcast_object: the root's object cannot be pickled", lambda: bcast(
            Unpicklable() if r == n - 1 else None, n - 1)),
        ("broadcast_object: a peer's cannot (ignored)", lambda: bcast(
            Unpicklable() if r == 1 else 5, 0)),
        ("all_gather_object: rank 1's cannot be pickled", lambda: agather(
            Unpicklable() if r == 1 else "fine")),
        ("all_gather_object: rank 0's and the last rank's cannot", lambda: agather(
            Unpicklable() if r in (0, n - 1) else "x" * 9000)),
    ]
    for what, call in calls:
        try:
            got.append(f"{what}: returned {call()!r}")
        except TypeError as exc:
            got.append(f"{what}: {type(exc).__name__}: {exc}")
        ok = fc.allreduce(np.ones(3), b)
        if ok.tolist() != [n] * 3:
            got.append(f"{what}: the group is not usable after it ({ok})")
    return got
