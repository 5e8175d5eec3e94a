"""The engine's door (ferro/engine.h) from C and C++: a client compiled at test time against the
installed headers, driven with ctypes from threads (one per rank, on one segment), against
numpy's reference; and what it refuses: a deadline, a mismatch, a dead peer, a closed
communicator, the thread rule, bad arguments, another ABI."""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _comms import comms
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ferro_backend
from ferro_backend.engine import _calls, _comm, _segment

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux engine")]

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - in the test extra
    BF16 = None

SHIM = Path(__file__).with_name("door_shim.c")
HEADERS = ["ferro/engine.h", "ferro/engine_python.h"]
#: ferro/engine.h's codes
DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.int8): 2,
          np.dtype(np.int16): 3, np.dtype(np.int32): 4, np.dtype(np.int64): 5,
          np.dtype(np.uint8): 6, np.dtype(np.uint16): 7, np.dtype(np.uint32): 8,
          np.dtype(np.uint64): 9, np.dtype(np.float16): 10, np.dtype(np.bool_): 12}
if BF16 is not None:
    DTYPES[BF16] = 11
OPS = {"SUM": 0, "PROD": 1, "MAX": 2, "MIN": 3, "BAND": 4, "BOR": 5, "BXOR": 6, "AVG": 7}
UFUNC = {"SUM": np.add, "PROD": np.multiply, "MAX": np.maximum, "MIN": np.minimum,
         "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor, "AVG": np.add}
BARRIER, ALLREDUCE, REDUCE, REDUCE_SCATTER, ALL_GATHER, GATHER, SCATTER, BROADCAST, \
    ALL_TO_ALL = range(9)
OK, TIMEOUT, FAILED, MISMATCH, INVALID, CLOSED, BUSY = range(7)


# ------------------------------------------------------------------ the headers and the client
def _compiler(cpp: bool) -> str:
    name = "g++" if cpp else "gcc"
    path = shutil.which(name) or shutil.which("c++" if cpp else "cc")
    if path is None:
        pytest.skip(f"no {name} on this machine")
    return path


@pytest.mark.parametrize("cpp", [False, True], ids=["C", "C++"])
@pytest.mark.parametrize("header", HEADERS)
def test_every_public_header_compiles_alone(header, cpp, tmp_path):
    src = tmp_path / ("one.cpp" if cpp else "one.c")
    src.write_text(f'#include "{header}"\nint main(void) {{ return 0; }}\n')
    std = "-std=c++17" if cpp else "-std=c11"
    r = subprocess.run([_compiler(cpp), std, "-Wall", "-Wextra", "-Werror", "-pedantic",
                        "-fsyntax-only", "-I", ferro_backend.get_include(), "-I",
                        sysconfig.get_paths()["include"], str(src)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_get_include_holds_the_headers_and_the_cython_declarations():
    inc = Path(ferro_backend.get_include())
    assert inc.is_absolute() and (inc / "ferro" / "engine.pxd").is_file()
    for header in HEADERS:
        assert (inc / header).is_file()
    assert _comm.ABI_VERSION == (1, 0) and _comm.CAPSULE_NAME == "ferro_backend.engine.comm"


def _build(tmp: Path, cpp: bool, include: str) -> ctypes.CDLL:
    out = tmp / ("shim_cpp.so" if cpp else "shim_c.so")
    cmd = [_compiler(cpp), "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-I",
           include, "-o", str(out)]
    cmd += ["-x", "c++", "-std=c++17"] if cpp else ["-std=c11"]
    r = subprocess.run(cmd + [str(SHIM)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lib = ctypes.CDLL(str(out))
    lib.shim_attach.restype = ctypes.c_void_p
    lib.shim_attach.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    for name in ("shim_release", "shim_close", "shim_rank", "shim_size", "shim_reserve",
                 "shim_error"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    lib.shim_reserve.restype = ctypes.c_longlong
    lib.shim_error.restype = ctypes.c_char_p
    lib.shim_skip.argtypes = [ctypes.c_void_p, ctypes.c_longlong]
    lib.shim_call.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_double, ctypes.c_longlong]
    lib.shim_call_flags.argtypes = lib.shim_call.argtypes + [ctypes.c_uint]
    lib.shim_send.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                              ctypes.c_ulonglong, ctypes.c_double]
    lib.shim_recv.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                              ctypes.c_ulonglong, ctypes.c_double, ctypes.POINTER(ctypes.c_int)]
    return lib


@pytest.fixture(scope="module", params=[False, True], ids=["C", "C++"])
def shim(request, tmp_path_factory):
    return _build(tmp_path_factory.mktemp("shim"), request.param, ferro_backend.get_include())


_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_pointer.restype, _pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


class Rank:
    """One rank's attachment through the compiled client: calls on numpy arrays."""

    def __init__(self, lib: ctypes.CDLL, comm: _comm.Comm) -> None:
        why = ctypes.create_string_buffer(256)
        self.lib, self.comm = lib, comm
        self.c = lib.shim_attach(_pointer(comm.capsule(), _comm.CAPSULE_NAME.encode()), why, 256)
        assert self.c, why.value

    def __call__(self, kind, send=None, recv=None, count=0, dtype=np.float32, op="SUM", root=0,
                 timeout=0.0, ticket=-1, flags=0) -> int:
        return self.lib.shim_call_flags(self.c, kind, _addr(send), _addr(recv), count,
                                        DTYPES[np.dtype(dtype)], OPS[op], root, timeout, ticket,
                                        flags)

    def send(self, x: np.ndarray, dst: int, tag: int = 0, timeout: float = 0.0) -> int:
        return self.lib.shim_send(self.c, _addr(x), x.nbytes, dst, tag, timeout)

    def recv(self, out: np.ndarray, src: int, tag: int = 0, timeout: float = 0.0):
        source = ctypes.c_int(-7)
        rc = self.lib.shim_recv(self.c, _addr(out), out.nbytes, src, tag, timeout,
                                ctypes.byref(source))
        return rc, source.value

    def error(self) -> str:
        return self.lib.shim_error(self.c).decode()

    def release(self) -> None:
        self.lib.shim_release(self.c)


def _addr(a) -> int | None:
    return None if a is None else a.ctypes.data


def ranks_of(lib, n: int, slot: int = 4096, **kw) -> list[Rank]:
    return [Rank(lib, c) for c in comms(n, slot, **kw)]


def in_threads(fns, timeout: float = 60.0) -> list:
    """Run fns[r]() in a thread each; their results (an exception is re-raised)."""
    out: list = [None] * len(fns)

    def run(r):
        try:
            out[r] = fns[r]()
        except BaseException as exc:
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank outlived its time"
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


# ------------------------------------------------------------------ every call against numpy
def reference(op: str, dtype: np.dtype, inputs: list[np.ndarray]) -> np.ndarray:
    """The rank-order fold numpy computes: float16/bfloat16 in float32, rounded once; AVG's
    divide in the last step."""
    # not ``dtype in (float16, BF16)``: without ml_dtypes BF16 is None, and numpy's
    # ``dtype == None`` is float64's test
    wide = dtype == np.float16 or (BF16 is not None and dtype == BF16)
    work = [x.astype(np.float32) for x in inputs] if wide else inputs
    acc = work[0].copy()
    with np.errstate(all="ignore"):
        for x in work[1:]:
            acc = UFUNC[op](acc, x)
        if op == "AVG" and len(work) > 1:
            acc = np.divide(acc, len(work)).astype(acc.dtype)
    return acc.astype(dtype) if wide else acc


def _data(rng, dtype: np.dtype, count: int, nan_at: int = 0) -> np.ndarray:
    """Random items; a float array gets one NaN, at ``nan_at`` (each rank its own place: which
    NaN a fold of two keeps is the compiler's choice, the same on every rank)."""
    if dtype == np.bool_:
        return rng.integers(0, 2, count).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    x = (rng.standard_normal(count) * 8).astype(dtype)
    if count > 3:
        x[nan_at % count] = np.nan
    return x


def _ops_for(dtype: np.dtype) -> list[str]:
    if dtype == np.bool_:
        return ["BAND", "BOR", "BXOR"]
    if dtype.kind in "iu":
        return ["SUM", "PROD", "MAX", "MIN", "BAND", "BOR", "BXOR"]
    return ["SUM", "PROD", "MAX", "MIN", "AVG"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 3), dtype=st.sampled_from(sorted(DTYPES, key=str)),
       count=st.sampled_from([0, 1, 7, 300, 1500, 5000]), root=st.integers(0, 2),
       seed=st.integers(0, 2**16), data=st.data())
def test_every_call_equals_numpys_reference(shim, n, dtype, count, root, seed, data):
    """Every collective through the compiled client, on 4 KiB slots (so a call of a few KiB
    runs one step, split, streamed or in pieces), every dtype and op, against numpy, with the
    same bits on every rank."""
    op = data.draw(st.sampled_from(_ops_for(dtype)))
    root %= n
    ranks = ranks_of(shim, n)
    inputs = [_data(np.random.default_rng([seed, r]), dtype, count * n, r) for r in range(n)]
    want = reference(op, dtype, inputs)

    def rank(r):
        me, x, c = ranks[r], inputs[r], count * n
        got = {}
        out = np.empty(c, dtype)
        assert me(ALLREDUCE, x, out, c, dtype, op) == OK, me.error()
        got["allreduce"] = out
        part = np.empty(count, dtype)
        assert me(REDUCE_SCATTER, x, part, count, dtype, op) == OK, me.error()
        got["reduce_scatter"] = part
        red = np.empty(c, dtype) if r == root else None
        assert me(REDUCE, x, red, c, dtype, op, root) == OK, me.error()
        got["reduce"] = red
        every = np.empty(c * n, dtype)
        assert me(ALL_GATHER, x, every, c, dtype) == OK, me.error()
        got["all_gather"] = every
        gathered = np.empty(c * n, dtype) if r == root else None
        assert me(GATHER, x, gathered, c, dtype, root=root) == OK, me.error()
        got["gather"] = gathered
        mine = np.empty(count, dtype)
        assert me(SCATTER, x if r == root else None, mine, count, dtype, root=root) == OK
        got["scatter"] = mine
        bc = x.copy()
        assert me(BROADCAST, bc, bc, c, dtype, root=root) == OK, me.error()
        got["broadcast"] = bc
        swapped = np.empty(c, dtype)
        assert me(ALL_TO_ALL, x, swapped, count, dtype) == OK, me.error()
        got["all_to_all"] = swapped
        assert me(BARRIER) == OK
        me.release()
        return got

    got = in_threads([lambda r=r: rank(r) for r in range(n)])
    concat = np.concatenate(inputs)
    for r in range(n):
        same = lambda a, b: a.tobytes() == np.ascontiguousarray(b).tobytes()
        assert same(got[r]["allreduce"], want), (r, op)
        assert same(got[r]["reduce_scatter"], want[r * count:(r + 1) * count])
        assert (got[r]["reduce"] is None) == (r != root)
        assert r != root or same(got[r]["reduce"], want)
        assert same(got[r]["all_gather"], concat)
        assert r != root or same(got[r]["gather"], concat)
        assert same(got[r]["scatter"], inputs[root][r * count:(r + 1) * count])
        assert same(got[r]["broadcast"], inputs[root])
        blocks = [inputs[s][r * count:(r + 1) * count] for s in range(n)]
        assert same(got[r]["all_to_all"], np.concatenate(blocks))


def test_in_place_calls_and_large_data_on_a_real_slot(shim):
    """In-place allreduce, reduce_scatter and all_gather at 3 MiB on 1 MiB slots (split,
    streamed, broadcast in pieces), float32 and bfloat16."""
    ranks = ranks_of(shim, 2, 1 << 20, ring_bytes=4096)
    count = 3 << 18
    for dtype in [np.dtype(np.float32)] + ([BF16] if BF16 is not None else []):
        xs = [_data(np.random.default_rng(r), dtype, count, r) for r in range(2)]
        want = reference("SUM", dtype, xs)

        def rank(r, xs=xs, dtype=dtype):
            me = ranks[r]
            buf = xs[r].copy()
            assert me(ALLREDUCE, buf, buf, count, dtype) == OK, me.error()
            whole = xs[r].copy()
            mine = whole[r * count // 2:(r + 1) * count // 2]
            assert me(REDUCE_SCATTER, whole, mine, count // 2, dtype) == OK, me.error()
            gathered = np.empty(2 * count, dtype)
            gathered[r * count:(r + 1) * count] = xs[r]
            assert me(ALL_GATHER, gathered[r * count:(r + 1) * count], gathered, count,
                      dtype) == OK, me.error()
            return buf, mine.copy(), gathered

        for r, (buf, mine, gathered) in enumerate(in_threads([lambda r=r: rank(r)
                                                               for r in range(2)])):
            assert buf.tobytes() == want.tobytes()
            assert mine.tobytes() == want[r * count // 2:(r + 1) * count // 2].tobytes()
            assert gathered.tobytes() == np.concatenate(xs).tobytes()
    for me in ranks:
        me.release()


# ------------------------------------------------------------------ what the door refuses
def test_a_deadline_names_the_ranks_not_arrived_and_breaks_the_communicator(shim):
    ranks = ranks_of(shim, 3)
    x = np.ones(4, np.float32)
    t0 = time.monotonic()
    rc = ranks[0](ALLREDUCE, x, x.copy(), 4, timeout=0.3)
    assert rc == TIMEOUT and 0.25 < time.monotonic() - t0 < 5
    msg = ranks[0].error()
    assert "allreduce (seq 0) on rank 0: timed out after 0.3s waiting for ranks [1, 2]" in msg
    t0 = time.monotonic()
    # broken: at once (5 s: far under its 10 s default timeout, with room for a loaded host's
    # scheduling stalls)
    assert ranks[0](BARRIER) == TIMEOUT and time.monotonic() - t0 < 5
    assert ranks[0].error() == msg


def test_a_deadline_is_never_early(shim):
    """A call's start comes from the kernel's coarse clock moved past now (``ferro_now_late``,
    _sync.h: 3 ns a read against 25 for CLOCK_MONOTONIC here): its deadline may be a few ms
    late, never early, also for short timeouts."""
    for timeout in (0.02, 0.05, 0.11, 0.02, 0.05):
        ranks = ranks_of(shim, 2)
        t0 = time.monotonic()
        assert ranks[0](BARRIER, timeout=timeout) == TIMEOUT
        elapsed = time.monotonic() - t0
        # (the point is the lower bound; the upper only says it ended, with room for a loaded
        # host's scheduling stalls)
        assert timeout <= elapsed < timeout + 5.0, (timeout, elapsed)
        for me in ranks:
            me.release()


def test_a_mismatch_names_what_every_rank_called_on_every_rank_and_the_calls_go_on(shim):
    ranks = ranks_of(shim, 2)
    xs = [np.ones(4, np.float32), np.ones(4, np.int32)]

    def rank(r):
        me = ranks[r]
        rc = me(ALLREDUCE, xs[r], xs[r].copy(), 4, xs[r].dtype)
        msg = me.error()
        after = me(ALLREDUCE, xs[0], xs[0].copy(), 4)  # the next call runs
        return rc, msg, after

    for rc, msg, after in in_threads([lambda r=r: rank(r) for r in range(2)]):
        assert rc == MISMATCH and after == OK
        assert msg == ("allreduce: ranks disagree on the collective: ranks [0] called "
                       "allreduce(float32[4], SUM) (seq 0); ranks [1] called "
                       "allreduce(int32[4], SUM) (seq 0)")


def test_a_call_that_takes_fewer_tickets_than_its_peers_catches_up_after_a_mismatch(shim):
    """FERRO_OPTS_SPAN(5): rank 0's collective is the first of a call of its own that takes 5
    tickets (it gives back the other 4, as a compressed call gives back its block's unused
    numbers); rank 1 made a plain call there. Their headers differ in that alone: both get the
    mismatch, and rank 1's door gives back 4 tickets of its own, so both number the next call
    alike (its header carries the ticket) and it runs. A rank that already reserved a ticket
    after its call keeps it: nothing is given back then."""
    ranks = ranks_of(shim, 2)
    x = np.ones(4, np.float32)

    def rank(r):
        me = ranks[r]
        rc = me(ALLREDUCE, x, x.copy(), 4, flags=5 if r == 0 else 0)
        msg = me.error()
        if r == 0:
            for _ in range(4):
                assert me.lib.shim_skip(me.c, me.lib.shim_reserve(me.c)) == OK
        out = x.copy()
        after = me(ALLREDUCE, x, out, 4)
        return rc, msg, after, out.tolist(), me.lib.shim_reserve(me.c)

    got = in_threads([lambda r=r: rank(r) for r in range(2)])
    for rc, msg, after, out, ticket in got:
        assert rc == MISMATCH and after == OK and out == [2.0] * 4 and ticket == 6, got
        assert msg.startswith("allreduce: ranks disagree on the collective: ranks [0] called "
                              "allreduce(float32[4], SUM) (seq 0); ranks [1] called "), msg

    ranks = ranks_of(shim, 2)

    def reserved_after(r):
        me = ranks[r]
        mine = me.lib.shim_reserve(me.c)
        later = me.lib.shim_reserve(me.c) if r == 1 else None
        rc = me(ALLREDUCE, x, x.copy(), 4, ticket=mine, flags=3 if r == 0 else 0)
        if later is not None:
            assert me.lib.shim_skip(me.c, later) == OK
        return rc, me.lib.shim_reserve(me.c)

    assert in_threads([lambda r=r: reserved_after(r) for r in range(2)]) == [(MISMATCH, 1),
                                                                             (MISMATCH, 2)]


def test_a_call_names_the_collective_and_op_its_client_called(shim):
    """FERRO_OPTS_CALL(code) and FERRO_OPTS_OP(wire): the header names another collective and
    op than the door's own (a multi-node job's node stage names the user's call): ranks that
    name the same run the call; where they name different ones, every rank gets the mismatch
    naming what each named; an op wire code past 8 is refused."""
    ranks = ranks_of(shim, 2)
    x = np.ones(4, np.float32)
    allreduce_mean = 2 << 16 | 2 << 24  # (collective code 2: allreduce; op wire code 2: MEAN)

    def rank(r, mine):
        me = ranks[r]
        out = x.copy()
        rc = me(ALLREDUCE, x, out, 4, flags=mine)
        return rc, me.error() if rc != OK else out.tolist()

    both = in_threads([lambda r=r: rank(r, allreduce_mean) for r in range(2)])
    assert both == [(OK, [2.0] * 4)] * 2  # (the door still sums: only the header names MEAN)
    apart = in_threads([lambda r=r: rank(r, allreduce_mean if r == 0 else 4 << 16)
                        for r in range(2)])
    for rc, msg in apart:
        assert rc == MISMATCH, apart
        assert "ranks [0] called allreduce(float32[4], MEAN)" in msg, msg
        assert "ranks [1] called all_gather(float32[4], SUM)" in msg, msg
    assert ranks[0](BARRIER, flags=9 << 24) == INVALID
    assert "FERRO_OPTS_OP(9) is no op's wire code (1-8)" in ranks[0].error()


def test_python_steps_catch_up_in_their_turn_and_only_with_nothing_reserved_after():
    """``Comm.catch_up`` (what ferro's Python steps call after a mismatch): in the call's
    turn, with no ticket reserved after it, the next ``count`` tickets are given back, so the
    next reserved ticket's turn comes as soon as this one ends; with one reserved after it,
    nothing is given back; outside the call's turn, nothing either."""
    me = comms(2)[0]
    t = me.reserve()
    assert me.begin(t, 5.0, "test") == _comm.OK
    assert me.catch_up(t, 3)
    me.end(t)
    nxt = me.reserve()
    assert nxt == t + 4
    assert me.begin(nxt, 0.5, "test") == _comm.OK  # (its turn: the three were given back)
    later = me.reserve()
    assert not me.catch_up(nxt, 3)
    me.end(nxt)
    assert not me.catch_up(later + 1, 2)  # (not its turn: it is later's)
    assert me.begin(later, 0.5, "test") == _comm.OK and me.reserve() == later + 1
    me.end(later)


def test_a_peers_failure_ends_the_wait_with_its_reason(shim):
    ranks = ranks_of(shim, 2)
    threading.Timer(0.2, lambda: ranks[0].comm.mark_failed("rank 1 is gone (test)")).start()
    t0 = time.monotonic()
    assert ranks[0](BARRIER, timeout=30.0) == FAILED and time.monotonic() - t0 < 5
    assert ranks[0].error() == "barrier (seq 0) on rank 0: rank 1 is gone (test)"
    assert ranks[0](BARRIER) == FAILED  # broken


def test_a_closed_communicator_refuses_at_once_and_ends_calls_in_flight(shim):
    ranks = ranks_of(shim, 2)
    waiting = threading.Event()
    # the barrier's stall report (after 0.3 s of its 30) says it is in flight: close then, not
    # after a fixed time that may come before the call began ("is closed", not "was closed")
    ranks[0].comm.stall_fraction = 0.01
    ranks[0].comm.set_stall_report(lambda msg: waiting.set())
    closer = threading.Thread(target=lambda: waiting.wait(30) and ranks[0].comm.close())
    closer.start()
    assert ranks[0](BARRIER, timeout=30.0) == CLOSED
    closer.join(30)
    assert "the engine was closed" in ranks[0].error()
    assert ranks[0](ALLREDUCE, np.ones(2, np.float32), np.ones(2, np.float32), 2) == CLOSED
    assert ranks[0].error() == "allreduce on rank 0: the engine is closed"


def test_two_threads_breaking_the_thread_rule_get_busy_and_reserved_tickets_work(shim):
    ranks = ranks_of(shim, 2)
    got = {}
    entered = threading.Event()
    # thread A's barrier reports its stall after 0.1 s of its 10: then it holds the call (a
    # fixed sleep could end before A began, and B's call would be the one that waits)
    ranks[0].comm.stall_fraction = 0.01
    ranks[0].comm.set_stall_report(lambda msg: entered.set())

    def first():  # rank 0, thread A: an unreserved call that waits for rank 1
        got["a"] = ranks[0](BARRIER, timeout=10.0)

    a = threading.Thread(target=first)
    a.start()
    assert entered.wait(30)  # thread A is inside its barrier, waiting for rank 1
    rc = ranks[0](ALLREDUCE, np.ones(2, np.float32), np.ones(2, np.float32), 2)  # thread B
    assert rc == BUSY, ranks[0].error()
    assert "another thread is in an unreserved call (barrier)" in ranks[0].error()
    assert ranks[1](BARRIER) == OK
    a.join(10)
    assert got["a"] == OK
    # reserved in the same order on every rank, two threads per rank may call at once
    tickets = [[shim.shim_reserve(me.c) for _ in range(2)] for me in ranks]
    x = [np.full(3, r + 1.0, np.float32) for r in range(2)]
    outs = [[np.empty(3, np.float32) for _ in range(2)] for _ in range(2)]
    calls = [lambda r=r, k=k: ranks[r](ALLREDUCE, x[r], outs[r][k], 3, ticket=tickets[r][k])
             for r in range(2) for k in (1, 0)]  # the later ticket's thread first
    assert in_threads(calls) == [OK] * 4
    assert all(o.tolist() == [3.0] * 3 for pair in outs for o in pair)
    # a ticket run twice, or never reserved, is refused
    assert ranks[0](BARRIER, ticket=tickets[0][0]) == INVALID
    assert "already used" in ranks[0].error()
    assert ranks[0](BARRIER, ticket=10**6) == INVALID
    assert "was never reserved" in ranks[0].error()


def test_bad_arguments_are_refused_on_the_calling_rank_with_nothing_published(shim):
    (me, other) = ranks_of(shim, 2)
    x = np.ones(4, np.int32)
    cases = [((ALLREDUCE, x, x.copy(), 4, np.int32, "AVG"), "AVG does not reduce int32"),
             ((ALLREDUCE, None, x, 4), "send is NULL for 16 bytes"),
             ((BROADCAST, x, x, 4, np.int32, "SUM", 5), "root 5 is not a rank of 2"),
             ((ALLREDUCE, x, x[1:], 3, np.int32), "overlap"),
             ((ALLREDUCE, x, x.copy(), 4, np.bool_, "SUM"), "SUM does not reduce bool")]
    for args, words in cases:
        assert me(*args) == INVALID and words in me.error(), (words, me.error())
    # nothing was published: the next call meets the peer's first one
    assert in_threads([lambda: me(BARRIER), lambda: other(BARRIER)]) == [OK, OK]


def test_a_stall_is_reported_once_with_the_ranks_not_arrived():
    """(from Python, through ``_calls.Call``: the GIL held until the call waits, then let go,
    and taken again for the report)"""
    (a, b) = comms(2)
    reports = []
    reported = threading.Event()
    a.stall_fraction = 0.05  # rank 0's 10 s barrier reports after 0.5 s
    a.set_stall_report(lambda msg: (reports.append(msg), reported.set()))
    barrier = [_calls.Call(c, _calls.BARRIER, 0) for c in (a, b)]
    # rank 1 comes once rank 0 has reported (not after a fixed time, which on a loaded host
    # may come before rank 0's report, or after its deadline)
    late = threading.Thread(target=lambda: reported.wait(30)
                            and barrier[1].run(None, None, -1, 30.0))
    late.start()
    assert barrier[0].run(None, None, -1, 10.0) == _comm.OK
    late.join(30)
    assert len(reports) == 1 and "still waiting for ranks [1] after " in reports[0], reports
    # (the report may come later than 0.5 s on a loaded host, never earlier)
    after = re.search(r"still waiting for ranks \[1\] after (\d+\.\d)s", reports[0])
    assert after and float(after.group(1)) >= 0.5, reports


_RUN_AT = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_double)


def test_run_at_as_a_c_function_runs_the_call_with_a_ticket_of_its_own():
    """``_calls.RUN_AT``: what ferro-collective's one-call path calls in C (no Python call, no
    int objects): the same call as ``Call.run_at``, its ticket reserved as it is made."""
    run_at = _RUN_AT(_pointer(_calls.RUN_AT, b"ferro_backend.engine._calls.RUN_AT"))
    (a, b) = comms(2)
    xs = [np.full(8, r + 1.0, np.float32) for r in range(2)]
    outs = [np.zeros(8, np.float32) for _ in range(2)]
    calls = [_calls.Call(c, _calls.ALLREDUCE, 0) for c in (a, b)]

    def one(r: int) -> int:
        return run_at(calls[r], xs[r].ctypes.data, xs[r].nbytes, outs[r].ctypes.data,
                      outs[r].nbytes, 5.0)

    assert in_threads([lambda: one(0), lambda: one(1)]) == [_comm.OK, _comm.OK]
    assert all(o.tolist() == [3.0] * 8 for o in outs)
    assert [c.ticket for c in calls] == [0, 0]  # (each took a ticket as it was made)
    # and Call.run_at (Python) is the same function: the next tickets, the same sums
    assert in_threads([lambda r=r: calls[r].run_at(xs[r].ctypes.data, xs[r].nbytes,
                                                   outs[r].ctypes.data, outs[r].nbytes, 5.0)
                       for r in range(2)]) == [_comm.OK, _comm.OK]
    assert all(o.tolist() == [3.0] * 8 for o in outs) and [c.ticket for c in calls] == [1, 1]


def test_a_client_built_against_another_abi_is_refused_with_a_message(tmp_path):
    inc = tmp_path / "include"
    shutil.copytree(ferro_backend.get_include(), inc)
    header = inc / "ferro" / "engine.h"
    header.write_text(header.read_text().replace("#define FERRO_ENGINE_ABI_MAJOR 1u",
                                                 "#define FERRO_ENGINE_ABI_MAJOR 2u"))
    lib = _build(tmp_path, False, str(inc))
    (c, _) = comms(2)
    why = ctypes.create_string_buffer(256)
    assert not lib.shim_attach(_pointer(c.capsule(), _comm.CAPSULE_NAME.encode()), why, 256)
    assert b"another version of ferro's engine header" in why.value
    assert b"(engine ABI 1.0, this client 2.0)" in why.value
    assert not lib.shim_attach(ctypes.c_void_p(id(why)), why, 256)  # not a communicator
    assert b"not a ferro engine communicator" in why.value


def test_a_client_keeps_the_communicator_alive_after_python_lets_it_go(shim):
    """The segment stays mapped while a client holds its reference: released last, it is
    unmapped then (no call touches freed memory)."""
    (a, b) = comms(2)
    ra, rb = Rank(shim, a), Rank(shim, b)
    del a, b
    import gc

    gc.collect()
    x = [np.full(2, r + 1.0, np.float32) for r in range(2)]
    res = in_threads([lambda: ra(ALLREDUCE, x[0], x[0], 2), lambda: rb(ALLREDUCE, x[1], x[1], 2)])
    assert res == [OK, OK] and x[0].tolist() == [3.0, 3.0]
    ra.release()
    rb.release()


_PEER_DIES = """
import ctypes, os, sys
lib = ctypes.CDLL(sys.argv[1])
lib.shim_attach.restype = ctypes.c_void_p
lib.shim_attach.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
lib.shim_error.restype, lib.shim_error.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
lib.shim_call.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_double, ctypes.c_longlong]
get = ctypes.pythonapi.PyCapsule_GetPointer
get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
from ferro_backend.engine import CAPSULE_NAME, comm_capsule
why = ctypes.create_string_buffer(256)
c = lib.shim_attach(get(comm_capsule(b), CAPSULE_NAME.encode()), why, 256)
x = np.full(4, b.rank + 1.0, np.float32)
first = lib.shim_call(c, 1, x.ctypes.data, x.ctypes.data, 4, 0, 0, 0, 0.0, -1)
if b.rank == 1:
    os._exit(3)  # gone without a word, while rank 0 waits in its next call
t0 = time.monotonic()
rc = lib.shim_call(c, 0, None, None, 0, 0, 0, 0, 30.0, -1)
result = [first, x.tolist(), rc, lib.shim_error(c).decode(), time.monotonic() - t0]
"""


def test_a_dead_peer_process_ends_a_c_clients_wait_naming_it(tmp_path):
    from ferro_backend.testing import Job

    lib = tmp_path / "shim_c.so"
    _build(tmp_path, False, ferro_backend.get_include())
    job = Job("import time\n" + _PEER_DIES, 2, backend="ShmBackend", args=[str(lib)])
    results = job.finish(timeout=90)
    assert results[1].returncode == 3
    assert results[0].returncode == 0, results[0].stderr
    first, summed, rc, msg, waited = results[0].result
    assert first == OK and summed == [3.0] * 4
    assert rc == FAILED and waited < 10, (rc, msg, waited)
    assert msg.startswith("barrier (seq 1) on rank 0: ") and "rank 1" in msg, msg


_SUBGROUP = """
from ferro_backend.engine import _calls, attach_engine, comm_capsule
result = None
if b.rank != 1:
    sub = SubBackend(b, [0, 2])
    try:
        comm_capsule(sub)
        plain = "a capsule"
    except RuntimeError as exc:
        plain = str(exc)
    engine = attach_engine(sub)
    comm_capsule(sub)  # a C client may attach now
    x = np.full(4, b.rank + 1.0, np.float32)
    rc = _calls.Call(engine.comm, _calls.ALLREDUCE, 0).run(x, x)
    result = [plain, rc, x.tolist(), engine.nranks, sub.engine is engine]
b.barrier()
"""


def test_a_subgroup_of_a_same_host_job_gets_an_engine_of_its_own():
    from ferro_backend.testing import run_job

    res = run_job(_SUBGROUP, 3, backend="ShmBackend")
    assert res[1] is None
    for r in (0, 2):
        plain, rc, summed, nranks, kept = res[r]
        assert "SubBackend (rank" in plain and "has no same-host engine" in plain
        assert rc == OK and summed == [4.0] * 4 and nranks == 2 and kept



# ------------------------------------------------------------------ point-to-point
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.sampled_from([0, 8, 1000, 4000, 30_000]), min_size=1, max_size=6),
       tags=st.data())
def test_messages_arrive_whole_in_order_per_tag_whatever_order_they_are_received_in(
        shim, sizes, tags):
    """Rank 0 sends messages (eager and chunked through 4 KiB rings) on several tags; rank 1
    receives them tags in another order: each arrives whole, FIFO per tag, the others set
    aside meanwhile."""
    ranks = ranks_of(shim, 2)
    tag_of = [tags.draw(st.integers(0, 2)) for _ in sizes]
    msgs = [np.random.default_rng(k).integers(0, 255, s, dtype=np.uint8)
            for k, s in enumerate(sizes)]
    order = sorted(range(len(msgs)), key=lambda k: (-tag_of[k], k))  # by tag, FIFO within

    def sender():
        return [ranks[0].send(m, 1, tag_of[k], 10.0) for k, m in enumerate(msgs)]

    def receiver():
        got = {}
        for k in order:
            out = np.empty(sizes[k], np.uint8)
            got[k] = (ranks[1].recv(out, 0, tag_of[k], 10.0), out)
        return got

    sent, got = in_threads([sender, receiver])
    assert sent == [OK] * len(msgs)
    for k, ((rc, source), out) in got.items():
        assert rc == OK and source == 0 and out.tobytes() == msgs[k].tobytes()


def test_receives_from_any_rank_and_what_a_receive_refuses(shim):
    ranks = ranks_of(shim, 3)
    x = [np.full(5, r, np.int64) for r in range(3)]
    assert ranks[2].send(x[2], 0, 7) == OK and ranks[1].send(x[1], 0, 7) == OK
    seen = set()
    for _ in range(2):
        out = np.empty(5, np.int64)
        rc, source = ranks[0].recv(out, -1, 7, 5.0)
        assert rc == OK and out.tolist() == [source] * 5
        seen.add(source)
    assert seen == {1, 2}
    # a message of another size on the tag: refused, named, dropped
    assert ranks[1].send(np.zeros(3, np.int64), 0, 8) == OK
    rc, _ = ranks[0].recv(np.empty(5, np.int64), 1, 8, 5.0)
    assert rc == INVALID and "a message of 24 bytes for a 40-byte buffer" in ranks[0].error()
    t0 = time.monotonic()
    rc, _ = ranks[0].recv(np.empty(5, np.int64), 2, 9, 0.2)
    assert rc == TIMEOUT and 0.15 < time.monotonic() - t0 < 3
    assert ranks[0].error() == "recv from rank 2 (tag 9) on rank 0: timed out after 0.2s"
    assert ranks[0].send(x[0], 3) == INVALID and "rank 3 is not a rank of 3" in ranks[0].error()
    ranks[0].comm.mark_failed("rank 2 is gone (test)")
    rc, _ = ranks[0].recv(np.empty(5, np.int64), 2, 9, 5.0)
    assert rc == FAILED and "rank 2 is gone (test)" in ranks[0].error()


def test_point_to_point_runs_beside_a_collective_in_flight(shim):
    """No tickets: a receive and a send complete while a barrier of the same communicator
    waits (a rank late to it)."""
    ranks = ranks_of(shim, 2)
    got = {}

    def rank0():
        got["barrier"] = ranks[0](BARRIER, timeout=10.0)

    t = threading.Thread(target=rank0)
    t.start()
    time.sleep(0.1)
    assert ranks[1].send(np.arange(3.0), 0, 5) == OK
    out = np.empty(3)
    assert ranks[0].recv(out, 1, 5, 5.0) == (OK, 1) and out.tolist() == [0.0, 1.0, 2.0]
    assert ranks[1](BARRIER) == OK
    t.join(10)
    assert got["barrier"] == OK


ENGINE_SRC = Path(__file__).resolve().parents[1] / "src" / "ferro_backend" / "engine"


@pytest.mark.skipif(not ENGINE_SRC.is_dir(), reason="needs the source tree")
@pytest.mark.parametrize("header", sorted(p.name for p in [*ENGINE_SRC.glob("_*.h"),
                                                            *ENGINE_SRC.parent.glob("kernels/_*.h")]))
def test_every_engine_header_compiles_alone(header, tmp_path):
    """The engine's own headers, as its build compiles them (C11, _GNU_SOURCE): each one with
    the includes it needs, none a piece of another that only compiles inside it."""
    src = tmp_path / "one.c"
    src.write_text(f'#include "{header}"\nint main(void) {{ return 0; }}\n')
    r = subprocess.run([_compiler(False), "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra",
                        "-Werror", "-fsyntax-only", "-I", str(ENGINE_SRC), "-I",
                        str(ENGINE_SRC.parent / "include"), "-I",
                        str(ENGINE_SRC.parent / "kernels"), "-I",
                        sysconfig.get_paths()["include"], str(src)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ the link's re-probes
def _ask_probe_before(comm: _comm.Comm, ticket: int) -> np.ndarray:
    """Write what rank 0's ask_reprobe writes (door.c: every rank probes the link before
    ``ticket``'s call); the segment's probe count (its header's ``probes`` word)."""
    seg = np.frombuffer(comm, dtype=np.uint8)
    ctrl0 = _segment.layout(comm.n, comm.slot_bytes, 4096)["ctrl_off"]
    seg[ctrl0 + 56:ctrl0 + 64].view(np.int64)[0] = ticket + 1  # ferro_ctrl.reprobe
    return seg[64:68].view(np.uint32)  # ferro_seg_head.probes


def test_every_rank_probes_the_link_before_the_call_rank_0_marked(shim):
    ranks = ranks_of(shim, 2)
    probes = _ask_probe_before(ranks[0].comm, 0)
    assert probes[0] == 0
    assert in_threads([lambda r=r: ranks[r](BARRIER) for r in range(2)]) == [OK, OK]
    assert probes[0] == 1  # once, by both ranks, and the barrier ran after it
    assert in_threads([lambda r=r: ranks[r](BARRIER) for r in range(2)]) == [OK, OK]
    assert probes[0] == 1  # (not again)
    for me in ranks:
        me.release()


def test_a_rank_missing_the_probe_times_the_call_out_naming_the_probe(shim):
    ranks = ranks_of(shim, 2)
    _ask_probe_before(ranks[0].comm, 0)
    t0 = time.monotonic()
    assert ranks[0](BARRIER, timeout=0.3) == TIMEOUT and time.monotonic() - t0 < 5
    msg = ranks[0].error()
    assert "barrier (seq 0) on rank 0: timed out after 0.3s in the link probe every rank " \
        "runs before it" in msg
    assert ranks[0](BARRIER) == TIMEOUT and ranks[0].error() == msg  # broken, as a timeout
    for me in ranks:
        me.release()


_PIPELINED_LOOP = """
from ferro_backend.engine import _calls, _comm
comm = b.engine.comm
# no link re-probe between the calls (rank 0 asks for one when its copies change speed, as
# they do on a loaded host): a rank stopped in it is not in a pipelined step, and the probe's
# timeout names no rank
comm.reprobe_seconds = 0
reports = []
comm.set_stall_report(reports.append)
call = _calls.Call(comm, _calls.ALLREDUCE, 0)  # (float32, SUM)
x = np.ones(2_000_000, np.float32)  # 8 MB: pipelined steps, beyond a slot
out = np.empty_like(x)
rc, end = _comm.OK, time.monotonic() + 60
print("LOOPING", flush=True)
while rc == _comm.OK and time.monotonic() < end:
    rc = call.run(x, out, timeout=3.0)
result = [rc, _comm.last_error(), reports]
# hold the backend open until every survivor has its result: a survivor whose deadline fell
# earlier (a loaded host starts the ranks' calls apart) would otherwise close first, and the
# other would read "peer rank 0 is gone" before its own deadline
done = __import__("pathlib").Path(sys.argv[1])
(done / f"done{b.rank}").touch()
hold = time.monotonic() + 30
while len(list(done.glob("done*"))) < b.world_size - 1 and time.monotonic() < hold:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_stopped_inside_a_pipelined_allreduce_is_named_by_the_others(world, tmp_path):
    """Every rank reached the pipelined step, so no step counter is behind: the stall report
    and the timeout name the rank whose chunks stopped coming (SIGSTOPped mid-loop)."""
    import os
    import signal

    from ferro_backend.testing import Job

    with Job(_PIPELINED_LOOP, world, backend="ShmBackend", timeout=30.0,
             args=[tmp_path]) as job:
        victim = job.procs[1]
        try:
            for r in range(world):
                job.wait_for_line(r, "LOOPING", 60)
            time.sleep(0.5)
            os.kill(victim.pid, signal.SIGSTOP)
            for r in (0, 2)[:world - 1]:
                out, err = job.procs[r].communicate(timeout=60)
                assert job.procs[r].returncode == 0, err[-3000:]
                rc, msg, reports = json.loads(out.split("RESULT ", 1)[1])
                assert rc == TIMEOUT, msg
                assert f"on rank {r}: timed out after 3s waiting for ranks [1]" in msg, msg
                assert reports and "still waiting for ranks [1]" in reports[0], reports
        finally:
            os.kill(victim.pid, signal.SIGCONT)
            job.kill()
