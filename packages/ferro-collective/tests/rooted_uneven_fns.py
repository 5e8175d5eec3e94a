"""Module-level rank functions for the real-process runs of the rooted and uneven collectives
(TCP, the same-host engine, MPI): spawned processes and mpirun scripts import them."""

import numpy as np

import ferro_collective as fc
from ferro_collective import ReduceOp


def suite(b) -> list[str]:
    """Every new collective, interleaved with the old ones (the engine's fast path on a
    ShmBackend) and with async calls, checked against what it must return; the failures."""
    n, r = b.world_size, b.rank
    bad: list[str] = []

    def check(label, ok):
        if not ok:
            bad.append(label)

    for size in (5, 70_000):  # tree, and the ring past the small-message size
        x = np.arange(size, dtype=np.float64) + r
        keep = x.copy()
        res = fc.reduce(x, b, root=n - 1)
        want = n * np.arange(size) + n * (n - 1) / 2
        check(f"reduce {size}", res is None if r != n - 1 else np.array_equal(res, want))
        check(f"reduce kept its input {size}", x.tobytes() == keep.tobytes())
        ar = fc.allreduce(x, b)
        check(f"allreduce between {size}", np.array_equal(ar, want))
    for rows in (2, 40_000):  # tree / star (and the engine's slots / cross-memory reads)
        full = np.arange(rows * n * 2, dtype=np.int32).reshape(rows * n, 2)
        g = fc.gather(full[r * rows:(r + 1) * rows], b, root=1)
        check(f"gather {rows}", g is None if r != 1 else np.array_equal(g, full))
        s = fc.scatter(full if r == n - 1 else None, b, root=n - 1)
        check(f"scatter {rows}", np.array_equal(s, full[r * rows:(r + 1) * rows]))
        check(f"broadcast between {rows}",
              fc.broadcast(np.array([r, 7]), b, root=0).tolist() == [0, 7])
    agv = fc.all_gather_v(np.full((r, 3), r, np.int16), b)
    check("all_gather_v", [a.shape for a in agv] == [(k, 3) for k in range(n)]
          and all((a == k).all() for k, a in enumerate(agv)))
    a2a = fc.all_to_all([np.full(d + r, 100 * r + d) for d in range(n)], b)
    check("all_to_all", [a.tolist() for a in a2a] == [[100 * s + r] * (r + s) for s in range(n)])
    single = fc.all_to_all_single(np.arange(2 * n) + 100 * r, b)
    check("all_to_all_single", single.tolist() == [100 * s + 2 * r + k for s in range(n)
                                                   for k in range(2)])
    splits = [s + 1 for s in range(n)]  # rank r sends s + 1 rows to rank s
    uneven = fc.all_to_all_single(np.full(sum(splits), r, np.float32), b, send_splits=splits,
                                  recv_splits=[r + 1] * n)
    check("all_to_all_single uneven", uneven.tolist() == [float(s) for s in range(n)
                                                          for _ in range(r + 1)])
    # large (>= 256 KiB a rank: read from the peers' memory on the engine), zero-size pieces
    rows = [[0 if (s + d) % 3 == 0 else 30_000 + 1000 * s + d for d in range(n)]
            for s in range(n)]
    pieces = [np.full((rows[r][d], 2), 100 * r + d, np.float32) for d in range(n)]
    want = [np.full((rows[s][r], 2), 100 * s + r, np.float32) for s in range(n)]
    big = fc.all_to_all_single(np.concatenate(pieces), b, send_splits=rows[r],
                               recv_splits=[rows[s][r] for s in range(n)])
    check("all_to_all_single large uneven", big.tobytes() == np.concatenate(want).tobytes())
    check("all_to_all large uneven", [a.tobytes() for a in fc.all_to_all(pieces, b)]
          == [w.tobytes() for w in want])
    empty = fc.scatter(np.empty((0, 3), np.int8) if r == 2 % n else None, b, root=2 % n)
    check("scatter of zero rows", empty.shape == (0, 3) and empty.dtype == np.int8)
    check("broadcast_object", fc.broadcast_object({"cfg": [1, r]} if r == 1 else None, b,
                                                  root=1) == {"cfg": [1, 1]})
    check("all_gather_object", fc.all_gather_object(("r", r), b) == [("r", s) for s in range(n)])
    check("BOR", fc.allreduce(np.array([1 << r], np.int64), b, ReduceOp.BOR).tolist()
          == [(1 << n) - 1])
    bx = fc.reduce(np.array([r % 2 == 1, True]), b, root=0, op=ReduceOp.BXOR)
    check("BXOR bool", r != 0 or bx.tolist() == [n // 2 % 2 == 1, n % 2 == 1])
    # async calls of both kinds queue in issue order with the sync ones
    works = [fc.allreduce_async(np.full(4, float(r)), b),
             fc.gather_async(np.array(r), b, root=0),
             fc.all_to_all_async([np.array([r])] * n, b),
             fc.scatter_async(np.arange(n) if r == 0 else None, b),
             fc.reduce_async(np.ones(2), b, root=n - 1),
             fc.all_gather_v_async(np.arange(r), b),
             fc.all_to_all_single_async(np.arange(n) + 10 * r, b)]
    mid = fc.all_gather_v(np.array([r, r]), b)
    last = fc.allreduce(np.ones(3), b)
    got = [w.wait(60) for w in works]
    check("async allreduce", got[0].tolist() == [n * (n - 1) / 2] * 4)
    check("async gather", got[1] is None if r else got[1].tolist() == list(range(n)))
    check("async all_to_all", [a.tolist() for a in got[2]] == [[s] for s in range(n)])
    check("async scatter", got[3].tolist() == [r])
    check("async reduce", got[4] is None if r != n - 1 else got[4].tolist() == [n, n])
    check("async all_gather_v", [a.tolist() for a in got[5]] == [list(range(s))
                                                                  for s in range(n)])
    check("async all_to_all_single", got[6].tolist() == [10 * s + r for s in range(n)])
    check("sync between", [a.tolist() for a in mid] == [[s, s] for s in range(n)]
          and last.tolist() == [n] * 3)
    # a mismatch fails every rank, and the group stays usable
    try:
        if r == 0:
            fc.gather(np.zeros(2), b, timeout=20)
        else:
            fc.scatter(None, b, timeout=20)
        bad.append("no mismatch error")
    except fc.CollectiveMismatchError as exc:
        check(f"mismatch message: {exc}", "gather(float64[2], root=0)" in str(exc)
              and "scatter(root=0)" in str(exc))
    check("usable after the mismatch", fc.allreduce(np.ones(2), b).tolist() == [n, n])
    fc.barrier(b)
    return bad
