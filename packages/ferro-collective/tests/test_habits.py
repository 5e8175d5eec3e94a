"""What torch and mpi4py users' hands expect: torch's names, an op passed where the root goes,
and a closed backend that stays closed (on threads, TCP and the engine)."""

import time

import numpy as np
import pytest

import ferro_collective as fc
from ferro_backend import PeerClosedError, SimulatedBackend
from ferro_backend.testing import run_processes, run_ranks
from ferro_collective import ReduceOp


def test_torchs_names_are_the_same_function_and_member():
    assert fc.all_reduce is fc.allreduce
    assert ReduceOp.AVG is ReduceOp.MEAN and ReduceOp("mean") is ReduceOp.AVG
    got = run_ranks(lambda b: fc.all_reduce(np.array([b.rank + 1.0]), b, ReduceOp.AVG), 2)
    assert [g.tolist() for g in got] == [[1.5], [1.5]]


def test_an_op_where_the_root_goes_says_to_pass_it_as_op():
    (b,) = SimulatedBackend.create_group(1)
    with pytest.raises(TypeError, match=r"passed where the root rank goes; pass the op as "
                                        r"op=<ReduceOp.MAX"):
        fc.reduce(np.ones(2), b, ReduceOp.MAX)


def _after_close(b):
    b.close()
    out = []
    for call in (lambda: fc.allreduce(np.ones(3), b, timeout=5),
                 lambda: fc.broadcast(np.ones(3), b, 0, timeout=5),
                 lambda: fc.barrier(b, timeout=5),
                 lambda: fc.broadcast(None, b, 0, timeout=5)):  # (the root's None: closed first)
        try:
            out.append(("returned", call()))
        except PeerClosedError as exc:
            out.append(("closed", "closed" in str(exc)))
    return out


@pytest.mark.parametrize("transport", ["threads", "tcp", "shm"])
def test_every_call_on_a_closed_backend_raises_on_every_rank(transport):
    if transport == "threads":
        res = run_ranks(_after_close, 2)
    else:
        res = run_processes(_after_close, 2, transport=transport, timeout=60)
    assert res == [[("closed", True)] * 4] * 2


@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_a_compressed_call_on_a_closed_backend_names_the_call(wire):
    # it named the inner collective that found the backend closed (all_to_all_single); the
    # call is named with its wire, as an error met inside the call names it
    (b,) = SimulatedBackend.create_group(1)
    b.close()
    for name, call in (("allreduce", lambda: fc.allreduce(np.ones(8, np.float32), b, wire=wire)),
                       ("allreduce", lambda: fc.allreduce_async(np.ones(8, np.float32), b,
                                                                wire=wire).wait(5)),
                       ("reduce_scatter",
                        lambda: fc.reduce_scatter(np.ones(8, np.float32), b, wire=wire))):
        with pytest.raises(PeerClosedError,
                           match=fr"^{name}\[{wire}\]: rank 0's backend is closed"):
            call()


def _peer_closes_during(b, kind):
    """Rank 1 closes its backend while rank 0 waits in an allreduce (blocking or async)."""
    if b.rank == 1:
        time.sleep(0.3)
        b.close()
        return None
    try:
        if kind == "sync":
            fc.allreduce(np.ones(1000), b, timeout=20)
        else:
            fc.allreduce_async(np.ones(1000), b, timeout=20).wait(20)
    except PeerClosedError as exc:
        return type(exc).__name__, str(exc)
    return "returned"


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("transport", ["threads", "tcp", "shm"])
def test_a_peers_close_during_a_call_names_the_call(transport, kind):
    # it named only the transport's operation: "recv: rank 0 <-> 1: peer rank 1 is gone"
    if transport == "threads":
        res = run_ranks(lambda b: _peer_closes_during(b, kind), 2)
    else:
        res = run_processes(_peer_closes_during, 2, kind, transport=transport, timeout=60)
    name, msg = res[0]
    assert name == "PeerClosedError" and msg.startswith("allreduce") and "rank 1" in msg, msg
    assert res[1] is None


EXIT_SCRIPT = """
import atexit
import numpy as np
import ferro_backend as fb, ferro_collective as fc
b = fb.init_from_env()
fc.allreduce(np.ones(2), b)

def late():  # while the interpreter exits: closed, then called
    b.close()
    try:
        print(f"rank {b.rank}: returned {fc.allreduce(np.ones(3), b, timeout=5)}", flush=True)
    except fb.PeerClosedError as exc:
        print(f"rank {b.rank}: PeerClosedError: {exc}", flush=True)

atexit.register(late)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_closed_backend_stays_closed_while_the_interpreter_exits(transport, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(EXIT_SCRIPT)
    run = subprocess.run([sys.executable, "-m", "ferro_backend.launch", "--nproc", "2",
                          "--transport", transport, str(script)],
                         capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in (0, 1):
        assert f"[rank {r}] rank {r}: PeerClosedError:" in run.stdout, run.stdout
    assert "returned" not in run.stdout


# ----------------------------------------------------------------------------- one rank's error
def _one_rank_refuses(b, kind):
    """Rank 1 makes an argument error; every rank reports what it got and how long it took,
    then both run a good call (the order of calls is intact)."""
    import time

    bad = b.rank == 1
    x = np.ones(4, np.float32)
    calls = {
        "dtype": lambda: fc.allreduce(x.astype(np.complex64) if bad else x, b),
        "out": lambda: fc.all_gather(x, b, out=np.empty(3, np.float32) if bad else None),
        "root": lambda: fc.broadcast(x, b, root=7 if bad else 0),
        "algorithm": lambda: fc.reduce_scatter(x, b, algorithm="bogus" if bad else None),
        "async": lambda: fc.allreduce_async(x.astype(np.complex64) if bad else x, b).wait(30),
    }
    t0 = time.monotonic()
    try:
        calls[kind]()
        got = ("returned",)
    except Exception as exc:  # what each rank raised is the test
        got = (type(exc).__name__, str(exc))
    took = time.monotonic() - t0
    after = fc.allreduce(np.array([b.rank + 1.0]), b, timeout=30).tolist()
    return got, took, after


def test_the_refusing_rank_raises_at_once_whether_or_not_its_peers_call():
    import time

    rank0, _silent = SimulatedBackend.create_group(2, timeout=30)
    for call in (lambda: fc.allreduce(np.ones(2, np.complex64), rank0),
                 lambda: fc.allreduce_async(np.ones(2, np.complex64), rank0)):
        t0 = time.monotonic()
        with pytest.raises(TypeError, match="complex64"):
            call()
        # not the 30 s deadline: published in the background (10 s: a loaded host's room)
        assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("transport", ["threads", "tcp", "shm"])
@pytest.mark.parametrize("kind", ["dtype", "out", "root", "algorithm", "async"])
def test_an_argument_error_on_one_rank_reaches_its_peers_in_the_same_call(transport, kind):
    if transport == "threads":
        res = run_ranks(lambda b: _one_rank_refuses(b, kind), 2)
    else:
        res = run_processes(_one_rank_refuses, 2, kind, transport=transport, timeout=90,
                            backend_timeout=60)
    (peer, peer_took, after0), (own, _, after1) = res
    assert own[0] in ("TypeError", "ValueError", "SizeMismatchError", "InvalidRankError"), own
    assert peer[0] == "CollectiveMismatchError", peer
    assert "rank 1 refused the call" in peer[1] and own[0] in peer[1], peer[1]
    assert peer_took < 5.0  # not the 60 s deadline (within a second on a quiet machine)
    assert after0 == after1 == [3.0]


def test_ranks_that_all_refuse_each_raise_their_own_error_and_go_on():
    def body(b):
        with pytest.raises(TypeError, match="complex64"):
            fc.allreduce(np.ones(2, np.complex64), b)
        return fc.allreduce(np.ones(1), b).tolist()

    assert run_ranks(body, 3) == [[3.0]] * 3


# ----------------------------------------------------------------------------- broadcast(None)
def _broadcast_from_root(b, shape, dtype):
    x = (np.arange(int(np.prod(shape))).reshape(shape) + 1).astype(dtype)
    got = fc.broadcast(x if b.rank == 0 else None, b, root=0, timeout=30)
    mixed = fc.broadcast(x if b.rank != 1 else None, b, root=0, timeout=30)  # some pass arrays
    return [(g.dtype.str, g.shape, g.tobytes() == x.tobytes()) for g in (got, mixed)]


@pytest.mark.parametrize("transport", ["threads", "tcp", "shm"])
def test_non_roots_may_pass_none_to_broadcast(transport):
    cases = [((3, 4), "float32"), ((2, 1, 3), "int16"), ((300_000,), "float64"), ((), "int64")]
    for shape, dtype in cases:
        if transport == "threads":
            res = run_ranks(lambda b, s=shape, d=dtype: _broadcast_from_root(b, s, d), 3)
        else:
            res = run_processes(_broadcast_from_root, 3, shape, dtype, transport=transport,
                                timeout=90)
        want = (np.dtype(dtype).str, shape, True)
        assert res == [[want, want]] * 3, (shape, dtype, res)


def test_broadcast_none_takes_bfloat16_and_a_given_out():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = np.dtype(ml_dtypes.bfloat16)
    x = np.arange(5).astype(bf)

    def body(b):
        out = np.zeros(5, bf)
        got = fc.broadcast(x if b.rank == 0 else None, b, out=None if b.rank == 0 else out)
        return got.dtype == bf and (got == x).all() and (b.rank == 0 or got is out)

    assert run_ranks(body, 2) == [True, True]


def _broadcast_none_errors(b):
    out = []
    try:  # the root passing None: a refusal, every rank raises at once
        fc.broadcast(None, b, root=0, timeout=30)
    except Exception as exc:
        out.append(type(exc).__name__)
    try:  # the root calls something else
        if b.rank == 0:
            fc.allreduce(np.ones(2), b, timeout=30)
        else:
            fc.broadcast(None, b, root=0, timeout=30)
    except Exception as exc:
        out.append((type(exc).__name__, "broadcast(None, root=0)" in str(exc)))
    try:  # more dims than the root's header names
        fc.broadcast(np.ones((1,) * 7) if b.rank == 0 else None, b, timeout=30)
    except Exception as exc:
        out.append((type(exc).__name__, str(exc)))
    try:  # a structured dtype, whose code in the header is a hash (names no dtype to build)
        x = np.array([(1, 2.5), (3, 4.5)], dtype=[("a", "<i4"), ("b", "<f8")])
        fc.broadcast(x if b.rank == 0 else None, b, timeout=30)
        out.append("returned")
    except Exception as exc:
        out.append((type(exc).__name__, str(exc)))
    out.append(fc.allreduce(np.ones(1), b, timeout=30).tolist())
    return out


@pytest.mark.parametrize("transport", ["threads", "tcp", "shm"])
def test_broadcast_none_errors_reach_every_rank(transport):
    if transport == "threads":
        res = run_ranks(_broadcast_none_errors, 2)
    else:
        res = run_processes(_broadcast_none_errors, 2, transport=transport, timeout=90)
    root, other = res
    assert root[0] == "ValueError" and other[0] == "CollectiveMismatchError"
    assert root[1] == other[1] == ("CollectiveMismatchError", True)
    for said in (root[2], other[2], root[3], other[3]):
        assert said[0] == "CollectiveMismatchError"
    for said in (root[2][1], other[2][1]):  # (the sixth dim's place holds a hash of the rest)
        assert "passes an array of 7 dims" in said or "[1, 1, 1, 1, 1, ... (7 dims)]" in said
    assert "cannot rebuild (#" in other[3][1] and "a structured dtype" in other[3][1]
    assert root[4] == other[4] == [2.0]


def test_broadcast_none_needs_the_header_exchange_off_the_engine():
    (b,) = SimulatedBackend.create_group(1)
    fc.set_mismatch_check(False)
    try:
        with pytest.raises(ValueError, match="mismatch check"):
            fc.broadcast(None, SimulatedBackend.create_group(2)[1])
    finally:
        fc.set_mismatch_check(True)
    assert fc.broadcast(np.ones(2), b).tolist() == [1.0, 1.0]


# ----------------------------------------------------------------------------- tracebacks
def _frames_of_a_mismatch(b):
    import traceback

    try:
        fc.allreduce(np.ones(3, np.float64 if b.rank else np.float32), b, timeout=30)
    except Exception as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        ours = [f for f in frames if "ferro" in f.filename or f.filename.endswith(".pxi")]
        return type(exc).__name__, len(ours), frames[0].name
    return None


@pytest.mark.parametrize("transport", ["threads", "tcp", "shm"])
def test_an_error_shows_at_most_three_ferro_frames(transport):
    if transport == "threads":
        res = run_ranks(_frames_of_a_mismatch, 2)
    else:
        res = run_processes(_frames_of_a_mismatch, 2, transport=transport, timeout=90)
    for name, ours, first in res:
        assert name == "CollectiveMismatchError" and 1 <= ours <= 3 and \
            first == "_frames_of_a_mismatch"


def test_ferro_traceback_full_keeps_every_frame():
    import traceback

    from ferro_backend import settings

    g = SimulatedBackend.create_group(1)
    with settings.override(TRACEBACK="full"):
        with pytest.raises(TypeError) as info:
            fc.allreduce(np.ones(2, np.complex64), g[0])
    assert len(traceback.extract_tb(info.value.__traceback__)) > 4
    with pytest.raises(TypeError) as info:
        fc.allreduce(np.ones(2, np.complex64), g[0])
    assert len(traceback.extract_tb(info.value.__traceback__)) <= 4


def _overlapping_outs(b):
    """Every collective with an ``out=`` that shares bytes with its input elsewhere than a
    transport takes them in place (the same buffer; this rank's block), three times each (the
    first call plans, the later ones take the engine's one-call path), then a plain
    allreduce: the results as if the input were read first, and the ranks still in step."""
    n, me, last = b.world_size, b.rank, b.world_size - 1
    got = []
    for _ in range(3):
        buf = np.arange(2.0 * n + 4) + me
        got.append(("allreduce", fc.allreduce(buf[:4], b, out=buf[2:6], timeout=20).tolist()))
        buf = np.arange(2.0 * n + 4) + me
        got.append(("reduce_scatter",
                    fc.reduce_scatter(buf[:2 * n], b, out=buf[1:3], timeout=20).tolist()))
        buf = np.arange(2.0 * n + 4) + me
        got.append(("all_gather", fc.all_gather(buf[1:3], b, out=buf[:2 * n], timeout=20)
                    .tolist()))
        buf = np.arange(2.0 * n + 4) + me
        mine = me == last
        got.append(("broadcast", fc.broadcast(buf[:4], b, last, timeout=20,
                                              out=buf[1:5] if mine else None).tolist()))
        buf = np.arange(2.0 * n + 4) + me
        res = fc.reduce(buf[:4], b, last, out=buf[2:6] if mine else None, timeout=20)
        got.append(("reduce", res.tolist() if mine else None))
        buf = np.arange(2.0 * n + 4) + me
        res = fc.gather(buf[1:3], b, 0, out=buf[:2 * n] if me == 0 else None, timeout=20)
        got.append(("gather", res.tolist() if me == 0 else None))
        buf = np.arange(2.0 * n + 4) + me
        got.append(("scatter", fc.scatter(buf[:2 * n], b, 0, out=buf[1:3] if me == 0 else None,
                                          timeout=20).tolist()))
    got.append(("then", fc.allreduce(np.ones(2), b, timeout=20).tolist()))
    return got


@pytest.mark.parametrize("transport, world", [("threads", 3), ("tcp", 2), ("shm", 2),
                                              ("shm", 3)])
def test_an_out_overlapping_the_input_gives_the_copy_first_result(transport, world):
    """On the engine such an ``out=`` made the door refuse on that rank alone, after its turn
    was taken: its peers waited for it and every later call met the wrong one."""
    if transport == "threads":
        res = run_ranks(_overlapping_outs, world, timeout=60)
    else:
        res = run_processes(_overlapping_outs, world, transport=transport, timeout=120)
    n, ranks = world, range(world)

    def rows(r):
        return np.arange(2.0 * n + 4) + r

    total = sum(rows(r) for r in ranks)
    want = {"allreduce": total[:4].tolist(), "broadcast": rows(n - 1)[:4].tolist(),
            "all_gather": np.concatenate([rows(r)[1:3] for r in ranks]).tolist(),
            "reduce": total[:4].tolist(), "gather": np.concatenate(
                [rows(r)[1:3] for r in ranks]).tolist()}
    for me, got in enumerate(res):
        assert got[-1] == ("then", [float(n)] * 2)
        for kind, value in got[:-1]:
            expected = {**want, "reduce_scatter": total[2 * me:2 * me + 2].tolist(),
                        "scatter": rows(0)[2 * me:2 * me + 2].tolist()}[kind]
            if (kind == "reduce" and me != n - 1) or (kind == "gather" and me != 0):
                expected = None
            assert value == expected, (me, kind)
