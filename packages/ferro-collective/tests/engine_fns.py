"""Module-level rank functions for the same-host engine tests (spawned processes import them)."""

import os
import resource
import time

import numpy as np

import ferro_collective as fc
from ferro_backend import CollectiveTimeoutError
from ferro_collective import ReduceOp

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


def equals_star(b, seed: int, count: int) -> list[str]:
    """Every collective on the engine against the star algorithm (rank-order fold) bit for bit;
    returns the failures (empty: all equal) and checks out=, in-place and async ordering."""
    assert b.engine is not None, "the engine is off"
    rng = np.random.default_rng(1000 * seed + b.rank)
    bad = []
    for dt, shape, op, root in _cases(seed, b.world_size, count):
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
    # an all_gather block between the direct-copy threshold and the slot size
    block = np.arange(50_000, dtype=np.float64) + b.rank
    if fc.all_gather(block, b).tobytes() != fc.all_gather(block, b, algorithm="star").tobytes():
        bad.append("all_gather direct copy")
    # async calls complete in issue order, interleaved with sync ones
    works = [fc.allreduce_async(np.full(1000, float(i)), b) for i in range(6)]
    mid = fc.allreduce(np.ones(3), b)
    if [float(w.wait(30)[0]) for w in works] != [i * b.world_size for i in range(6)] or \
            mid[0] != b.world_size:
        bad.append("async order")
    fc.barrier(b)
    return bad


def mismatch(b) -> str:
    """Rank 0 calls allreduce on 3 elements, the others on 4: every rank must say so."""
    try:
        fc.allreduce(np.ones(3 if b.rank == 0 else 4, np.float32), b)
    except fc.CollectiveMismatchError as exc:
        # the group stays usable after a mismatch
        ok = fc.allreduce(np.ones(2), b)[0] == b.world_size
        return f"{exc} | usable={ok}"
    return "no error"


def late_peer(b, delay: float) -> dict:
    """Rank 1 arrives ``delay`` s late; rank 0 has a 0.5 s deadline and measures its CPU use."""
    out = {}
    if b.rank == 1:
        time.sleep(delay)
        try:
            fc.allreduce(np.ones(4), b, timeout=5)
        except Exception as exc:  # rank 0 has given up by now
            out["error"] = type(exc).__name__
        return out
    cpu0 = resource.getrusage(resource.RUSAGE_THREAD).ru_utime
    t0 = time.monotonic()
    try:
        fc.allreduce(np.ones(4), b, timeout=0.5)
        out["error"] = None
    except CollectiveTimeoutError as exc:
        out["error"] = str(exc)
    out["seconds"] = time.monotonic() - t0
    out["cpu"] = resource.getrusage(resource.RUSAGE_THREAD).ru_utime - cpu0
    try:
        fc.allreduce(np.ones(4), b, timeout=0.5)
        out["after"] = "no error"
    except CollectiveTimeoutError as exc:
        out["after"] = str(exc)
    return out


def pid(b) -> int:
    return os.getpid()
