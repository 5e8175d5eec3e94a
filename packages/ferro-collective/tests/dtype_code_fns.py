"""Module-level rank functions for the real-process runs of the header's dtype codes (TCP, the
same-host engine): spawned processes import them."""

import ml_dtypes
import numpy as np

import ferro_collective as fc
from ferro_backend import CollectiveMismatchError

STRUCT = np.dtype([("a", "<i4"), ("b", "<f4")])
#: dtypes a non-root that passes None must get back whole from the root's header
REBUILT = (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.bfloat16, ml_dtypes.int4,
           "M8[10ns]", ">f4")


def suite(b) -> list[str]:
    """Mismatched dtypes (of one size, or that numpy's ``dtype.str`` cannot tell apart or parse)
    raise on every rank, broadcast(None) gets the root's dtype, a dtype the header cannot
    rebuild raises on every rank; after each, the next call agrees. The failures."""
    r, n = b.rank, b.world_size
    bad: list[str] = []

    def mismatch(label, fn, *names):
        try:
            fn()
            bad.append(f"{label}: no error")
        except CollectiveMismatchError as exc:
            if not all(name in str(exc) for name in names):
                bad.append(f"{label}: {exc}")
        except Exception as exc:
            bad.append(f"{label}: {type(exc).__name__}: {exc}")
        if fc.allreduce(np.ones(2), b, timeout=10).tolist() != [n, n]:
            bad.append(f"{label}: the next call")

    x = np.ones(3, ml_dtypes.float8_e4m3fn) if r == 0 else np.ones(3, ml_dtypes.int4)
    for name, fn in [("all_gather", lambda: fc.all_gather(x, b, timeout=10)),
                     ("broadcast", lambda: fc.broadcast(x, b, 0, timeout=10)),
                     ("gather", lambda: fc.gather(x, b, 0, timeout=10)),
                     ("all_gather_v", lambda: fc.all_gather_v(x, b, timeout=10))]:
        mismatch(name, fn, "(float8_e4m3fn[", "(int4[")  # (the door's messages too)
    z = np.arange(4.0).astype(">f4" if r == 0 else "<f4")  # (byte order alone differs)
    for name, fn in [("all_gather >f4", lambda: fc.all_gather(z, b, timeout=10)),
                     ("broadcast >f4", lambda: fc.broadcast(z, b, 0, timeout=10)),
                     ("gather >f4", lambda: fc.gather(z, b, 0, timeout=10))]:
        mismatch(name, fn, "(>f4[4]", "(float32[4]")
    y = np.zeros(2 + r, ml_dtypes.float8_e5m2)
    mismatch("e5m2 shapes", lambda: fc.all_gather(y, b, timeout=10), "float8_e5m2[2]",
             "float8_e5m2[3]")
    s = np.zeros(2, STRUCT) if r == 0 else np.zeros(2, [("c", "<i4"), ("d", "<f4")])
    mismatch("structured", lambda: fc.all_gather(s, b, timeout=10))
    for dt in REBUILT:
        want = (np.arange(4) % 2).astype(dt)
        got = fc.broadcast(want if r == 0 else None, b, 0, timeout=10)
        if got.dtype != want.dtype or got.tobytes() != want.tobytes():
            bad.append(f"broadcast(None) {dt}: {got.dtype}")
    for dt in (STRUCT, "M8[1000ns]"):
        mismatch(f"broadcast(None) {dt}",
                 lambda dt=dt: fc.broadcast(np.zeros(2, dt) if r == 0 else None, b, 0, timeout=10),
                 "None")
    return bad
