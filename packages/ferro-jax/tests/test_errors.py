"""ferro's guarantees through JAX: a mismatch found on every rank with ferro's message, a peer
that dies inside a jitted step is a typed error within seconds (not a hang), errors of the
Python path keep their class."""

from __future__ import annotations

import sys
import time

import pytest
import workers

from ferro_backend.testing import Job, run_processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux engine")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_mismatched_shapes_give_the_mismatch_error_on_every_rank(transport):
    for msg in run_processes(workers.mismatch, 2, transport=transport, timeout=120):
        assert msg.startswith("CollectiveMismatchError"), msg
        assert "[4]" in msg and "[5]" in msg, msg  # what each rank called


_PEER_DIES = """
import jax, jax.numpy as jnp, ferro_jax as fj
fj.init(b)
step = jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda i, v: fj.allreduce(v) * 0.5, x))
x = jnp.ones(4096)
step(x).block_until_ready()
print("READY", flush=True)
if b.rank == 1:
    time.sleep(0.5)
    os._exit(7)  # dies between two steps of rank 0's jitted loop
start = time.monotonic()
try:
    with fj.typed_errors():
        for i in range(100000):
            x = step(x)
            if i % 10 == 9:  # as a loop reading its loss: a jitted step is dispatched
                x.block_until_ready()  # asynchronously, its error surfaces where it is waited on
        x.block_until_ready()
    result = ["no error", 0]
except Exception as exc:
    result = [type(exc).__name__ + ": " + str(exc), time.monotonic() - start,
              type(exc.__cause__).__name__]
"""


def test_a_peer_that_dies_inside_a_jitted_step_is_a_typed_error_within_seconds():
    with Job(_PEER_DIES, 2, backend="ShmBackend", timeout=60.0) as job:
        for r in range(2):
            job.wait_for_line(r, "READY", timeout=60)
        r0, r1 = job.finish(timeout=60)
    assert r1.returncode == 7
    msg, seconds, cause = r0.result
    assert msg.startswith("PeerClosedError") and "rank 1" in msg and "gone" in msg, msg
    assert cause == "JaxRuntimeError"
    assert seconds < 10, f"the error took {seconds:.1f}s"


_TIMEOUT = """
import pathlib
import jax, jax.numpy as jnp, ferro_jax as fj
fj.init(b)
done = pathlib.Path(sys.argv[1]) / "rank0-done"
if b.rank == 0:
    x = jnp.ones(3)
    # trace and compile first: the clock starts at the call whose deadline is measured
    call = jax.jit(lambda x: fj.allreduce(x, timeout=1.0)).lower(x).compile()
    start = time.monotonic()
    try:
        with fj.typed_errors():
            call(x).block_until_ready()
        result = "no error"
    except Exception as exc:
        result = [type(exc).__name__, str(exc), time.monotonic() - start]
    done.touch()
else:
    # rank 1 never calls; it stays open until rank 0 has its error (not a fixed sleep: had
    # rank 1 closed first, rank 0 would read "peer rank 1 is gone" instead of its timeout)
    hold = time.monotonic() + 30
    while not done.exists() and time.monotonic() < hold:
        time.sleep(0.05)
    result = None
"""


def test_a_deadline_inside_jit_is_the_timeout_error(tmp_path):
    r0, _ = [r.result for r in Job(_TIMEOUT, 2, backend="ShmBackend", timeout=30.0,
                                   args=[tmp_path]).finish(90)]
    name, msg, seconds = r0
    assert name == "CollectiveTimeoutError", msg
    # the 1 s deadline, not the backend's 30 s (10 leaves room for a loaded host's stalls)
    assert 0.9 < seconds < 10, seconds


def test_outside_jit_the_error_is_ferros_own():
    start = time.monotonic()
    out = run_processes(_eager_mismatch, 2, transport="shm", timeout=60)
    assert out == ["CollectiveMismatchError"] * 2
    assert time.monotonic() - start < 30


def _eager_mismatch(backend):
    import ferro_jax as fj
    import jax.numpy as jnp

    fj.init(backend)
    try:
        fj.all_gather(jnp.ones(3 + backend.rank))
    except Exception as exc:
        return type(exc).__name__
    return "no error"


def test_a_late_peer_never_completes_a_call_another_rank_gave_up_on(tmp_path):
    (_, first), (told, late) = run_processes(workers.late_peer, 2, str(tmp_path),
                                            transport="shm", timeout=120)
    assert told, late  # rank 1 called once rank 0's abort had reached it
    assert first.startswith("CollectiveTimeoutError"), first
    assert "rank 0 aborted the job" in late, late


def test_after_close_eager_calls_raise_peer_closed_and_a_new_default_reaches_jitted_ones():
    for out in run_processes(workers.closed_then_again, 2, transport="shm", timeout=180):
        assert out == [[3.0, 3.0], "barrier closed", "allreduce closed", [30.0, 30.0]], out
