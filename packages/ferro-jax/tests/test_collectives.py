"""ferro_jax's calls on real processes: every call in and out of jit against numpy, bit for bit
and the same bits on every rank, every dtype JAX has on CPU, world sizes 1-4, the engine's door
(shm) and the Python path (TCP); ordering without tokens; gradients; vmap."""

from __future__ import annotations

import sys

import pytest
import workers

from ferro_backend.testing import run_processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux engine")

ALL = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
       "float16", "bfloat16", "float32", "float64", "complex64", "complex128"]


def _check(results: list[dict], world: int, path: str) -> None:
    assert [r["bad"] for r in results] == [[]] * world
    assert len({r["digest"] for r in results}) == 1, "ranks returned different bits"
    for r in results:
        assert path in r["comm"], r["comm"]


def test_every_call_every_dtype_on_the_engine_2_ranks():
    results = run_processes(workers.every_call, 2, ALL, ["float32", "bfloat16", "int64", "bool"],
                            transport="shm", timeout=240)
    _check(results, 2, "engine slot")


@pytest.mark.parametrize("world", [3, 4])
def test_every_call_on_the_engine_3_and_4_ranks(world):
    names = ["float32", "bfloat16", "int32"] if world == 3 else ["float16", "uint8"]
    results = run_processes(workers.every_call, world, names, [], transport="shm", timeout=240)
    _check(results, world, "engine slot")


def test_every_call_on_the_python_path_over_tcp():
    results = run_processes(workers.every_call, 2,
                            ["float32", "bfloat16", "float16", "int32", "bool", "complex64"],
                            ["float32"], transport="tcp", timeout=240)
    _check(results, 2, "Python path")


def test_scalars_zero_size_and_barrier():
    results = run_processes(workers.scalars_and_barrier, 2, transport="shm", timeout=120)
    assert results == [[[1.0, 2.0], 3.0, 1.0, [0, 2], 2]] * 2


def test_odd_arrays_point_to_point_and_sub_byte_dtypes_refused():
    """0-d complex and bfloat16, zero-size arrays of two dims and float8_e5m2 failed on the
    Python path (a 0-d view, a flat cast, a type string numpy cannot read); int4 was read a
    byte a value past XLA's buffers (a wrong gather; a segfault at 2**22 values)."""
    results = run_processes(workers.odd_arrays, 2, transport="shm", timeout=180)
    for me, got in enumerate(results):
        peer = 1 - me
        *calls, int4 = got
        want = [(1 + 2j) * (peer + 1), float(peer + 1), None, None,
                [float(v + peer) for v in range(4)]]
        for k, (how, dtype, shape, values) in enumerate(calls):
            w = want[k // 2]
            if w is None:
                assert values == [] and shape in ([0, 3], [0]), (how, dtype, shape)
            else:
                assert values == (w if isinstance(w, list) else [w] if shape else w), (
                    how, dtype, values)
        assert "dtype int4 packs several values in a byte" in int4


def test_send_and_recv_inside_jit_never_deadlock():
    r0, r1 = run_processes(workers.ordering, 2, 50, transport="shm", timeout=120)
    # rank 0 received rank 1's a + b = x0 + 2 x0; rank 1 received x0; the allreduce x0 + x1
    assert r0 == [0.0 * 3, 999.0 * 3, 1.0, 1.0, 1.0]
    assert r1 == [0.0, 999.0, 1.0, 0.0, 1.0]


def test_the_chain_inside_and_the_order_between_computations():
    for res in run_processes(workers.chained, 2, 20, transport="shm", timeout=120):
        assert res == {"many": True, "nested": [True] * 4, "p2p": True}


def test_gradients():
    for res in run_processes(workers.grads, 2, transport="shm", timeout=180):
        assert res.pop("dp") is True
        for name, (lhs, rhs) in res.items():
            assert lhs == pytest.approx(rhs, rel=1e-10), name


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_ranks_that_disagree_on_differentiating_a_call_fail_at_it(transport):
    """A rank whose input to a linear call is a constant makes no derivative call: its peers'
    reduce (broadcast's transpose) met its next call (a mismatch naming other calls) or waited
    until the deadline. Now the forward call fails on every rank, saying why."""
    for rank, res in enumerate(run_processes(workers.differentiation_disagrees, 2,
                                             transport=transport, timeout=180)):
        for how in ("eager", "jit"):
            assert res[how].startswith("CollectiveMismatchError: broadcast"), res[how]
            assert "whose rank differentiates it" in res[how], res[how]
        assert res["fixed"] == ([3.0] * 3 if rank == 0 else [0.0] * 3)
        assert res["shapes"] == [True, True]


def test_vmap_batches_collectives_and_refuses_point_to_point():
    for same, refused in run_processes(workers.vmapped, 2, transport="shm", timeout=120):
        assert same == ["all_gather", "all_to_all", "allreduce", "gather_scalars",
                        "reduce_scatter"]
        assert "vmap" in refused


def test_the_engine_re_probes_between_jitted_calls(monkeypatch):
    # the door's re-probe runs in XLA's thread, before the call after one rank 0 marked
    monkeypatch.setenv("FERRO_SHM_REPROBE", "0.2")
    (f0, l0, ok0), (f1, l1, ok1) = run_processes(workers.reprobes_inside_jit, 2, 1.5,
                                                 transport="shm", timeout=120)
    assert f0 == f1 == 1 and l0 == l1 >= 3 and ok0 and ok1
