"""The same-host engine (ferro-backend's door, ``engine._comm``, its steps ``engine._steps`` and
its reduction kernel ``kernels._fold``) against its baselines.

- ``fold``: the N-way rank-order reduction kernel against numpy's ``np.add`` chain (same work).
- ``one call``: ferro-collective's compiled dispatcher (``dispatch.run``, then ``_onecall``: plan
  cache, ``out=`` checks, then the engine's door: its order, header and step) on a one-rank
  engine, so nothing but the call's own cost is timed, against ``np.copyto`` of the same 4 KiB
  (the least a one-rank allreduce into ``out=`` must do) and against a bare ``np.add(x, x, out=o)``;
  scatter's, all_to_all_single's and all_to_all's (``_metacall``, ``_exchange_twin``: the twin of
  their metadata step) likewise; broadcast_object's and all_gather_object's (``_objects_twin``)
  against a pickle round trip of the same object.
- collectives on 2 real processes: ``ShmBackend`` with the engine (``_comm``, ``_segment``,
  ``_watch``) against ``np.copyto`` of the same bytes in this process (the baseline: a yardstick
  outside the project, so the gated ratio moves only with the engine and the machine), and the
  Python algorithms over the same transport with the engine off (ferro 0.1's path over TCP
  loopback: timed for the README's engine-on / engine-off table, role "context", not gated),
  in one run. Each round is ``K`` calls on every rank (the worker knows the schedule, so nothing
  but the collective is timed); the per-call time is the round time / K.

The side-by-side with Open MPI and gloo is ``benchmarks/peers.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from busbw import busbw_factor

from ferro_backend import ShmBackend
from ferro_backend.testing import free_port
from ferro_collective import ReduceOp
from ferro_collective.ops import fold

SIZES = {"4KiB": 4 << 10, "64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
OPS = ["allreduce", "broadcast", "all_gather", "reduce_scatter", "barrier"]
ROUNDS = 5
#: every (size, collective) in the order both ranks run them
CASES = [(size, name) for size in SIZES for name in OPS if name != "barrier" or size == "4KiB"]


def calls_per_round(nbytes: int) -> int:
    return max(2, min(500, (16 << 20) // max(nbytes, 1)))


def run_op(name: str, x: np.ndarray, out: np.ndarray, b) -> None:
    import ferro_collective as fc

    n = b.world_size
    if name == "allreduce":
        fc.allreduce(x, b, out=out)
    elif name == "broadcast":
        fc.broadcast(x, b, 0, out=out)
    elif name == "all_gather":
        fc.all_gather(x[: x.size // n], b, out=out)
    elif name == "reduce_scatter":
        fc.reduce_scatter(x, b, out=out[: x.size // n])
    else:
        fc.barrier(b)


# ------------------------------------------------------------------ the fold kernel
@pytest.mark.parametrize("impl", ["numpy", "fold"])
def bench_fold_4_inputs_4MiB(benchmark, impl):
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(1 << 20).astype(np.float32) for _ in range(4)]
    out = np.empty_like(inputs[0])
    benchmark.group = "kernel fold (4 inputs, SUM, float32 4MiB)"
    benchmark.extra_info["bytes"] = out.nbytes * 4
    if impl == "numpy":
        benchmark.extra_info["role"] = "baseline"

        def run():
            np.copyto(out, inputs[0])
            for x in inputs[1:]:
                np.add(out, x, out=out)
    else:
        def run():
            fold(out, inputs, ReduceOp.SUM)

    benchmark.pedantic(run, rounds=30, warmup_rounds=3)
    np.testing.assert_array_equal(out, ((inputs[0] + inputs[1]) + inputs[2]) + inputs[3])


# ------------------------------------------------------------------ the compiled one-call path
def one_rank_engine():
    """A backend of one rank with an engine of its own (a world of one makes none)."""
    from ferro_backend import SimulatedBackend
    from ferro_backend.engine import Engine, _segment

    (b,) = SimulatedBackend.create_group(1)
    slot, ring = 1 << 20, 4096
    size = _segment.layout(1, slot, ring)["size"]
    fd = os.memfd_create("ferro-bench", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        b.engine = Engine(0, 1, fd, size, slot, ring, b.timeout)
    finally:
        os.close(fd)
    return b


@pytest.mark.parametrize("impl", ["np.copyto", "np.add", "one_call"])
def bench_one_call_dispatch_4KiB(benchmark, impl):
    import ferro_collective as fc
    from ferro_collective import _onecall

    x = np.ones(1024, np.float32)
    out = np.empty_like(x)
    benchmark.group = "one-call dispatch (allreduce 4KiB out=, one-rank engine)"
    benchmark.extra_info["bytes"] = x.nbytes
    if impl == "np.copyto":
        benchmark.extra_info["role"] = "baseline"

        def run():
            np.copyto(out, x)
    elif impl == "np.add":
        def run():
            np.add(x, x, out=out)
    else:
        b = one_rank_engine()
        fc.allreduce(x, b, out=out)  # the general path makes the group,
        fc.allreduce(x, b, out=out)  # the one-call path the plan
        assert b.engine.client.cached(_onecall.ALLREDUCE, x, ReduceOp.SUM) is not None

        def run():
            fc.allreduce(x, b, out=out)
    benchmark.pedantic(run, rounds=200, iterations=100, warmup_rounds=5)


@pytest.mark.parametrize("impl", ["np.copyto", "_calls.Call.run_at", "_steps.Steps.exchange"])
def bench_door_call_4KiB(benchmark, impl):
    """The engine's door on a one-rank engine (``_comm.Comm``): a prepared allreduce of 4 KiB
    through its public table (``_calls.Call.run_at``: ticket, turn, header, step, fold), and one
    step of ferro's Python steps (``_steps.Steps.exchange``: header and data into the slot,
    publish, wait), against ``np.copyto`` of the same 4 KiB. With bench_one_call_dispatch_4KiB:
    the door's own part of a call, and the rest ferro-collective's."""
    import time

    from ferro_backend.engine import _calls

    x = np.ones(1024, np.float32)
    out = np.empty_like(x)
    benchmark.group = "door call (allreduce 4KiB, one-rank engine)"
    benchmark.extra_info["bytes"] = x.nbytes
    if impl == "np.copyto":
        benchmark.extra_info["role"] = "baseline"

        def run():
            np.copyto(out, x)
    elif impl == "_calls.Call.run_at":
        comm = one_rank_engine().engine.comm
        call = _calls.Call(comm, _calls.ALLREDUCE, 0, 0, 0, x.shape)
        src, dst = x.ctypes.data, out.ctypes.data
        assert call.run_at(src, x.nbytes, dst, out.nbytes, 0.0) == 0

        def run():
            call.run_at(src, 4096, dst, 4096, 0.0)
    else:
        steps = one_rank_engine().engine.steps
        header = b"h" * 76

        def run():
            steps.exchange(header, x, 0, None, time.monotonic() + 60.0, 4096)
    benchmark.pedantic(run, rounds=200, iterations=100, warmup_rounds=5)
    if impl == "_calls.Call.run_at":
        assert out.tolist() == x.tolist()


@pytest.mark.parametrize("impl", ["untraced", "traced"])
def bench_timeline_cost_4KiB(benchmark, impl, tmp_path):
    """What the timeline costs the compiled entry: the same call untraced (one pointer check:
    compare with bench_one_call_dispatch_4KiB's fastcall) and while ferro_backend.trace records
    every call."""
    import ferro_collective as fc
    from ferro_backend import trace

    x = np.ones(1024, np.float32)
    out = np.empty_like(x)
    benchmark.group = "timeline (allreduce 4KiB out=, one-rank engine)"
    benchmark.extra_info["bytes"] = x.nbytes
    b = one_rank_engine()
    fc.allreduce(x, b, out=out)
    fc.allreduce(x, b, out=out)

    def run():
        fc.allreduce(x, b, out=out)

    if impl == "untraced":
        benchmark.extra_info["role"] = "baseline"
        benchmark.pedantic(run, rounds=200, iterations=100, warmup_rounds=5)
    else:
        with trace(tmp_path / "t.json"):
            benchmark.pedantic(run, rounds=50, iterations=100, warmup_rounds=2)


@pytest.mark.parametrize("call", ["scatter", "all_to_all_single", "all_to_all", "all_gather_v"])
@pytest.mark.parametrize("impl", ["np.copyto", "_metacall.Twin", "general"])
def bench_metacall_4KiB(benchmark, impl, call):
    """The one-call path of scatter, all_to_all_single, all_to_all and all_gather_v
    (``_metacall.Twin``, the compiled twin of their metadata step; the uneven ones in
    ``_exchange_twin``) on a one-rank engine, against their general path (a ``MetaPlan``: the
    same step from Python) and against ``np.copyto`` of the same 4 KiB."""
    import ferro_collective as fc
    from ferro_collective.api import SCATTER
    from ferro_collective.api_uneven import ALL_GATHER_V, ALL_TO_ALL, ALL_TO_ALL_SINGLE
    from ferro_collective.dispatch import run as dispatch

    x = np.ones(1024, np.float32)
    out = np.empty_like(x)
    benchmark.group = f"metadata-step call ({call} 4KiB out=, one-rank engine)"
    benchmark.extra_info["bytes"] = x.nbytes
    if impl == "np.copyto":
        benchmark.extra_info["role"] = "baseline"

        def run():
            np.copyto(out, x)
    else:
        b = one_rank_engine()
        fc.barrier(b)  # (makes the group and its twin)
        coll, arg, data, into = {"scatter": (SCATTER, 0, x, out),
                                 "all_to_all_single": (ALL_TO_ALL_SINGLE, (None, None), x, out),
                                 "all_to_all": (ALL_TO_ALL, None, [x], None),
                                 "all_gather_v": (ALL_GATHER_V, None, x, None)}[call]
        algorithm = None if impl == "_metacall.Twin" else "auto"
        twin = b.engine.client.twin
        before = twin.taken

        def run():
            return dispatch(coll, data, b, arg, None, algorithm, into)
    benchmark.pedantic(run, rounds=100, iterations=100, warmup_rounds=5)
    if impl != "np.copyto":
        assert (twin.taken > before) == (algorithm is None)
        got = run()
        assert (got[0] if call in ("all_to_all", "all_gather_v") else out).tolist() == x.tolist()


@pytest.mark.parametrize("call", ["broadcast_object", "all_gather_object"])
@pytest.mark.parametrize("impl", ["pickle", "_objects_twin", "general"])
def bench_object_call(benchmark, impl, call):
    """The one-call path of broadcast_object and all_gather_object (``_objects_twin``: the
    compiled twin of their metadata step, the pickle riding in it) on a one-rank engine, against
    their general path (the same step from Python) and against a pickle round trip of the same
    object (``pickle.loads(pickle.dumps(obj))``: the least either must do)."""
    import pickle

    import ferro_collective as fc
    from ferro_collective.api_uneven import ALL_GATHER_OBJECT, BROADCAST_OBJECT
    from ferro_collective.dispatch import run as dispatch

    obj = {"step": 1200, "lr": 3e-4, "ranks": list(range(8)), "tag": "warmup"}
    benchmark.group = f"object call ({call}, a small dict, one-rank engine)"
    if impl == "pickle":
        benchmark.extra_info["role"] = "baseline"

        def run():
            return [pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))]
    else:
        b = one_rank_engine()
        fc.barrier(b)  # (makes the group and its twin)
        coll, arg = {"broadcast_object": (BROADCAST_OBJECT, 0),
                     "all_gather_object": (ALL_GATHER_OBJECT, None)}[call]
        algorithm = None if impl == "_objects_twin" else "auto"
        twin = b.engine.client.twin
        before = twin.taken

        def run():
            return dispatch(coll, obj, b, arg, None, algorithm)
    benchmark.pedantic(run, rounds=100, iterations=100, warmup_rounds=5)
    got = run()
    assert (got if call == "broadcast_object" and impl != "pickle" else got[0]) == obj
    if impl != "pickle":
        assert (twin.taken > before) == (algorithm is None)


@pytest.mark.parametrize("impl", ["itertools.count", "_doorplan.SeqCounter"])
def bench_sequence_numbers(benchmark, impl):
    """A collective's sequence number from Python: `_doorplan.SeqCounter` (what the compiled
    path advances without a call) against the plain Python counter it replaced."""
    import itertools

    from ferro_collective._doorplan import SeqCounter

    benchmark.group = "sequence numbers (one per collective)"
    if impl == "itertools.count":
        benchmark.extra_info["role"] = "baseline"
        nxt = itertools.count().__next__
    else:
        nxt = SeqCounter()
        assert [nxt(), nxt()] == [0, 1]
    benchmark.pedantic(nxt, rounds=200, iterations=1000, warmup_rounds=5)


# ------------------------------------------------------------------ collectives, 2 processes
WORKER = """
import sys
import numpy as np
from ferro_backend import ShmBackend
sys.path.insert(0, sys.argv[1])
from bench_engine import CASES, SIZES, ROUNDS, calls_per_round, run_op
addr, engine = sys.argv[2], sys.argv[3] == "1"
b = ShmBackend(1, 2, addr, timeout=300, engine=engine)
for size, name in CASES:
    nbytes = SIZES[size]
    x = np.ones(nbytes // 4, np.float32)
    out = np.empty_like(x)
    for _ in range((ROUNDS + 1) * calls_per_round(nbytes)):
        run_op(name, x, out, b)
b.close()
"""


class Pair:
    """Rank 0 here, rank 1 a worker process running the same schedule."""

    def __init__(self, engine: bool) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        addr = f"127.0.0.1:{free_port()}"
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WORKER), here, addr,
                                      "1" if engine else "0"], env=env)
        self.backend = ShmBackend(0, 2, addr, timeout=300, engine=engine)

    def close(self) -> None:
        self.backend.close()
        self.proc.wait(60)


@pytest.fixture(scope="module")
def pairs():
    made = {}
    yield made
    for pair in made.values():
        pair.close()


@pytest.mark.parametrize("impl", ["np.copyto", "python_path", "engine"])
@pytest.mark.parametrize("case", CASES, ids=[f"{s}-{n}" for s, n in CASES])
def bench_engine_2_ranks(benchmark, pairs, impl, case):
    # the worker runs CASES in order; pytest runs `case` as the outer loop, so each pair does too
    size, name = case
    nbytes = SIZES[size]
    k = calls_per_round(nbytes)
    x = np.ones(nbytes // 4, np.float32)
    out = np.empty_like(x)
    benchmark.group = f"{name} 2 ranks shm {size}"
    if impl == "np.copyto":  # the yardstick: the same bytes copied locally, as many times
        benchmark.extra_info["role"] = "baseline"

        def one_round():
            for _ in range(k):
                np.copyto(out, x)
    else:
        pair = pairs.get(impl)
        if pair is None:
            pair = pairs[impl] = Pair(engine=impl == "engine")
        if impl == "python_path":  # ferro 0.1's path, timed for the README, not gated
            benchmark.extra_info["role"] = "context"

        def one_round():
            for _ in range(k):
                run_op(name, x, out, pair.backend)

    benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=1)
    per_call = benchmark.stats.stats.median / k
    benchmark.extra_info["per_call_us"] = per_call * 1e6
    if name != "barrier":
        benchmark.extra_info["busbw_GBps"] = nbytes * busbw_factor(name, 2) / per_call / 1e9
    if name == "allreduce" and impl != "np.copyto":
        assert out[0] == 2.0
