"""A rank that refuses a collective (a wrong argument) and then closes its backend at once, as a
script ending on the error does, still tells its peers why: they raise CollectiveMismatchError
naming the rank and its reason, on TCP as on the simulated transport and shm (found by a bug
hunt: on TCP the refusal, published on a background thread, was outrun by close()'s goodbye and
the peers got "PeerClosedError: peer rank 0 is gone (it closed its backend)"). close() waits
a short while for the refusal (ferro_backend.Backend.publish_before_close); the refusing rank
still raises its own error at once."""

import os
import time

import numpy as np
import pytest

import ferro_collective as fc
from ferro_backend.testing import run_processes, run_ranks


def _refuse_then_close(b, flags, bad):
    """The last rank waits until every peer is about to call, then makes a bad call and
    closes right after raising; the peers make the call."""
    x = np.arange(4 * b.world_size, dtype=np.float32)
    if b.rank != b.world_size - 1:
        with open(os.path.join(flags, str(b.rank)), "w"):
            pass
        try:
            fc.allreduce(x, b, timeout=20)
            return "returned"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    end = time.monotonic() + 30
    while len(os.listdir(flags)) < b.world_size - 1 and time.monotonic() < end:
        time.sleep(0.005)
    time.sleep(0.05)  # (the peers are in the call)
    kw = {"out": np.empty(3, np.float32)} if bad == "out" else {}
    try:
        fc.allreduce(x.astype(object) if bad == "object" else x, b, timeout=20, **kw)
        said = "returned"
    except (TypeError, ValueError) as exc:
        said = type(exc).__name__
    start = time.monotonic()
    b.close()
    return said, time.monotonic() - start


@pytest.mark.parametrize("bad, reason", [("object", "TypeError: dtype object cannot be sent"),
                                         ("out", "SizeMismatchError: out is float32[3]")])
@pytest.mark.parametrize("transport", ["tcp", "shm", "threads"])
def test_a_refusal_reaches_the_peers_when_the_refusing_rank_closes_at_once(
        tmp_path, transport, bad, reason):
    for i in range(3):
        flags = tmp_path / f"{transport}-{bad}-{i}"
        flags.mkdir()
        if transport == "threads":
            res = run_ranks(lambda b, f=str(flags): _refuse_then_close(b, f, bad), 3, timeout=60)
        else:
            res = run_processes(_refuse_then_close, 3, str(flags), bad, transport=transport,
                                timeout=90)
        said, closing = res[2]
        assert said == ("TypeError" if bad == "object" else "SizeMismatchError"), res
        assert closing < 10, res  # (bounded: the refusal went out, nothing waited longer)
        for peer in res[:2]:
            assert peer.startswith("CollectiveMismatchError") and \
                f"rank 2 refused the call ({reason}" in peer, (transport, i, res)
