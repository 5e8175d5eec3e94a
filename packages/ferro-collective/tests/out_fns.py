"""Module-level rank functions for test_out_refusals.py's real-process runs (spawned processes
import them): a bad ``out=`` on rank 1 of each uneven or rooted call."""

import numpy as np

import ferro_collective as fc

F32 = np.float32


def _read_only(shape, dtype=F32):
    a = np.empty(shape, dtype)
    a.flags.writeable = False
    return a


def _bad(b, good, bad):
    return bad if b.rank == 1 else good


#: each a call where rank 1's out= is wrong in a way it knows before the data moves
EARLY = {
    "all_gather_v dtype": lambda b: fc.all_gather_v(
        np.ones(2 + b.rank, F32), b, out=[np.empty(2 + q, _bad(b, F32, np.float64))
                                           for q in range(2)], timeout=10),
    "all_gather_v own entry": lambda b: fc.all_gather_v(
        np.ones(2 + b.rank, F32), b, out=[np.empty(2, F32), np.empty(_bad(b, 3, 4), F32)],
        timeout=10),
    "all_gather_v read-only": lambda b: fc.all_gather_v(
        np.ones(2, F32), b, out=[np.empty(2, F32), _bad(b, np.empty(2, F32), _read_only(2))],
        timeout=10),
    "all_gather_v_async dtype": lambda b: fc.all_gather_v_async(
        np.ones(2, F32), b, out=[np.empty(2, _bad(b, F32, np.int32))] * 2, timeout=10).wait(),
    "all_to_all dtype": lambda b: fc.all_to_all(
        [np.ones(3, F32)] * 2, b, out=[np.empty(3, _bad(b, F32, np.float64))] * 2, timeout=10),
    "all_to_all trailing shape": lambda b: fc.all_to_all(
        [np.ones((3, 2), F32)] * 2, b, out=[np.empty(_bad(b, (3, 2), (3, 1)), F32)] * 2,
        timeout=10),
    "all_to_all not a list": lambda b: fc.all_to_all(
        [np.ones(3, F32)] * 2, b, out=_bad(b, [np.empty(3, F32)] * 2, np.empty((2, 3), F32)),
        timeout=10),
    "all_to_all_single dtype": lambda b: fc.all_to_all_single(
        np.ones(4, F32), b, out=np.empty(4, _bad(b, F32, np.float64)), timeout=10),
    "all_to_all_single recv_splits size": lambda b: fc.all_to_all_single(
        np.ones(4, F32), b, send_splits=[2, 2], recv_splits=[2, 2],
        out=np.empty(_bad(b, 4, 5), F32), timeout=10),
    "all_to_all_single_async read-only": lambda b: fc.all_to_all_single_async(
        np.ones(4, F32), b, out=_bad(b, np.empty(4, F32), _read_only(4)), timeout=10).wait(),
    "scatter root": lambda b: fc.scatter(
        np.ones(4, F32) if b.rank == 1 else None, b, root=1,
        out=np.empty(2, _bad(b, F32, np.float64)), timeout=10),
    "scatter non-root read-only": lambda b: fc.scatter(
        np.ones(4, F32) if b.rank == 0 else None, b,
        out=_bad(b, np.empty(2, F32), _read_only(2)), timeout=10),
    "broadcast(None) read-only": lambda b: fc.broadcast(
        np.ones(3, F32) if b.rank == 0 else None, b,
        out=_bad(b, None, _read_only(3)), timeout=10),
}


def early(b) -> dict:
    """Every EARLY case: each rank's error (type, text), then the next call's sum."""
    got = {}
    for name, call in EARLY.items():
        try:
            call(b)
            what = ("returned", "")
        except Exception as exc:  # what each rank raised is the test
            what = (type(exc).__name__, str(exc))
        got[name] = (*what, fc.allreduce(np.ones(1), b, timeout=10).tolist())
    return got


def late(b, bad: int) -> dict:
    """broadcast(None) and scatter on 4 ranks, rank ``bad``'s out= of another dtype than the
    root's (known only from the root): what each rank did, and the next call's sum."""
    got = {}
    for name in ("broadcast", "scatter"):
        x = np.arange(8, dtype=F32) if b.rank == 0 else None
        out = None if b.rank != bad else np.empty(8 if name == "broadcast" else 2, np.float64)
        try:
            r = getattr(fc, name)(x, b, out=out, timeout=10)
            what = ("returned", np.asarray(r).tolist())
        except Exception as exc:  # what each rank raised is the test
            what = (type(exc).__name__, str(exc))
        got[name] = (*what, fc.allreduce(np.ones(1), b, timeout=10).tolist())
    return got
