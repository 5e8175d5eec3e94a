"""An op passed where a rooted collective's root goes (``reduce(x, b, ReduceOp.MAX)``): the
rank that does it raises at once (reduce: the TypeError saying to pass ``op=``; gather,
broadcast, scatter: InvalidRankError), the same in the ``*_async`` forms, and its peers learn of
it in the same call (CollectiveMismatchError naming the rank) instead of waiting for their
deadline; the next call on every rank is the next call."""

import time

import numpy as np
import pytest

import ferro_collective as fc
from ferro_backend import CollectiveMismatchError, InvalidRankError
from ferro_backend.testing import run_processes, run_ranks
from ferro_collective import ReduceOp

CALLS = ["reduce", "gather", "broadcast", "scatter"]
WANT = {"reduce": TypeError, "gather": InvalidRankError, "broadcast": InvalidRankError,
        "scatter": InvalidRankError}


def _call(name: str, asynchronous: bool, x, b, root, timeout=None):
    fn = getattr(fc, name + ("_async" if asynchronous else ""))
    kw = {} if timeout is None else {"timeout": timeout}
    if name == "reduce":
        got = fn(x, b, root, ReduceOp.MAX, **kw) if not isinstance(root, ReduceOp) else \
            fn(x, b, root, **kw)
    else:
        got = fn(x, b, root, **kw)
    return got.wait(30) if asynchronous else got


def misuse(b, name: str, asynchronous: bool):
    """Rank 0 passes ReduceOp.MAX where the root goes; the others call properly."""
    x = np.arange(2.0) + b.rank
    t = time.monotonic()
    if b.rank == 0:
        try:
            _call(name, asynchronous, x, b, ReduceOp.MAX)
            mine = "no error"
        except Exception as exc:
            mine = (type(exc).__name__, str(exc))
        time.sleep(3)  # stays alive: the peers must not learn of it by rank 0's close
    else:
        try:
            _call(name, asynchronous, x, b, 0, timeout=20)
            mine = "no error"
        except Exception as exc:
            mine = (type(exc).__name__, str(exc), time.monotonic() - t)
    after = fc.allreduce(np.ones(1), b, timeout=20)  # the order of calls intact
    return mine, float(after[0])


def _check(results, name: str, asynchronous: bool, n: int):
    (err0, after0), *others = results
    want = WANT[name]
    assert err0[0] == want.__name__, err0
    if name == "reduce":
        assert "op=ReduceOp.MAX" in err0[1] or "op=<ReduceOp.MAX" in err0[1], err0
        assert err0[1].startswith(name + ("_async" if asynchronous else "")), err0
    for err, _ in others:
        assert err[0] == CollectiveMismatchError.__name__, err
        assert "rank 0" in err[1] and want.__name__ in err[1], err
        # far below the 20 s deadline (room for a loaded host's stalls)
        assert err[2] < 10, f"rank learnt of rank 0's refusal after {err[2]:.1f} s"
    assert [after0] + [a for _, a in others] == [float(n)] * n


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("name", CALLS)
def test_op_where_root_goes_threads(name, asynchronous):
    _check(run_ranks(lambda b: misuse(b, name, asynchronous), 3, timeout=60,
                     backend_timeout=20), name, asynchronous, 3)


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_reduce_op_where_root_goes_processes(transport, asynchronous):
    _check(run_processes(misuse, 2, "reduce", asynchronous, transport=transport, timeout=90,
                         backend_timeout=20), "reduce", asynchronous, 2)


def test_sync_and_async_raise_alike():
    def fn(b):
        got = []
        for name in CALLS:
            for asynchronous in (False, True):
                try:
                    _call(name, asynchronous, np.ones(2), b, ReduceOp.MAX)
                except Exception as exc:
                    got.append((name, type(exc).__name__,
                                str(exc).replace(name + "_async", name)))
        return got

    for got in run_ranks(fn, 2, timeout=60, backend_timeout=10):
        sync, asyn = got[0::2], got[1::2]
        assert sync == asyn and len(sync) == len(CALLS)
