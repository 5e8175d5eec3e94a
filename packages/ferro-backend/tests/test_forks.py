"""A backend inherited by a forked child (``ferro_backend.forks``): every operation in the child
raises ForkedBackendError naming both processes, ``close()`` there drops the child's copies
only, and the parent's job goes on untouched."""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
import warnings

import numpy as np
import pytest

from ferro_backend import ForkedBackendError, SimulatedBackend
from ferro_backend.testing import run_job


def _in_child(fn, timeout: float = 30.0):
    """Run ``fn()`` in a forked child; its JSON result back through a pipe (the child killed
    if it does not answer within ``timeout`` seconds)."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (a threaded process forks)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            out = json.dumps(fn())
        except BaseException as exc:
            out = json.dumps(["child failed", repr(exc)])
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    data, end = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            if select.select([r], [], [], max(0.0, end - time.monotonic()))[0]:
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(r)
        if not data:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert data, f"the child did not answer in {timeout:g}s"
    return json.loads(data)


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

    got = _in_child(child)
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
import select
from ferro_backend.engine import _calls, _comm
x = np.arange(1000, dtype=np.float32)
engine = b.engine
child = None
if b.rank == 0:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
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
        os.write(w, json.dumps(got).encode())
        os._exit(0)
    os.close(w)
    data, end = b"", time.monotonic() + 30
    while time.monotonic() < end:
        if select.select([r], [], [], 1.0)[0]:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            data += chunk
    if not data:
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    child = [json.loads(data), os.getpid()]
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
