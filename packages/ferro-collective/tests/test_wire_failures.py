"""Compressed calls (``wire=``) that fail: a rank that gives up on one ends its group, as the
exact calls do; a bad argument on one rank is refused on every rank; each rank's error names
the user's call, not the exact collectives it is made of; a failed call leaves its error
feedback as it was."""

import time

import numpy as np
import pytest

import ferro_collective as fc
from ferro_backend.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

CALLS = {
    "allreduce": lambda x, b, **kw: fc.allreduce_async(x, b, **kw),
    "reduce_scatter": lambda x, b, **kw: fc.reduce_scatter_async(x, b, **kw),
    "all_gather": lambda x, b, **kw: fc.all_gather_async(x, b, **kw),
}


def outcome(fn):
    """``fn()``'s error and how long it took (None: it returned)."""
    t = time.monotonic()
    try:
        fn()
        error = None
    except Exception as exc:
        error = exc
    return error, time.monotonic() - t


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_a_background_call_a_rank_gave_up_on_ends_the_group(name, wire):
    """Rank 0 gives up on ``*_async(..., wire=)`` (its deadline passed while rank 1 was late):
    it aborts the group, so the late rank 1 raises PeerAbortedError at once (not its own
    deadline later), and the group's later calls raise at once too."""
    def body(b):
        if b.rank:
            time.sleep(2.0)
        x = np.full(600 if name != "reduce_scatter" else 600 * 2, b.rank + 1.0, np.float32)
        first = outcome(lambda: CALLS[name](x, b, wire=wire,
                                            timeout=20 if b.rank else 1.0).wait(60))
        if not b.rank:
            time.sleep(1.5)  # (the late rank has met the call)
        after = outcome(lambda: fc.allreduce(np.ones(3), b, timeout=20))
        return first, after

    (first0, after0), (first1, after1) = run_ranks(body, 2, timeout=60)
    assert isinstance(first0[0], fc.CollectiveTimeoutError), first0
    assert isinstance(first1[0], fc.PeerAbortedError), first1
    assert first1[1] < 5, first1  # at once, not after its own deadline of 20 s
    assert "rank 0" in str(first1[0]) and "gave up" in str(first1[0])
    for error, took in (after0, after1):
        assert isinstance(error, (fc.PeerAbortedError, fc.PeerClosedError)), error
        assert took < 5
