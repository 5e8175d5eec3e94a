"""Contracts found broken once: the order of jitted computations on different CPU devices,
dtypes of the same width named apart, recv and barrier refused under vmap, the Python path's
registrations bounded."""

from __future__ import annotations

import gc
import sys

import contract_workers
import ferro_jax as fj
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ferro_jax import _pypath

from ferro_backend import SimulatedBackend
from ferro_backend.testing import run_processes, run_ranks

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux engine")


@linux
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_computations_on_two_cpu_devices_run_in_dispatch_order(transport):
    for res in run_processes(contract_workers.two_devices, 2, transport=transport,
                             timeout=150, backend_timeout=30):
        assert res["devices"] == 2
        assert res["sums"] == [[3.0, 30.0]] * 3, res


@linux
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_dtypes_of_the_same_width_that_differ_are_a_mismatch(transport):
    results = run_processes(contract_workers.other_float8, 2, transport=transport, timeout=150,
                            backend_timeout=30)
    for rank, res in enumerate(results):
        for name in ("float8", "bfloat16"):
            for how in ("jit", "eager"):
                got = res[f"{name} {how}"]
                assert isinstance(got, str) and got.startswith("CollectiveMismatchError"), \
                    (rank, name, how, got)
        assert "float8_e4m3fn" in res["float8 jit"] and "float8_e5m2" in res["float8 jit"]
        assert res["same"] == [1.5, 1.5, 2.5, 2.5]


def test_recv_and_barrier_under_vmap_raise():
    def rank_main(backend):
        rank = backend.rank
        xb = jnp.ones((3, 4)) * rank
        out = {}
        calls = {"barrier": lambda v: fj.barrier(backend=backend, timeout=5),
                 "recv": lambda v: v + fj.recv(v, 1 - rank, backend=backend, timeout=5),
                 "send": lambda v: fj.send(v, 1 - rank, backend=backend),
                 "jit recv": jax.jit(lambda v: fj.recv(v, 1 - rank, backend=backend,
                                                       timeout=5))}
        for name, f in calls.items():
            try:
                jax.vmap(f)(xb)
                out[name] = "ran"
            except Exception as exc:  # (before the fix: recv timed out, having run)
                out[name] = f"{type(exc).__name__}: {exc}"
        # an unbatched collective under vmap still runs (once), batched ones as before
        const = jax.vmap(lambda v: fj.allreduce(jnp.full(2, rank + 1.0), backend=backend,
                                                timeout=5) + v)(jnp.zeros((3, 2)))
        out["const"] = np.asarray(const).tolist()
        return out

    for res in run_ranks(rank_main, 2, timeout=60):
        for name in ("barrier", "recv", "send", "jit recv"):
            assert res[name].startswith("NotImplementedError") and "under jax.vmap" in res[name], \
                (name, res[name])
        assert res["const"] == [[3.0, 3.0]] * 3


def test_python_path_registrations_do_not_grow_with_retraces():
    (backend,) = SimulatedBackend.create_group(1)

    def rounds():
        for i in range(6):
            f = jax.jit(lambda x: fj.all_gather(x, backend=backend))
            f(jnp.ones(i + 1)).block_until_ready()

    rounds()
    jax.clear_caches()
    gc.collect()
    before = len(_pypath._calls)
    for _ in range(3):
        rounds()
        jax.clear_caches()
        gc.collect()
    assert len(_pypath._calls) == before
    # another shape is another call
    jax.jit(lambda x: fj.all_gather(x, backend=backend))(jnp.ones(99)).block_until_ready()
    assert len(_pypath._calls) == before + 1
