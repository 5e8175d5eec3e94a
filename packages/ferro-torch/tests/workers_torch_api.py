"""Rank programs for test_torch_api.py: what torch builds on a group's CPU backend, on "ferro"
(``python workers_torch_api.py SCENARIO`` in each rank, under ferrorun). Each rank writes its
results to ``$TEST_RESULT_DIR/rank<r>.json``; a failed check raises (exit 1)."""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

torch.set_num_threads(1)

import ferro_torch  # noqa: E402 - registers "ferro"
from workers import init, report  # noqa: E402

CPU = torch.device("cpu")


def expect_error(fn, *words: str, kind: type = RuntimeError) -> tuple[str, float]:
    """Run ``fn``; it must raise ``kind`` with a message holding every one of ``words``.
    Returns the message and the seconds it took."""
    start = time.monotonic()
    try:
        fn()
    except kind as exc:
        msg = str(exc)
        for w in words:
            assert w in msg, f"{w!r} not in {msg!r}"
        return msg, time.monotonic() - start
    raise AssertionError(f"no error; expected one naming {words}")


def check_device_backend(n: int, me: int, kind: str) -> None:
    pg = dist.group.WORLD
    assert pg._device_types == [CPU], pg._device_types
    if kind == "python":
        assert pg._get_backend(CPU) is pg and pg._get_backend("cpu").supports_coalescing
        expect_error(lambda: pg._get_backend(torch.device("cuda")),
                     "No backend type associated with device type cuda")
    else:  # torch's group around the compiled backend, torch's CPU backend
        backend = pg._get_backend(CPU)
        assert type(backend).__name__ == "FerroBackend" and backend.supports_coalescing, backend
        assert isinstance(backend.python_group, ferro_torch.ProcessGroupFerro), backend
        expect_error(lambda: pg._get_backend(torch.device("cuda")), "cuda")
    # all_gather_coalesced, async: torch returns the Work's future
    ins = [torch.full((k + 1, 2), float(me)) for k in range(3)]
    outs = [[torch.empty(k + 1, 2) for k in range(3)] for _ in range(n)]
    dist.all_gather_coalesced(outs, ins, async_op=True).wait()
    for r in range(n):
        for k in range(3):
            assert torch.equal(outs[r][k], torch.full((k + 1, 2), float(r))), (r, k)
    ts = [torch.ones(2) * me, torch.ones(3)]
    dist.all_reduce_coalesced(ts)
    assert torch.equal(ts[0], torch.full((2,), float(sum(range(n))))) and ts[1].sum() == 3 * n
    # torch's coalescing manager with a device: collectives and p2p in one Work
    a, b = torch.ones(4), torch.ones(4) * 2
    got = torch.empty(3)
    with dist._coalescing_manager(device=CPU, async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    assert torch.equal(a, torch.full((4,), float(n))) and torch.equal(b, torch.full((4,), 2. * n))
    right, left = (me + 1) % n, (me - 1) % n
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, left, tag=7),
                                    dist.P2POp(dist.isend, torch.full((3,), float(me)), right,
                                               tag=7)])
    for w in works:
        w.wait()
    assert torch.equal(got, torch.full((3,), float(left)))
    # get_future: the output tensors
    t = torch.ones(5)
    fut = dist.all_reduce(t, async_op=True).get_future()
    assert torch.equal(fut.wait()[0], torch.full((5,), float(n)))
    # object collectives (pickles over the group's CPU backend)
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": me, "tag": "x" * me})
    assert objs == [{"rank": r, "tag": "x" * r} for r in range(n)], objs
    lst = [("from", 0)] if me == 0 else [None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == [("from", 0)]
    # new_subgroups_by_enumeration: ferro subgroups of the world's transport
    sub, _ = dist.new_subgroups_by_enumeration([[0, 1], list(range(2, n))])
    # a subgroup of several ranks has an engine of its own (and the compiled backend); a group
    # of one rank has nothing to communicate, and the Python backend
    assert ferro_torch.backend_kind(sub) == (kind if sub.size() > 1 else "python"), sub
    assert isinstance(ferro_torch.ferro_backend(sub), __import__("ferro_backend").SubBackend)
    s = torch.ones(2)
    dist.all_reduce(s, group=sub)
    assert s[0].item() == (2 if me < 2 else n - 2)


def check_synchronous_calls_compiled(n: int, me: int) -> dict:
    """The compiled backend: async_op=False runs in the caller's thread and returns a completed
    Work; behind a pending async call it waits its turn (the door's tickets); non-contiguous
    tensors are staged and written back; its errors raise from the call."""
    sub = dist.new_group(list(range(n)))
    assert ferro_torch.backend_kind(sub) == "compiled"
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    t = torch.full((6,), float(me))
    work = sub.allreduce([t], opts)
    total = float(sum(range(n)))
    assert work.is_completed() and work.wait(), work  # (torch 2.9 cannot return exception())
    assert work.get_future().value()[0] is t and torch.equal(t, torch.full((6,), total)), t
    grid = torch.arange(16.0).reshape(4, 4) * (me + 1)
    dist.all_reduce(grid.t()[1], group=sub)
    assert torch.equal(grid[:, 1], torch.arange(1.0, 16.0, 4) * sum(range(1, n + 1))), grid
    ints = torch.arange(5, dtype=torch.int64) * (me + 1)
    dist.all_reduce(ints, op=dist.ReduceOp.MAX, group=sub)
    assert torch.equal(ints, torch.arange(5) * n), ints
    avg = torch.full((4,), float(me))
    dist.all_reduce(avg, op=dist.ReduceOp.AVG, group=sub)
    assert torch.equal(avg, torch.full((4,), total / n)), avg
    leaf = torch.full((3,), float(me), requires_grad=True)
    dist.all_reduce(leaf, group=sub)
    assert torch.equal(leaf.detach(), torch.full((3,), total)), leaf
    a, b = torch.ones(1 << 16), torch.full((3,), float(me))
    pending = [dist.all_reduce(a, async_op=True, group=sub) for _ in range(3)]
    dist.all_reduce(b, group=sub)  # behind the pending ones
    assert torch.equal(b, torch.full((3,), total)), b
    for w in pending:
        w.wait()
    assert torch.equal(a, torch.full((1 << 16,), float(n ** 3))), a[:4]
    flags = torch.ones(3, dtype=torch.bool)
    expect_error(lambda: dist.all_reduce(flags, op=dist.ReduceOp.AVG, group=sub),
                 "ReduceOp.AVG is not defined on bool tensors", kind=TypeError)
    inline = sub._get_backend(CPU).inline_async
    dist.destroy_process_group(sub)
    return {"inline_async": inline, "cores": len(os.sched_getaffinity(0))}


def check_synchronous_calls(n: int, me: int) -> dict:
    """async_op=False with nothing pending runs in the caller's thread and returns a completed
    Work (no worker thread for a group used only so); behind a pending async call it waits its
    turn; its errors raise from the call."""
    sub = dist.new_group(list(range(n)))
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    t = torch.full((6,), float(me))
    work = sub.allreduce([t], opts)  # torch's group API, as a framework calls it
    total = float(sum(range(n)))
    assert work.is_completed() and work.wait(), work  # (torch 2.9 cannot return exception())
    assert work.get_future().value()[0] is t and torch.equal(t, torch.full((6,), total)), t
    grid = torch.arange(16.0).reshape(4, 4) * (me + 1)
    dist.all_reduce(grid.t()[1], group=sub)  # a non-contiguous row: staged and written back
    assert torch.equal(grid[:, 1], torch.arange(1.0, 16.0, 4) * sum(range(1, n + 1))), grid
    # one contiguous tensor of a plain dtype: the one-frame path (not the general one), any
    # op, a tensor that requires grad included; behind a pending call: the general path
    general = []
    whole = sub._allreduce
    sub._allreduce = lambda *args: general.append(args) or whole(*args)
    ints = torch.arange(5, dtype=torch.int64) * (me + 1)
    dist.all_reduce(ints, op=dist.ReduceOp.MAX, group=sub)
    assert torch.equal(ints, torch.arange(5) * n), ints
    avg = torch.full((4,), float(me))
    dist.all_reduce(avg, op=dist.ReduceOp.AVG, group=sub)
    assert torch.equal(avg, torch.full((4,), total / n)), avg
    leaf = torch.full((3,), float(me), requires_grad=True)
    dist.all_reduce(leaf, group=sub)
    assert torch.equal(leaf.detach(), torch.full((3,), total)), leaf
    assert not general, general
    dist.barrier(group=sub)
    mine = f"ferro-torch-{sub._name}"  # the name of this group's worker thread, once made
    workers = [th.name for th in threading.enumerate() if th.name == mine]
    a, b = torch.ones(1 << 16), torch.full((3,), float(me))
    pending = dist.all_reduce(a, async_op=True, group=sub)
    dist.all_reduce(b, group=sub)  # behind the pending one, on the group's worker
    assert torch.equal(b, torch.full((3,), total)), b
    # the asynchronous call goes the general way; the one behind it too while it is pending
    assert general and general[0][1].asyncOp and len(general) <= 2, general
    issued_done = pending.is_completed()
    pending.wait()
    assert torch.equal(a, torch.full((1 << 16,), float(n))), a[:4]
    made = mine in [th.name for th in threading.enumerate()]
    # where the ranks fill the cores (FERRO_BACKGROUND=auto) an async call runs at once in the
    # issuing thread too, while its group is the process's only one (not here: the world is
    # open too); else on the group's worker, which it makes
    from ferro_torch._group_core import _OPEN

    inline = sub._inline_async and len(_OPEN) == 1
    assert made != inline and (issued_done or not inline), (made, issued_done, len(_OPEN))
    flags = torch.ones(3, dtype=torch.bool)
    expect_error(lambda: dist.all_reduce(flags, op=dist.ReduceOp.AVG, group=sub),
                 "ReduceOp.AVG is not defined on bool tensors", kind=TypeError)
    dist.destroy_process_group(sub)
    return {"workers_before_async": workers, "inline_async": sub._inline_async,
            "cores": len(os.sched_getaffinity(0))}


def check_sparse(n: int, me: int) -> None:
    def dense(r: int) -> torch.Tensor:
        x = torch.zeros(n + 1, 3)
        x[r] = r + 1.0
        x[n] = 1.0  # an index every rank holds: summed
        return x

    s = dense(me).to_sparse()
    dist.all_reduce(s)
    assert s.is_sparse and s.is_coalesced()
    want = sum(dense(r) for r in range(n))
    assert torch.equal(s.to_dense(), want), s.to_dense()
    expect_error(lambda: dist.all_reduce(dense(me).to_sparse(), op=dist.ReduceOp.MAX),
                 "ReduceOp.SUM only", kind=ValueError)


def check_monitored_barrier(n: int, me: int) -> dict:
    out = {}
    ferro_torch.monitored_barrier(timeout=timedelta(seconds=20))
    ferro_torch.monitored_barrier(timeout=timedelta(seconds=20), wait_all_ranks=True)
    dist.barrier()
    if me == 0:  # nobody else comes: all of them named, each given the whole timeout
        missing = ", ".join(str(r) for r in range(1, n))
        out["all"] = expect_error(
            lambda: ferro_torch.monitored_barrier(timeout=timedelta(seconds=0.5),
                                                  wait_all_ranks=True),
            f"Ranks {missing} failed to pass monitoredBarrier in 500 ms")
    dist.barrier()
    late = n - 1  # every rank but the last comes: rank 0 names it, the others hear of it
    if me == 0:
        out["one"] = expect_error(
            lambda: ferro_torch.monitored_barrier(timeout=timedelta(seconds=0.5)),
            f"Rank {late} failed to pass monitoredBarrier in 500 ms")
    elif me != late:
        out["one"] = expect_error(
            lambda: ferro_torch.monitored_barrier(timeout=timedelta(seconds=2)),
            f"Rank {me} successfully reached monitoredBarrier, but received errors while "
            "waiting for send/recv from rank 0")
    dist.barrier()
    if me == 0:
        out["zero"] = expect_error(
            lambda: dist.group.WORLD.monitored_barrier(timedelta(seconds=0)),
            "Rank 0 timed out in monitoredBarrier")
    dist.barrier()
    return out


def check_timeout_words(me: int) -> dict:
    group = dist.new_group(timeout=timedelta(seconds=1))
    if me != 0:
        return {}
    start = time.monotonic()
    try:
        dist.barrier(group=group)
    except dist.DistBackendError as exc:
        return {"message": str(exc), "seconds": time.monotonic() - start}
    raise AssertionError("a barrier rank 0 alone entered did not time out")


def check_any_source(n: int, me: int) -> list | None:
    """dist.recv / irecv without src on rank 0: every other rank's two messages, each
    naming its sender (recv's return value, the work's _source_rank()), senders in order."""
    if me != 0:
        for i in range(2):
            dist.send(torch.full((3,), float(me * 10 + i)), 0, tag=5)
        return None
    got = []
    for _ in range(n - 1):
        t = torch.empty(3)
        got.append([dist.recv(t, tag=5), t.tolist()])
    for _ in range(n - 1):
        t = torch.empty(3)
        work = dist.irecv(t, tag=5)
        work.wait()
        got.append([work._source_rank(), t.tolist()])
    return got


def check_point_to_point(n: int, me: int, kind: str) -> dict:
    """send/recv between ranks 0 and 1 (rank 2 and up: a barrier only). Receives on different
    tags are independent (one waiting never holds up another), messages on one tag arrive in
    the order sent, large messages cross both ways at once, a wrong size and a timeout raise,
    and a receive pending at destroy_process_group ends with an error. On the compiled backend
    the Python group's send/recv are made to raise first: the door carries every message."""
    if kind == "compiled":
        def refuse(*args, **kwargs):
            raise AssertionError("the compiled backend called the Python group's send/recv")
        for name in ("send", "recv", "recv_anysource"):
            setattr(ferro_torch.ProcessGroupFerro, name, refuse)
    out: dict = {}
    if me <= 1:
        peer = 1 - me
        big = 300_000  # 1.2 MB: streamed in pieces, on the point-to-point threads
        # two tags, received in the other order than sent: tag 2 first, then an ack, then tag 1
        if me == 0:
            first, second = torch.empty(4), torch.empty(big)
            w1 = dist.irecv(first, 1, tag=1)
            w2 = dist.irecv(second, 1, tag=2)
            w2.wait(timedelta(seconds=30))
            dist.send(torch.ones(1), 1, tag=3)
            w1.wait(timedelta(seconds=30))
            assert torch.equal(second, torch.arange(big, dtype=torch.float32)), second[:4]
            assert torch.equal(first, torch.full((4,), 7.0)), first
        else:
            dist.send(torch.arange(big, dtype=torch.float32), 0, tag=2)
            dist.recv(torch.empty(1), 0, tag=3)
            dist.send(torch.full((4,), 7.0), 0, tag=1)
        # one tag, four messages of mixed sizes: in order
        sizes = [3, big, 5, big // 2]
        if me == 1:
            sends = [dist.isend(torch.full((k,), float(i)), 0, tag=4) for i, k in enumerate(sizes)]
            for w in sends:
                w.wait()
        else:
            for i, k in enumerate(sizes):
                t = torch.empty(k)
                dist.recv(t, 1, tag=4)
                assert torch.equal(t, torch.full((k,), float(i))), (i, t[:3])
        # an exchange of large messages, both sends issued before either receive
        mine = torch.full((big,), float(me))
        theirs = torch.empty(big)
        works = [dist.isend(mine, peer, tag=5), dist.irecv(theirs, peer, tag=5)]
        for w in works:
            w.wait(timedelta(seconds=30))
        assert torch.equal(theirs, torch.full((big,), float(peer))), theirs[:3]
        # a message of 8 bytes for a 12-byte buffer: an error naming both sizes
        if me == 1:
            dist.send(torch.ones(2), 0, tag=6)
        else:
            out["size"] = expect_error(lambda: dist.recv(torch.empty(3), 1, tag=6), "8",
                                       "12")[0]
    dist.barrier()
    # a receive nobody sends to: a timeout in torch's words; then one pending at the group's end
    group = dist.new_group(timeout=timedelta(seconds=1))
    if me == 0:
        out["timeout"] = expect_error(lambda: dist.recv(torch.empty(2), 1, tag=8, group=group),
                                      "Timed out")
    dist.barrier()
    dist.destroy_process_group(group)
    # a receive pending when its group ends (a group whose deadline is far off): ends at once
    group = dist.new_group(timeout=timedelta(seconds=60))
    pending = dist.irecv(torch.empty(2), (me + 1) % n, tag=9, group=group)
    dist.barrier()
    start = time.monotonic()
    dist.destroy_process_group(group)
    out["pending_at_end"] = expect_error(lambda: pending.wait(timedelta(seconds=30)))[0]
    out["end_seconds"] = time.monotonic() - start
    return out


def check_small_receives(n: int, me: int, kind: str) -> dict:
    """Small receives between ranks 0 and 1, however they are completed: a poll of
    is_completed() alone, get_future(), two on one tag waited for in reverse order (they keep
    the order sent), more on distinct tags than the compiled backend parks (80 of them, sent in
    reverse order, waited for in reverse order). On the compiled backend a synchronous round
    trip makes no thread (its receives run in the waiting thread)."""
    out: dict = {}
    if me > 1:
        return out
    peer = 1 - me
    group = dist.new_group([0, 1])
    deadline = time.monotonic() + 20
    if me == 1:
        dist.send(torch.full((3,), 10.0), 0, tag=10, group=group)
        dist.send(torch.full((3,), 11.0), 0, tag=11, group=group)
        for i in range(2):
            dist.send(torch.full((2,), float(i)), 0, tag=12, group=group)
        for t in reversed(range(80)):
            dist.send(torch.full((1,), float(t)), 0, tag=100 + t, group=group)
    else:
        polled = torch.empty(3)
        w = dist.irecv(polled, 1, tag=10, group=group)
        while not w.is_completed():  # never waited for
            assert time.monotonic() < deadline, "a polled receive never completed"
            time.sleep(0.001)
        assert torch.equal(polled, torch.full((3,), 10.0)), polled
        fut = torch.empty(3)
        got = dist.irecv(fut, 1, tag=11, group=group).get_future().wait()
        assert torch.equal(fut, torch.full((3,), 11.0)) and got[0] is fut, fut
        a, b = torch.empty(2), torch.empty(2)
        wa, wb = dist.irecv(a, 1, tag=12, group=group), dist.irecv(b, 1, tag=12, group=group)
        wb.wait()
        assert wa.is_completed() and a[0] == 0 and b[0] == 1, (a, b)
        bufs = [torch.empty(1) for _ in range(80)]
        works = [dist.irecv(x, 1, tag=100 + t, group=group) for t, x in enumerate(bufs)]
        for w in reversed(works):
            w.wait()
        assert [int(x) for x in bufs] == list(range(80)), bufs
    # a synchronous round trip of small messages: on the compiled backend no thread is made
    dist.barrier(group=group)
    tasks = len(os.listdir("/proc/self/task"))
    x = torch.zeros(16)
    for _ in range(50):
        if me == 0:
            dist.send(x, peer, group=group)
            dist.recv(x, peer, group=group)
        else:
            dist.recv(x, peer, group=group)
            dist.send(x + 1, peer, group=group)
    out["threads_made"] = len(os.listdir("/proc/self/task")) - tasks
    assert me == 1 or x[0] == 50, x
    dist.destroy_process_group(group)
    return out


def check_gloo_habits(n: int, me: int, kind: str) -> dict:
    """What gloo checks, checked alike (every rank's arguments wrong alike, or a disagreement
    every rank learns of): all_to_all blocks against their receivers' outputs, outputs of
    another shape, complex reductions, a receive from this rank."""
    out: dict = {}
    ins = [torch.full((1,), float(10 * me + d)) for d in range(n)]
    outs = [torch.zeros(2 if me == 1 else 1) for _ in range(n)]  # rank 1 expects 2 a block
    out["a2a"] = expect_error(lambda: dist.all_to_all(outs, ins), "SizeMismatchError",
                              "recv_splits")[0]
    outs = [torch.zeros(1) for _ in range(n)]
    dist.all_to_all(outs, ins)  # (in step after it)
    out["a2a_then"] = [o.item() for o in outs]
    x = torch.arange(6.0).reshape(2, 3) + me
    out["all_gather_shape"] = expect_error(
        lambda: dist.all_gather([torch.zeros(3, 2) for _ in range(n)], x), "does not match",
        kind=ValueError)[0]
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (me + 1)
    r = c.clone()
    dist.reduce(r, 0)
    out["complex_reduce"] = [[v.real, v.imag] for v in r.tolist()] if me == 0 else None
    whole = torch.stack([c] * n).reshape(-1)
    got = torch.zeros(2, dtype=torch.complex64)
    dist.reduce_scatter_tensor(got, whole)
    out["complex_reduce_scatter"] = [[v.real, v.imag] for v in got.tolist()]
    out["recv_self"] = expect_error(lambda: dist.recv(torch.zeros(1), src=me), "this rank",
                                    kind=ValueError)
    # a receive's wait that times out says which call (the compiled backend's words were c10d's
    # "Operation timed out!"), and on both backends the receive stays posted and a later wait
    # completes it (the Python backend's was withdrawn, the message going to a later receive)
    if me == 1:
        got = torch.zeros(2)
        work = dist.irecv(got, src=0)
        out["wait_timeout"] = expect_error(
            lambda: work.wait(timeout=timedelta(milliseconds=300)),
            "ferro recv: Timed out waiting 300ms", "the work goes on")[0]
    dist.barrier()
    if me == 0:
        dist.send(torch.full((2,), 7.0), dst=1)
    if me == 1:
        work.wait()
        out["wait_then"] = got.tolist()
    return out


def check_async_across_groups(n: int, me: int) -> dict:
    """Rank 0 issues an async all_reduce on the world, then a synchronous one on G = {0, 1};
    rank 1 the reverse (async on G, then the world): legal in torch (each group keeps its own
    order; gloo completes it). Where the ranks fill the cores, async calls ran in the issuing
    call, so each of ranks 0 and 1 waited in its async call for the other: a deadlock until the
    group's deadline."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=20))
    world, pair = torch.full((2,), float(me + 1)), torch.full((2,), float(me + 1))
    start = time.monotonic()
    if me == 0:
        work = dist.all_reduce(world, async_op=True)
        dist.all_reduce(pair, group=group)
        work.wait()
    elif me == 1:
        work = dist.all_reduce(pair, group=group, async_op=True)
        dist.all_reduce(world)
        work.wait()
    else:
        dist.all_reduce(world)
    dist.barrier()
    dist.destroy_process_group(group)
    return {"world": world.tolist(), "pair": pair.tolist() if me < 2 else None,
            "seconds": time.monotonic() - start}


def scenario_torch_api() -> None:
    kind = init(timeout=60)
    assert kind == os.environ["TEST_KIND"], (kind, os.environ["TEST_KIND"])
    n, me = dist.get_world_size(), dist.get_rank()
    check_device_backend(n, me, kind)
    sync = (check_synchronous_calls if kind == "python" else check_synchronous_calls_compiled)(
        n, me)
    check_sparse(n, me)
    monitored = check_monitored_barrier(n, me)
    timeout = check_timeout_words(me)
    any_source = check_any_source(n, me)
    p2p = check_point_to_point(n, me, kind)
    p2p.update(check_small_receives(n, me, kind))
    habits = check_gloo_habits(n, me, kind)
    across = check_async_across_groups(n, me)
    dist.barrier()
    report(rank=me, monitored=monitored, timeout=timeout, any_source=any_source, sync=sync,
           kind=kind, p2p=p2p, habits=habits, across=across)
    os._exit(0)  # rank 0's timed-out barrier group is never completed by the others


def _wait_until(ready, seconds: float = 30.0) -> bool:
    end = time.monotonic() + seconds
    while not ready() and time.monotonic() < end:
        time.sleep(0.05)
    return bool(ready())


def scenario_late_peer() -> None:
    """Rank 0's all_reduce times out (1 s) while rank 1 has not called; rank 1's call then came
    late and returned a sum with rank 0's abandoned contribution (the door: [102, 102]), while
    rank 0 had raised. Now a rank that gives up on a collective aborts the transport: the late
    call raises. Rank 1 calls once rank 0's abort has reached it (late by construction, not by
    a sleep a stalled rank 0 can outlast), and rank 0 stays until rank 1 has its answer (a
    file in the run's result directory, named as no result is)."""
    # the group's 1 s deadline is the test's; the set-up's store waits get 60 s (torch's store
    # took the 1 s too: a rank loading the compiled backend on a loaded host came after the
    # other had given up on its key)
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=60)))
    kind = init(timeout=1, store=store, rank=rank, world_size=world)
    me = dist.get_rank()
    answered = os.path.join(os.environ["TEST_RESULT_DIR"], "flag-rank1-answered")
    transport = ferro_torch.python_group(dist.group.WORLD).ferro_backend
    told = me == 0 or _wait_until(lambda: transport.peer_failure("all_reduce", 0) is not None)
    t = torch.full((2,), 100.0 if me == 0 else 2.0)
    try:
        dist.all_reduce(t)
        got = t.tolist()
    except Exception as exc:  # (the test reads what each rank got)
        got = f"{type(exc).__name__}: {exc}"
    if me == 1:
        open(answered, "w").close()
    else:
        _wait_until(lambda: os.path.exists(answered))
    report(rank=me, kind=kind, got=got, told=told)
    os._exit(0)


if __name__ == "__main__":
    globals()["scenario_" + sys.argv[1]]()
