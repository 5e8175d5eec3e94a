"""Module-level rank functions for the same-host engine tests (spawned processes import them)."""

import logging
import os
import resource
import time

import numpy as np

import ferro_collective as fc
from ferro_backend import CollectiveTimeoutError, PeerAbortedError, PeerClosedError
from ferro_collective import ReduceOp
from ferro_collective._onecall import BROADCAST

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is in the test extra
    BF16 = None

DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int8, np.uint16, np.uint64]
OPS = [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT]


def _cases(seed: int, n: int, count: int):
    """The same random cases on every rank: (dtype, shape, op, root)."""
    rng = np.random.default_rng(seed)
    dtypes = DTYPES + ([BF16] if BF16 is not None else [])
    for i in range(count):
        dt = np.dtype(dtypes[rng.integers(len(dtypes))])
        op = OPS[rng.integers(len(OPS))]
        if op is ReduceOp.MEAN and dt.kind != "f":
            op = ReduceOp.SUM
        kind = rng.integers(4)
        if i == 0:
            shape = ()
        elif i == 1:
            shape = (0, 3)
        elif kind == 0:
            shape = (int(rng.integers(1, 40)),)
        elif kind == 1:
            shape = (n * int(rng.integers(1, 6)), int(rng.integers(1, 9)))
        else:
            shape = (n * int(rng.integers(1, 3000)),)
        yield dt, shape, op, int(rng.integers(n))


def _data(rng, dt, shape):
    if dt.kind == "f":
        return (rng.standard_normal(shape) * 3).astype(dt)
    return rng.integers(0, 50, size=shape).astype(dt)


def equals_star(b, seed: int, count: int, cases: list | None = None) -> list[str]:
    """Every collective on the engine against the star algorithm (rank-order fold) bit for bit;
    returns the failures (empty: all equal) and checks out=, in-place and async ordering.
    ``cases``: (dtype name, shape, op name, root) to run instead of ``count`` seeded ones."""
    assert b.engine is not None, "the engine is off"
    rng = np.random.default_rng(1000 * seed + b.rank)
    bad = []
    if cases is None:
        cases = list(_cases(seed, b.world_size, count))
    else:
        cases = [(np.dtype(BF16 if d == "bfloat16" else d), tuple(shape), ReduceOp[o],
                  root % b.world_size) for d, shape, o, root in cases]
    for dt, shape, op, root in cases:
        x = _data(rng, dt, shape)
        keep = x.copy()
        label = f"{dt}{list(shape)} {op.name}"
        with np.errstate(all="ignore"):
            got = fc.allreduce(x, b, op)
            ref = fc.allreduce(x, b, op, algorithm="star")
        if got.dtype != x.dtype or got.tobytes() != ref.tobytes():
            bad.append(f"allreduce {label}")
        got = fc.broadcast(x, b, root=root)
        ref = fc.broadcast(x, b, root=root, algorithm="star")
        if got.tobytes() != ref.tobytes():
            bad.append(f"broadcast {label} root {root}")
        got = fc.all_gather(x, b)
        if got.tobytes() != fc.all_gather(x, b, algorithm="star").tobytes():
            bad.append(f"all_gather {label}")
        if len(shape) and shape[0] % b.world_size == 0:
            with np.errstate(all="ignore"):
                got = fc.reduce_scatter(x, b, op)
                ref = fc.reduce_scatter(x, b, op, algorithm="star")
            if got.tobytes() != ref.tobytes():
                bad.append(f"reduce_scatter {label}")
        if x.tobytes() != keep.tobytes():
            bad.append(f"input modified {label}")
    # out= and in place, small and large
    for size in (10, 300_000):
        y = np.full(size, b.rank + 1.0)
        res = fc.allreduce(y, b, out=y)
        if res is not y or not (y == b.world_size * (b.world_size + 1) / 2).all():
            bad.append(f"in-place allreduce {size}")
        z = np.arange(size, dtype=np.float32) * (b.rank == 0)
        if fc.broadcast(z, b, out=z) is not z or z[-1] != size - 1:
            bad.append(f"in-place broadcast {size}")
    # an all_gather block larger than the default slot (read directly where that works)
    block = np.arange(150_000, dtype=np.float64) + b.rank
    if fc.all_gather(block, b).tobytes() != fc.all_gather(block, b, algorithm="star").tobytes():
        bad.append("all_gather direct copy")
    # async calls complete in issue order, interleaved with sync ones
    works = [fc.allreduce_async(np.full(1000, float(i)), b) for i in range(6)]
    mid = fc.allreduce(np.ones(3), b)
    if [float(w.wait(30)[0]) for w in works] != [i * b.world_size for i in range(6)] or \
            mid[0] != b.world_size:
        bad.append("async order")
    # the one-step small calls (broadcast, all_gather, reduce_scatter) while async calls are in
    # flight: they wait their turn on the general path, in issue order
    n = b.world_size
    works = [fc.broadcast_async(np.full(10, float(i)) if b.rank == 0 else np.zeros(10), b, 0)
             for i in range(3)]
    gathered = fc.all_gather(np.array([b.rank]), b)
    part = fc.reduce_scatter(np.arange(2 * n, dtype=np.int64), b)
    if [float(w.wait(30)[0]) for w in works] != [0.0, 1.0, 2.0] or \
            gathered.tolist() != list(range(n)) or \
            part.tolist() != [n * 2 * b.rank, n * (2 * b.rank + 1)]:
        bad.append("small calls behind async ones")
    # Python and numpy scalars: the one-call path (a 0-d array, as the general path makes
    # them), with the general path's results
    from ferro_collective.engine_group import group_of

    g = group_of(b)
    for value in (b.rank + 0.5, b.rank + 1, np.float32(b.rank) * 3, np.int16(b.rank), True):
        arr = np.asarray(value)
        op = ReduceOp.BOR if arr.dtype == np.bool_ else ReduceOp.SUM
        got = (fc.allreduce(value, b, op), fc.broadcast(value, b, n - 1),
               fc.all_gather(value, b))
        ref = (fc.allreduce(value, b, op, algorithm="star"),
               fc.broadcast(value, b, n - 1, algorithm="star"),
               fc.all_gather(value, b, algorithm="star"))
        if any(type(x) is not np.ndarray or x.dtype != y.dtype or x.shape != y.shape
               or x.tobytes() != y.tobytes() for x, y in zip(got, ref)):
            bad.append(f"scalar {value!r}: {got} != {ref}")
        if g is not None and g.cached(BROADCAST, arr, n - 1) is None:
            bad.append(f"scalar {value!r}: not on the one-call path")
    fc.barrier(b)
    return bad


def lean_mismatch(b) -> str:
    """Rank 0 broadcasts 3 contiguous elements (the one-step path), the others 4 strided ones
    (the general path): every rank must name the mismatch, and the group stays usable."""
    x = np.ones(3) if b.rank == 0 else np.ones(8)[::2]
    try:
        fc.broadcast(x, b, root=0)
    except fc.CollectiveMismatchError as exc:
        ok = fc.all_gather(np.array([1]), b).sum() == b.world_size
        return f"{exc} | usable={ok}"
    return "no error"


def mismatch(b) -> str:
    """Rank 0 calls allreduce on 3 elements, the others on 4: every rank must say so."""
    try:
        fc.allreduce(np.ones(3 if b.rank == 0 else 4, np.float32), b)
    except fc.CollectiveMismatchError as exc:
        # the group stays usable after a mismatch
        ok = fc.allreduce(np.ones(2), b)[0] == b.world_size
        return f"{exc} | usable={ok}"
    return "no error"


def _wait_for(path: str, limit: float = 30.0) -> bool:
    """Poll for the file ``path`` (another rank's signal) for at most ``limit`` seconds."""
    end = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


def late_peer(b, flags: str) -> dict:
    """Rank 1 stays silent until rank 0 has timed out (and made its second call): rank 0 has
    a 0.5 s deadline and measures its CPU use. Ranks beyond 1 are in the allreduce before
    rank 0 starts and have a long deadline: rank 0's deadline always falls first (no other
    rank's timeout aborts the job under it) and names rank 1 alone."""
    out = {}
    done = os.path.join(flags, "rank0-done")
    if b.rank == 1:
        out["waited"] = _wait_for(done)  # arrives late by construction, not by a sleep
        try:
            fc.allreduce(np.ones(4), b, timeout=5)
        except Exception as exc:  # rank 0 has given up by now
            out["error"] = type(exc).__name__
        return out
    if b.rank == 0:  # every rank beyond 1 is about to call (its flag is written just before)
        out["waited"] = all(_wait_for(os.path.join(flags, f"in{r}"))
                            for r in range(2, b.world_size))
        expected = CollectiveTimeoutError  # its own deadline, no other rank's abort
    else:
        _touch(os.path.join(flags, f"in{b.rank}"))
        # rank 0's timeout ends the group: this rank's call is aborted (long before 30 s)
        expected = (CollectiveTimeoutError, PeerAbortedError, PeerClosedError)
    cpu0 = resource.getrusage(resource.RUSAGE_THREAD).ru_utime
    t0 = time.monotonic()
    try:
        fc.allreduce(np.ones(4), b, timeout=0.5 if b.rank == 0 else 30)
        out["error"] = None
    except expected as exc:
        out["error"] = str(exc)
    out["seconds"] = time.monotonic() - t0
    out["cpu"] = resource.getrusage(resource.RUSAGE_THREAD).ru_utime - cpu0
    # the group that timed out is aborted: rank 0 too raises the job's abort after it
    after = (CollectiveTimeoutError, PeerAbortedError) + (
        () if b.rank == 0 else (PeerClosedError,))
    try:
        fc.allreduce(np.ones(4), b, timeout=0.5 if b.rank == 0 else 30)
        out["after"] = "no error"
    except after as exc:
        out["after"] = str(exc)
    if b.rank == 0:
        _touch(done)
    else:  # stay open until rank 0 is done: it must see a silent rank 1, not this rank's close
        out["waited"] = _wait_for(done)
    return out


def pid(b) -> int:
    return os.getpid()


# ----------------------------------------------------------------------------- scatter, all-to-all
def _p2p_counter():
    """Counts the engine calls of scatter and the all-to-alls whose data went over
    point-to-point messages instead (``metadata_step.get_pieces`` said so), in this process."""
    from ferro_collective import exchange, metadata_step, rooted

    get = metadata_step.get_pieces
    if getattr(exchange.get_pieces, "used", None) is None:
        def counting(g, call, *args, **kwargs):
            done = get(g, call, *args, **kwargs)
            if not done:
                counting.used.append(call.name)
            return done

        counting.used = []
        exchange.get_pieces = rooted.get_pieces = counting
    return exchange.get_pieces.used


def _exchange_sizes(seed: int, n: int):
    """The same (label, rows matrix [src][dst], trailing shape, dtype) cases on every rank:
    small (in the slots), medium, large (>= 256 KiB per rank: read from the peers' memory),
    zero-size pieces and uneven splits."""
    rng = np.random.default_rng(seed)
    dtypes = [np.float32, np.float64, np.int8, np.uint16, np.bool_] + \
        ([BF16] if BF16 is not None else [])
    yield "equal small", [[2] * n for _ in range(n)], (3,), np.dtype(np.float32)
    yield "all empty", [[0] * n for _ in range(n)], (2,), np.dtype(np.int32)
    yield "one empty row", [[0 if s == d else 1 for d in range(n)] for s in range(n)], (), \
        np.dtype(np.int64)
    yield "equal large", [[40_000] * n for _ in range(n)], (2,), np.dtype(np.float64)
    for i in range(4):
        top = [5, 300, 30_000, 90_000][i]
        rows = rng.integers(0, top, size=(n, n))
        rows[rng.random((n, n)) < 0.3] = 0  # zero-size pieces
        dt = np.dtype(dtypes[rng.integers(len(dtypes))])
        yield f"uneven {top}", rows.tolist(), (int(rng.integers(1, 4)),), dt


def _piece(src: int, dst: int, rows: int, trailing, dt):
    """What rank ``src`` sends rank ``dst`` (every rank can rebuild it)."""
    vals = np.arange(rows * int(np.prod(trailing)), dtype=np.int64) * 7 + 1000 * src + dst
    if dt.kind == "b":
        return (vals % 3 == 0).reshape(rows, *trailing)
    return vals.astype(dt).reshape(rows, *trailing)


def exchange_equals_p2p(b, seed: int) -> list[str]:
    """scatter, all_to_all and all_to_all_single on the engine against numpy and against their
    point-to-point algorithms, bit for bit; inputs kept; out= (scatter's root with an out that
    is its own block of the input); the failures, and a note of every fallback to messages."""
    from ferro_collective.api import SCATTER
    from ferro_collective.api_uneven import ALL_TO_ALL, ALL_TO_ALL_SINGLE
    from ferro_collective.dispatch import run

    assert b.engine is not None, "the engine is off"
    n, r = b.world_size, b.rank
    used = _p2p_counter()
    used.clear()
    bad = []
    for label, rows, trailing, dt in _exchange_sizes(seed, n):
        # all_to_all_single and all_to_all
        sends = [_piece(r, d, rows[r][d], trailing, dt) for d in range(n)]
        want = [_piece(s, r, rows[s][r], trailing, dt) for s in range(n)]
        x = np.concatenate(sends)
        keep = x.tobytes()
        send, recv = [rows[r][d] for d in range(n)], [rows[s][r] for s in range(n)]
        got = fc.all_to_all_single(x, b, send_splits=send, recv_splits=recv)
        ref = run(ALL_TO_ALL_SINGLE, x, b, (send, recv), None, "pairwise")
        if got.tobytes() != np.concatenate(want).tobytes() or got.tobytes() != ref.tobytes() \
                or got.dtype != dt:
            bad.append(f"all_to_all_single {label}")
        out = np.empty_like(got)
        if fc.all_to_all_single(x, b, send_splits=send, recv_splits=recv, out=out) is not out \
                or out.tobytes() != ref.tobytes():
            bad.append(f"all_to_all_single out= {label}")
        got = fc.all_to_all(sends, b)
        ref = run(ALL_TO_ALL, sends, b, None, None, "pairwise")
        if [a.tobytes() for a in got] != [w.tobytes() for w in want] or \
                [a.tobytes() for a in ref] != [w.tobytes() for w in want] or \
                [a.shape for a in got] != [w.shape for w in want]:
            bad.append(f"all_to_all {label}")
        if x.tobytes() != keep or np.concatenate(sends).tobytes() != keep:
            bad.append(f"input modified {label}")
        # scatter: rank root's rows to every rank, equal blocks of rows[root][0] rows
        root = seed % n
        k = rows[root][0]
        full = np.concatenate([_piece(root, d, k, trailing, dt) for d in range(n)])
        mine = full[r * k:(r + 1) * k]
        for algo in ("tree", "star"):
            ref = run(SCATTER, full if r == root else None, b, root, None, algo)
            if ref.tobytes() != mine.tobytes():
                bad.append(f"scatter {algo} {label}")
        got = fc.scatter(full if r == root else None, b, root)
        if got.tobytes() != mine.tobytes() or got.shape != mine.shape:
            bad.append(f"scatter {label} root {root}")
        own = full.copy()
        blk = own[r * k:(r + 1) * k]
        res = fc.scatter(own if r == root else None, b, root, out=blk)  # the root's own block
        if res is not blk or own.tobytes() != full.tobytes() if r == root else \
                blk.tobytes() != mine.tobytes():
            bad.append(f"scatter out= {label} root {root}")
        if full.tobytes() != np.concatenate([_piece(root, d, k, trailing, dt)
                                             for d in range(n)]).tobytes():
            bad.append(f"scatter input modified {label}")
    # 0-d pieces and async calls queue in issue order with the engine's other calls
    zero = fc.all_to_all([np.array(10 * r + d, np.int16) for d in range(n)], b)
    if [a.shape for a in zero] != [()] * n or [int(a) for a in zero] != [10 * s + r
                                                                         for s in range(n)]:
        bad.append("all_to_all 0-d")
    big = np.arange(n * 70_000, dtype=np.float32) + r
    works = [fc.all_to_all_single_async(big, b), fc.scatter_async(big if r == 0 else None, b),
             fc.allreduce_async(np.ones(3), b), fc.all_to_all_async([big[:5]] * n, b)]
    mid = fc.all_gather(np.array([r]), b)
    got = [w.wait(60) for w in works]
    if got[0].tobytes() != np.concatenate([np.arange(r * 70_000, (r + 1) * 70_000,
                                                     dtype=np.float32) + s
                                           for s in range(n)]).tobytes() or \
            got[1].tobytes() != np.arange(r * 70_000, (r + 1) * 70_000,
                                          dtype=np.float32).tobytes() or \
            got[2].tolist() != [n] * 3 or [a.tolist() for a in got[3]] != \
            [(np.arange(5) + s).tolist() for s in range(n)] or mid.tolist() != list(range(n)):
        bad.append("async order")
    fc.barrier(b)
    return bad + [f"fell back to messages: {sorted(set(used))}"] * bool(used)


def exchange_mismatch(b, case: str) -> str:
    """Rank 0 calls a fast-path scatter / all-to-all, the others another collective (small or
    large, so each side is on its own way of the engine): every rank must say so, and the
    group stays usable."""
    n, r = b.world_size, b.rank
    big = np.ones(n * 100_000, np.float32)
    calls = {
        "scatter/allreduce": (lambda: fc.scatter(big, b, root=0),
                              lambda: fc.allreduce(big, b)),
        "all_to_all_single/all_gather": (lambda: fc.all_to_all_single(big, b),
                                         lambda: fc.all_gather(big, b)),
        "all_to_all/scatter": (lambda: fc.all_to_all([np.ones(3)] * n, b),
                               lambda: fc.scatter(None, b, root=0)),
        "all_to_all_single/gather": (lambda: fc.all_to_all_single(np.ones(2 * n), b),
                                     lambda: fc.gather(np.ones(2), b)),
    }
    try:
        calls[case][0 if r == 0 else 1]()
    except fc.CollectiveMismatchError as exc:
        single = fc.all_to_all_single(np.arange(n * 70_000, dtype=np.float64) + r, b)
        ok = single[-1] == (n - 1) + r * 70_000 + 70_000 - 1 and \
            fc.allreduce(np.ones(2), b)[0] == n
        return f"{exc} | usable={ok}"
    return "no error"


def exchange_stalled_reader(b, flags: str) -> dict:
    """A large scatter whose non-root ranks are slow to read the root's memory: the root times
    out at its deadline in the last step (it waits for them to finish reading), naming them."""
    from ferro_collective.engine_group import EngineGroup

    out = {}
    if b.rank != 0:
        orig = EngineGroup.read

        def slow(self, rank, addr, dst):
            time.sleep(1.5)
            return orig(self, rank, addr, dst)

        EngineGroup.read = slow
        _touch(os.path.join(flags, f"in{b.rank}"))
    else:  # both readers are about to call: a reader the load started late is not one of
        # those the root's 0.5 s deadline names for a stalled read
        out["waited"] = all(_wait_for(os.path.join(flags, f"in{r}"))
                            for r in range(1, b.world_size))
    t0 = time.monotonic()
    try:
        fc.scatter(np.ones(b.world_size * 200_000) if b.rank == 0 else None, b,
                   timeout=0.5 if b.rank == 0 else 1.0)
        out["error"] = None
    except (CollectiveTimeoutError, PeerClosedError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - t0
    if b.rank == 0:  # alive until every reader has its result (a file each): a reader that
        # the load held back must still meet the root's withdrawn step, not its close
        out["held"] = all(_wait_for(os.path.join(flags, f"done{r}"))
                          for r in range(1, b.world_size))
    else:
        _touch(os.path.join(flags, f"done{b.rank}"))
    return out


class StallFlag(logging.Handler):
    """On the ``ferro_collective`` logger: a stall report ("still waiting") writes the file
    ``flag`` in ``flags`` (set before each call), the signal a late peer waits for."""

    def __init__(self, flags: str) -> None:
        super().__init__()
        self.flags = flags
        self.flag = ""

    def emit(self, record: logging.LogRecord) -> None:
        if self.flag and "still waiting" in record.getMessage():
            _touch(os.path.join(self.flags, self.flag))

    def __enter__(self) -> "StallFlag":
        logging.getLogger("ferro_collective").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("ferro_collective").removeHandler(self)


def late_but_in_time(b, flags: str) -> list:
    """Rank 1 joins each one-call collective after rank 0's stall report (it waits for the
    file rank 0's log handler writes on it) and so before rank 0's 4 s deadline: rank 0's
    call waits on and returns the right result. The report comes at a quarter of the
    deadline, which leaves rank 1 3 s to arrive after it."""
    fc.set_stall_report(0.25)
    n = b.world_size
    got = []
    x = np.arange(8, dtype=np.float32) + b.rank
    calls = [
        lambda: fc.allreduce(x, b, ReduceOp.MAX, timeout=4),
        lambda: fc.reduce_scatter(x, b, timeout=4),
        lambda: fc.broadcast(x, b, root=1, timeout=4),
        lambda: fc.all_gather(x[:2], b, timeout=4),
        lambda: fc.barrier(b, timeout=4),
    ]
    reported = []
    with StallFlag(flags) as stall:
        for i, call in enumerate(calls):
            stall.flag = f"stall{i}"
            if b.rank == 1:
                reported.append(_wait_for(os.path.join(flags, stall.flag)))
            res = call()
            got.append(None if res is None else res.tolist())
    expected = [(np.arange(8) + n - 1).tolist(),
                (sum(np.arange(8) + r for r in range(n))[b.rank * 8 // n:(b.rank + 1) * 8 // n]
                 ).tolist(),
                (np.arange(8) + 1).tolist(),
                np.concatenate([np.arange(2) + r for r in range(n)]).tolist(),
                None]
    return [g == e for g, e in zip(got, expected)] + reported


def bad_timeouts(b) -> list:
    """Every one-call collective with a bad timeout raises ValueError (every rank passes it)
    and takes no sequence number: the calls after it still pair up and finish at once."""
    fc.barrier(b)  # the group has run a call: a sequence number taken and dropped would show
    x = np.arange(8, dtype=np.float32)
    calls = [lambda t: fc.allreduce(x, b, timeout=t), lambda t: fc.reduce_scatter(x, b, timeout=t),
             lambda t: fc.broadcast(x, b, 0, timeout=t), lambda t: fc.all_gather(x, b, timeout=t),
             lambda t: fc.barrier(b, timeout=t)]
    errors = []
    for call in calls:
        for bad in (-1.0, float("nan")):
            try:
                call(bad)
                errors.append("no error")
            except ValueError as exc:
                errors.append("timeout" in str(exc))
    t0 = time.monotonic()
    ok = fc.allreduce(x, b, timeout=5)[-1] == 7 * b.world_size
    return [all(e is True for e in errors), bool(ok), time.monotonic() - t0 < 1.0]


def compiled_path(b) -> list[str]:
    """Each one-call collective on contiguous arrays runs on the compiled path (its plan made
    once, found again), with and without ``out=`` (in place included); calls it does not take
    (a strided input, an ``out=`` of another dtype) run on the general path with the same bits;
    a wrong ``out=`` still gets the general path's error."""
    from ferro_collective import _onecall as F
    from ferro_collective.engine_group import group_of

    g, n, bad = group_of(b), b.world_size, []
    rng = np.random.default_rng(b.rank)
    x = rng.standard_normal((4 * n, 3)).astype(np.float32)
    cases = [(F.ALLREDUCE, fc.allreduce, ReduceOp.SUM, x.shape),
             (F.REDUCE_SCATTER, fc.reduce_scatter, ReduceOp.MAX, (4, 3)),
             (F.BROADCAST, fc.broadcast, n - 1, x.shape),
             (F.ALL_GATHER, fc.all_gather, None, (4 * n * n, 3))]
    for kind, fn, arg, shape in cases:
        args = () if arg is None else (arg,)
        ref = fn(x, b, *args, algorithm="star")
        got = fn(x, b, *args)
        plan = g.cached(kind, x, arg)
        if plan is None or plan.out_shape != shape:
            bad.append(f"{fn.__name__}: no plan ({plan})")
        out = np.empty(shape, np.float32)
        again = fn(x, b, *args, out=out)
        if g.cached(kind, x, arg) is not plan or again is not out:
            bad.append(f"{fn.__name__}: the plan was made again, or out= not returned")
        strided = fn(np.asfortranarray(x), b, *args)
        for name, res in (("new", got), ("out=", again), ("strided", strided)):
            if res.tobytes() != ref.tobytes():
                bad.append(f"{fn.__name__} {name}: other bits than star")
        try:
            fn(x, b, *args, out=np.empty(shape, np.float64))
            bad.append(f"{fn.__name__}: out= of another dtype was taken")
        except fc.SizeMismatchError as exc:
            if "out is float64" not in str(exc):
                bad.append(f"{fn.__name__}: {exc}")
    inplace = x.copy()
    if fc.allreduce(inplace, b, out=inplace) is not inplace or \
            inplace.tobytes() != fc.allreduce(x, b, algorithm="star").tobytes():
        bad.append("in-place allreduce")
    fc.barrier(b)
    return bad


def other_threads_run_while_waiting(b) -> list[bool]:
    """A one-call step waiting for a late peer lets this process's other threads run (it holds
    the GIL only for its first microsecond): a counting thread advances during rank 0's wait,
    for the barrier, a small allreduce and a small broadcast."""
    import threading

    flags = []
    x = np.ones(16, np.float32)
    for call in (lambda: fc.barrier(b), lambda: fc.allreduce(x, b),
                 lambda: fc.broadcast(x, b, 1)):
        fc.barrier(b)
        if b.rank == 1:
            time.sleep(0.3)
            call()
            continue
        count, stop = [0], threading.Event()

        def spin(count=count, stop=stop):
            while not stop.is_set():
                count[0] += 1

        t = threading.Thread(target=spin)
        t.start()
        call()
        stop.set()
        t.join(5)
        flags.append(count[0] > 200_000)  # held GIL: at most a switch interval (5 ms) of it
    return flags


def compiled_gather(b) -> list[str]:
    """A slot-sized gather runs on the compiled path for every root (one all_gather step under
    the gather's header), with and without ``out=``; a rank on the general path (a strided
    input, or ``out=`` passed off the root) meets the others in the same step with the same
    bits; a gather never matches an all_gather."""
    from ferro_collective import _onecall as F
    from ferro_collective.engine_group import group_of

    g, n, bad = group_of(b), b.world_size, []
    blocks = [np.random.default_rng(r).standard_normal((3, 2)).astype(np.float32)
              for r in range(n)]
    want = np.concatenate(blocks)
    x = blocks[b.rank]
    for root in range(n):
        mine = b.rank == root
        for variant in ("plain", "out", "strided", "out off the root"):
            arg = np.asfortranarray(x) if variant == "strided" and b.rank == 0 else x
            out = np.empty_like(want) if variant == "out" and mine or \
                variant == "out off the root" and not mine else None
            got = fc.gather(arg, b, root, out=out)
            if not mine:
                if got is not None:
                    bad.append(f"root {root} {variant}: rank {b.rank} got {got!r}")
                continue
            if got is None or got.tobytes() != want.tobytes():
                bad.append(f"root {root} {variant}: other bits")
            if variant == "out" and got is not out:
                bad.append(f"root {root}: out= not returned")
        plan = g.cached(F.GATHER, x, root)
        if plan is None or plan.name != "gather" or plan.out_shape != want.shape:
            bad.append(f"root {root}: no compiled plan ({plan})")
    try:
        if b.rank == 0:
            fc.gather(x, b, 0, timeout=5)
        else:
            fc.all_gather(x, b, timeout=5)
        bad.append("a gather matched an all_gather")
    except fc.CollectiveMismatchError:
        pass
    return bad


def moving_slot_data(b, counts: list, calls: int) -> list[str]:
    """One-step calls whose data moves through the slot from call to call (8 KiB per rank and
    up: _onestep.h): ``calls`` calls in a row of each collective and size, new data each time,
    against the star algorithm bit for bit, with rank 1 on the general path (a strided input)
    every third call, so that both paths must place each step's data alike."""
    bad = []
    for count in counts:
        for i in range(calls):
            x = np.random.default_rng([b.rank, count, i]).standard_normal(count).astype(
                np.float32)
            arg = np.repeat(x, 2)[::2] if b.rank == 1 and i % 3 == 2 else x
            cases = {"allreduce": lambda a, **k: fc.allreduce(a, b, **k),
                     "reduce_scatter": lambda a, **k: fc.reduce_scatter(a, b, **k),
                     "all_gather": lambda a, **k: fc.all_gather(a, b, **k),
                     "broadcast": lambda a, root=i % b.world_size, **k: fc.broadcast(
                         a.copy() if a.flags.c_contiguous else np.repeat(a, 2)[::2], b, root,
                         **k),  # into a copy, strided or not
                     "gather": lambda a, **k: fc.gather(a, b, 0, **k)}
            for name, fn in cases.items():
                if name == "gather":  # star's all_gather, kept on the root
                    ref = fc.all_gather(x, b, algorithm="star")
                    ref = ref if b.rank == 0 else None
                else:
                    ref = fn(x, algorithm="star")
                got = fn(arg)
                if (ref is None) != (got is None) or \
                        ref is not None and ref.tobytes() != got.tobytes():
                    bad.append(f"{name} of {count} items, call {i}: other bits than star")
    return bad


def door_headers(b) -> list[str]:
    """Every door call publishes the header ``header.encode`` packs for it (collective, dtype
    as numpy names it, shape, op, root; a shape of more than six dims hashed alike; the span a
    compressed call's decider publishes), so a rank on either path meets the other's header."""
    from ferro_collective.dispatch import run
    from ferro_collective.engine_group import group_of
    from ferro_collective.executors import prepared
    from ferro_collective.header import _SEQ_OFFSET, encode
    from ferro_collective.records import ALL_GATHER, ALL_TO_ALL_SINGLE

    n, bad = b.world_size, []
    big = np.ones((1, 2, 1, 1, 1, 3, 2, 1), np.float32)
    cases = [
        ("allreduce", lambda: fc.allreduce(np.ones((4, 3), np.float32), b),
         (np.float32, (4, 3), ReduceOp.SUM, -1)),
        ("allreduce", lambda: fc.allreduce(np.ones(5, np.float16), b, ReduceOp.MEAN),
         (np.float16, (5,), ReduceOp.MEAN, -1)),
        ("allreduce", lambda: fc.allreduce(np.ones(2, np.int8), b, ReduceOp.BXOR),
         (np.int8, (2,), ReduceOp.BXOR, -1)),
        ("allreduce", lambda: fc.allreduce(np.ones(3, bool), b, ReduceOp.BOR),
         (bool, (3,), ReduceOp.BOR, -1)),
        ("reduce_scatter", lambda: fc.reduce_scatter(np.ones((2 * n, 2), np.float64), b,
                                                     ReduceOp.MIN),
         (np.float64, (2 * n, 2), ReduceOp.MIN, -1)),
        ("broadcast", lambda: fc.broadcast(np.ones(3, np.complex64), b, n - 1),
         (np.complex64, (3,), None, n - 1)),
        ("all_gather", lambda: fc.all_gather(np.float64(2.0), b), (np.float64, (), None, -1)),
        ("gather", lambda: fc.gather(big, b, 0), (np.float32, big.shape, None, 0)),
        ("reduce", lambda: fc.reduce(np.ones(4, np.uint16), b, n - 1, ReduceOp.PRODUCT),
         (np.uint16, (4,), ReduceOp.PRODUCT, n - 1)),
        ("barrier", lambda: fc.barrier(b), (None, (), None, -1)),
        # a compressed call's decider: its span (the numbers its whole call takes) in bytes 6-7
        ("all_gather", lambda: prepared(ALL_GATHER, np.ones(3, np.uint8), b, None, None,
                                        np.empty(3 * n, np.uint8), span=9)[1](),
         (np.uint8, (3,), None, -1), 9),
        ("all_gather", lambda: run(ALL_GATHER, np.ones(3, np.uint8), b, span=9),
         (np.uint8, (3,), None, -1), 9),  # (the one-call path's)
        ("all_to_all_single", lambda: run(ALL_TO_ALL_SINGLE, np.ones((n, 2), np.uint8), b,
                                          (None, None), span=9),
         (np.uint8, (-1, 2), None, -1), 9),  # (the twin's)
    ]
    if BF16 is not None:
        cases.append(("allreduce", lambda: fc.allreduce(np.ones(4, BF16), b, ReduceOp.MAX),
                      (BF16, (4,), ReduceOp.MAX, -1)))
    for name, call, (dt, shape, op, root), *span in cases:
        call()
        got = group_of(b).steps.headers()[b.rank]
        seq = int.from_bytes(got[_SEQ_OFFSET:_SEQ_OFFSET + 4], "little")
        want = encode(name, None if dt is None else np.dtype(dt), shape, op, root, seq,
                      span=span[0] if span else 0)
        if got != want:
            bad.append(f"{name} {dt} {shape}: the door published {got.hex()}, "
                       f"header.encode packs {want.hex()}")
    return bad


def through_the_door(b) -> list[str]:
    """The collectives run through the engine's door: each call takes one ticket (the door's
    order, shared with its other clients), float16 and bfloat16 reductions on the engine equal
    the star algorithm's bits (folded in float32, rounded once), at one step and split; a
    closed backend's door refuses at once."""
    from ferro_collective.engine_group import group_of

    bad = []
    fc.barrier(b)
    comm = group_of(b).comm
    before = comm.reserve()
    comm.skip(before)  # (a reserved ticket holds every later call until it runs or is skipped)
    fc.allreduce(np.ones(8, np.float32), b)
    fc.allreduce(np.ones((3, 3), np.float32)[:, :2], b)  # strided: the general path
    fc.broadcast(np.ones(4), b, 0)
    after = comm.reserve()
    comm.skip(after)
    if after - before != 4:
        bad.append(f"tickets {before} -> {after}: the calls did not take one each")
    dts = [np.float16] + ([BF16] if BF16 is not None else [])
    for dt in dts:
        for count in (1000, 300_000):  # one step, split
            x = (np.random.default_rng([b.rank, count]).standard_normal(count) * 4).astype(dt)
            for op in (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX):
                got = fc.allreduce(x, b, op)
                ref = fc.allreduce(x, b, op, algorithm="star")
                if got.tobytes() != ref.tobytes():
                    bad.append(f"{np.dtype(dt)} {op.name} of {count}: other bits than star")
    return bad


def subgroup_engine_late_and_closed(b) -> list:
    """A subgroup whose engine is attached after a collective ran on it over messages (its
    numbers then come from the door: the state is made again), then closed on rank 0: its
    later collectives raise PeerClosedError at once (the view's engine is closed with it)."""
    from ferro_backend import SubBackend
    from ferro_backend.engine import attach_engine

    s = SubBackend(b, range(b.world_size), name="late")
    out = [fc.allreduce(np.ones(3), s, timeout=20).tolist()]
    attach_engine(s)
    out.append(fc.allreduce(np.full(3, 1.0 + b.rank), s, timeout=20).tolist())
    out.append(fc.all_gather(np.array([b.rank]), s, timeout=20).tolist())
    fc.barrier(s, timeout=20)
    if b.rank == 0:
        s.close()
        t0 = time.monotonic()
        try:
            fc.allreduce(np.ones(3), s, timeout=20)
            out.append("ran on a closed view")
        except PeerClosedError:
            out.append(("closed", time.monotonic() - t0 < 5))
    return out


def pending_works_after_a_peer_closes(b, flags: str) -> list[str]:
    """Ranks 0 and 2 issue six async calls, then rank 1 closes its backend (it waits for both
    to have issued theirs: files in ``flags``); each Work's error, and a later blocking call's,
    as ``type: message``, with whether it is an object another call raised already."""
    if b.rank == 1:
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(flags, f"issued{r}")) for r in (0, 2)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        b.close()
        return []
    works = [("allreduce", fc.allreduce_async(np.ones(10), b, timeout=30)),
             ("broadcast", fc.broadcast_async(np.ones(10), b, timeout=30)),
             ("all_gather", fc.all_gather_async(np.ones(10), b, timeout=30)),
             ("reduce_scatter", fc.reduce_scatter_async(np.ones(12), b, timeout=30)),
             ("gather", fc.gather_async(np.ones(10), b, timeout=30)),
             ("all_gather_v", fc.all_gather_v_async(np.ones(3), b, timeout=30))]
    with open(os.path.join(flags, f"issued{b.rank}"), "w"):
        pass
    out, seen = [], set()
    for name, work in works:
        try:
            work.wait(60)
            out.append(f"{name} returned")
        except Exception as exc:
            out.append(f"{name} -> {type(exc).__name__}: {exc}" +
                       (" (raised before)" if id(exc) in seen else ""))
            seen.add(id(exc))
    try:
        fc.gather(np.ones(3), b, timeout=30)
        out.append("gather returned")
    except Exception as exc:
        out.append(f"gather -> {type(exc).__name__}: {exc}")
    return out
