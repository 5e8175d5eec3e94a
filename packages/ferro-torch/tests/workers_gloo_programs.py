"""Rank programs of test_gloo_programs.py: ``python workers_gloo_programs.py SCENARIO`` in each
of 2 ranks under ferrorun. Programs that complete at once on gloo; each rank reports what it
got and how long each part took (a part that hangs meets the group's 10 s deadline)."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from workers import init, report

#: 60 KiB messages: four of them fill a 256 KiB point-to-point ring
ELEMS = 15360
N = 8


def timed(fn) -> dict:
    start = time.monotonic()
    try:
        got = fn()
    except Exception as exc:  # (the test reads what each rank got)
        got = f"{type(exc).__name__}: {str(exc)[:300]}"
    return {"got": got, "seconds": time.monotonic() - start}


def isend_flood(me: int, peer: int):
    """N isends to the peer, then N irecvs, then the waits."""
    sends = [dist.isend(torch.full((ELEMS,), float(me * 100 + i)), peer) for i in range(N)]
    bufs = [torch.zeros(ELEMS) for _ in range(N)]
    recvs = [dist.irecv(b, peer) for b in bufs]
    for w in sends + recvs:
        w.wait()
    return all(bool((b == peer * 100 + i).all()) for i, b in enumerate(bufs))


def batch_flood(me: int, peer: int):
    """batch_isend_irecv with the N sends listed before the N receives (pipeline habits)."""
    bufs = [torch.zeros(ELEMS) for _ in range(N)]
    ops = ([dist.P2POp(dist.isend, torch.full((ELEMS,), float(me * 100 + i)), peer)
            for i in range(N)] + [dist.P2POp(dist.irecv, b, peer) for b in bufs])
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return all(bool((b == peer * 100 + i).all()) for i, b in enumerate(bufs))


def small_sends(me: int, peer: int):
    """Small synchronous messages both ways still arrive in order."""
    got = []
    for i in range(50):
        x = torch.full((1024,), float(i))
        if me == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
        got.append(x[0].item() == i)
    return all(got)


def scenario_flood() -> None:
    kind = init(timeout=10)
    me = dist.get_rank()
    out = {"isend": timed(lambda: isend_flood(me, 1 - me)),
           "batch": timed(lambda: batch_flood(me, 1 - me)),
           "small": timed(lambda: small_sends(me, 1 - me))}
    report(rank=me, kind=kind, **out)


def async_then_send(me: int):
    """Rank 0: an async all_reduce, a send to rank 1, then the wait; rank 1 receives first,
    then joins the all_reduce."""
    t, x = torch.full((2,), float(me + 1)), torch.zeros(3)
    if me == 0:
        w = dist.all_reduce(t, async_op=True)
        dist.send(torch.arange(3.0), 1)
        w.wait()
    else:
        dist.recv(x, 0)
        dist.all_reduce(t)
    return t.tolist() + (x.tolist() if me == 1 else [])


def async_then_batch(me: int):
    """The same with batch_isend_irecv (both ranks: an async all_reduce first on rank 0)."""
    t, x = torch.full((2,), float(me + 1)), torch.zeros(3)
    if me == 0:
        w = dist.all_reduce(t, async_op=True)
        for r in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.arange(3.0), 1)]):
            r.wait()
        w.get_future().wait()
    else:
        for r in dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, 0)]):
            r.wait()
        dist.all_reduce(t)
    return t.tolist() + (x.tolist() if me == 1 else [])


def wait_timeout(me: int):
    """Rank 1 comes late: rank 0's wait(timeout=0.5 s) raises within it, and a later wait()
    completes the call. Rank 1 calls only once rank 0's wait has raised (a flag file in the
    run's result directory, not a sleep: a stalled rank 0 may start its wait late)."""
    flag = os.path.join(os.environ["TEST_RESULT_DIR"], "flag-rank0-waited")
    t = torch.full((2,), float(me + 1))
    if me == 1:
        end = time.monotonic() + 30
        while not os.path.exists(flag) and time.monotonic() < end:
            time.sleep(0.05)
        dist.all_reduce(t)
        return t.tolist()
    w = dist.all_reduce(t, async_op=True)
    start = time.monotonic()
    try:
        w.wait(timeout=__import__("datetime").timedelta(seconds=0.5))
        raised = None
    except Exception as exc:  # (the test reads it)
        raised = f"{type(exc).__name__}: {str(exc)[:200]}"
    waited = time.monotonic() - start
    open(flag, "w").close()
    w.wait()
    return {"raised": raised, "waited": waited, "value": t.tolist()}


def scenario_async_p2p() -> None:
    kind = init(timeout=10)
    me = dist.get_rank()
    out = {"send": timed(lambda: async_then_send(me)),
           "batch": timed(lambda: async_then_batch(me)),
           "wait_timeout": timed(lambda: wait_timeout(me))}
    dist.barrier()
    report(rank=me, kind=kind, **out)


if __name__ == "__main__":
    globals()["scenario_" + sys.argv[1]]()
