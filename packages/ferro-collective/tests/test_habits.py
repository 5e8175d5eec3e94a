"""What torch and mpi4py users' hands expect: torch's names, an op passed where the root goes,
and a closed backend that stays closed (on threads, TCP and the engine)."""

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
                 lambda: fc.barrier(b, timeout=5)):
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
    assert res == [[("closed", True)] * 3] * 2
