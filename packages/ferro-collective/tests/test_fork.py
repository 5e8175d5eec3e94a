"""Collectives in a forked child of a rank raise the backend's ForkedBackendError (the engine's
door is closed there, and the socket path checks the backend), and the parent's job goes on
in its order of calls."""

from __future__ import annotations

import pytest

from ferro_backend.testing import run_job

_BODY = """
import ferro_collective as fc
from ferro_backend.testing import in_fork
x = np.ones(1000, np.float32)
fc.allreduce(x, b)
child = None


def in_child():
    got = {}
    for name, call in [("allreduce", lambda: fc.allreduce(x, b, timeout=3)),
                       ("broadcast", lambda: fc.broadcast(x, b, root=0, timeout=3)),
                       ("all_gather_object", lambda: fc.all_gather_object(1, b)),
                       ("barrier", lambda: fc.barrier(b))]:
        try:
            call()
            got[name] = "returned"
        except BaseException as exc:
            got[name] = [type(exc).__name__, str(exc)]
    return [got, os.getpid()]


if b.rank == 0:
    child = in_fork(in_child) + [os.getpid()]
fc.barrier(b)
for _ in range(5):
    y = fc.allreduce(x, b)
assert (y == b.world_size).all()
result = child
"""


@pytest.mark.parametrize("backend", ["TcpBackend", "ShmBackend"])
def test_collectives_in_a_forked_child_raise_forked_backend_error(backend):
    (got, pid, made), _ = run_job(_BODY, 2, backend=backend, timeout=20.0)
    for name, outcome in got.items():
        kind, msg = outcome
        assert kind == "ForkedBackendError", (name, outcome)
        assert f"was made in process {made}; process {pid} is a fork of it" in msg, msg
