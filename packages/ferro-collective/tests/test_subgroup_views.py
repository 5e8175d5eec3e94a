"""Collectives on two SubBackends of the same members made one after the other (torch's
``new_group`` twice): two groups, whose calls never pair with the other's, whatever the order in
which each rank interleaves them; and a subgroup made after one that timed out works."""

import time

import numpy as np
import pytest

import ferro_collective as fc
from ferro_backend import SubBackend
from ferro_backend.testing import run_processes, run_ranks


def two_views(b):
    g1, g2 = SubBackend(b, [0, 1]), SubBackend(b, [0, 1])
    x1 = np.full(4, 1 + b.rank, np.float32)  # g1: 1 + 2
    x2 = np.full(4, 100 * (1 + b.rank), np.float32)  # g2: 100 + 200
    if b.rank == 0:
        w1 = fc.allreduce_async(x1, g1, timeout=10)
        w2 = fc.allreduce_async(x2, g2, timeout=10)
    else:
        w2 = fc.allreduce_async(x2, g2, timeout=10)
        w1 = fc.allreduce_async(x1, g1, timeout=10)
    return float(w1.wait(20)[0]), float(w2.wait(20)[0])


def test_two_views_threads():
    assert run_ranks(two_views, 2, timeout=60, backend_timeout=10) == [(3.0, 300.0)] * 2


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_two_views_processes(transport):
    assert run_processes(two_views, 2, transport=transport, timeout=90,
                         backend_timeout=20) == [(3.0, 300.0)] * 2


def test_a_subgroup_made_after_one_timed_out_works():
    def fn(b):
        g = SubBackend(b, [0, 1])
        if b.rank == 1:
            time.sleep(1.5)  # rank 0 gives up on the subgroup first
        try:
            fc.allreduce(np.ones(3), g, timeout=0.5)
        except Exception as exc:
            first = type(exc).__name__
        time.sleep(1.5)
        again = SubBackend(b, [0, 1])
        return first, fc.allreduce(np.ones(3), again, timeout=10).tolist()

    got = run_ranks(fn, 2, timeout=60, backend_timeout=10)
    assert [r[1] for r in got] == [[2.0] * 3] * 2
    assert got[0][0] == "CollectiveTimeoutError"
