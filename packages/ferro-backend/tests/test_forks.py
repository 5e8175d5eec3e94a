"""A backend inherited by a forked child (``ferro_backend.forks``): every operation in the child
raises ForkedBackendError naming both processes, ``close()`` there drops the child's copies
only, and the parent's job goes on untouched."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from ferro_backend import ForkedBackendError, SimulatedBackend
from ferro_backend.testing import in_fork, run_job


def _outcomes(ops):
    """Each ``(name, call)``: "returned", or the error's type and message."""
    got = {}
    for name, call in ops:
        try:
            call()
            got[name] = "returned"
        except BaseException as exc:
            got[name] = [type(exc).__name__, str(exc)]
    return got


def _check_child(got: dict, made: int, names) -> None:
    for name in names:
        kind, msg = got[name]
        assert kind == "ForkedBackendError", (name, got[name])
        assert f"this backend (rank 0) was made in process {made}; process " in msg, msg
        assert "is a fork of it: make a backend in the child" in msg, msg
    assert got["close"] == "returned", got["close"]


def test_a_simulated_group_in_a_forked_child_raises_and_the_parent_goes_on():
    group = SimulatedBackend.create_group(2, timeout=5.0)
    b = group[0]
    x = np.arange(4, dtype=np.float32)

    def child():
        got = _outcomes([("send", lambda: b.send(x, 1)),
                         ("recv", lambda: b.recv(np.empty(4, np.float32), 1, timeout=2.0)),
                         ("irecv", lambda: b.irecv(np.empty(4, np.float32), 1)),
                         ("barrier", lambda: b.barrier(timeout=2.0)),
                         ("close", b.close)])
        got["pid"] = os.getpid()
        return got

    got = in_fork(child)
    _check_child(got, os.getpid(), ["send", "recv", "irecv", "barrier"])
    assert f"process {got['pid']} is a fork" in got["send"][1]
    # the parent's group is untouched: both ranks exchange and meet
    out = np.empty(4, np.float32)
    t = threading.Thread(target=lambda: (group[1].recv(out, 0, timeout=5.0),
                                         group[1].barrier(timeout=5.0)))
    t.start()
    b.send(x, 1)
    b.barrier(timeout=5.0)
    t.join(10)
    assert not t.is_alive() and out.tolist() == x.tolist()
    for g in group:
        g.close()


def test_the_error_is_a_closed_backend_error_naming_both_processes():
    from ferro_backend.forks import forked_error

    exc = forked_error("send", 10, 11, rank=3)
    assert isinstance(exc, ForkedBackendError) and isinstance(exc, ConnectionError)
    assert (exc.made_pid, exc.pid, exc.peer) == (10, 11, 3)
    assert str(exc).startswith("send: this backend (rank 3) was made in process 10; process "
                               "11 is a fork of it")


_FORKED_RANK_0 = """
from ferro_backend.engine import _calls, _comm
from ferro_backend.testing import in_fork
x = np.arange(1000, dtype=np.float32)
engine = b.engine
child = None


def in_child():
    got = {}
    def run(name, call):
        try:
            call()
            got[name] = "returned"
        except BaseException as exc:
            got[name] = [type(exc).__name__, str(exc)]
    run("send", lambda: b.send(x, 1, tag=5))
    run("recv", lambda: b.recv(np.empty_like(x), 1, tag=5, timeout=2.0))
    run("irecv", lambda: b.irecv(np.empty_like(x), 1, tag=5))
    run("barrier", lambda: b.barrier(timeout=2.0))
    if engine is not None:  # the door: closed here, nothing published
        got["door"] = _calls.Call(engine.comm, _calls.ALLREDUCE, 0).run(
            x.copy(), np.empty_like(x), timeout=2.0)
    run("close", b.close)
    got["pid"] = os.getpid()
    return got


if b.rank == 0:
    child = [in_fork(in_child), os.getpid()]
# the parent's job goes on: messages, a barrier, the engine's door in its order
out = np.empty_like(x)
for i in range(3):
    req = b.irecv(out, 1 - b.rank, tag=7 + i)
    b.send(x + b.rank + i, 1 - b.rank, tag=7 + i)
    req.wait(10)
    assert (out == x + (1 - b.rank) + i).all()
    b.barrier(timeout=10)
door = None
if engine is not None:
    y = np.empty_like(x)
    door = _calls.Call(engine.comm, _calls.ALLREDUCE, 0).run(x.copy(), y, timeout=10.0)
    assert (y == 2 * x).all()
result = [child, door]
"""


@pytest.mark.parametrize("backend", ["TcpBackend", "ShmBackend"])
def test_a_forked_child_of_a_rank_raises_and_leaves_the_job_untouched(backend):
    from ferro_backend.engine import _comm

    res = run_job(_FORKED_RANK_0, 2, backend=backend, timeout=20.0)
    (got, made), door = res[0]
    _check_child(got, made, ["send", "recv", "irecv", "barrier"])
    assert f"process {got['pid']} is a fork" in got["send"][1]
    if backend == "ShmBackend":
        assert got["door"] == _comm.CLOSED
        assert door == res[1][1] == _comm.OK
