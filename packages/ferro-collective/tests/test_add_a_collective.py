"""Adding a collective touches only its own module: ``scan`` (the inclusive prefix reduction,
MPI_Scan: rank r gets op(x_0, ..., x_r)) is declared here by its record alone (its checks, its
plan and its point-to-point body) and runs through the dispatcher on every transport: simulated
ranks as threads, TCP and the same-host engine as processes, MPI under mpirun. Its header
check, its argument checks and its algorithm check are the dispatcher's, as for ferro's own.
``docs/guide/architecture.md`` ("how to add a collective") walks through this module."""


import numpy as np
import pytest
from mpi_ranks import run_mpi

from ferro_backend import CollectiveMismatchError
from ferro_backend.testing import run_processes, run_ranks
from ferro_collective import ReduceOp
from ferro_collective.arguments import as_array, check_out
from ferro_collective.dispatch import run
from ferro_collective.ops import accumulate, as_op
from ferro_collective.plan import Collective, Plan, choose

pytestmark = pytest.mark.timeout(120)
SCAN_OPS = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN)


def prepare_scan(tensor, backend, op, timeout, algorithm, out, seq=None) -> Plan:
    """The checked plan of one scan: every rank's input of one dtype and shape (the header
    every rank compares says so), ``op`` one of SUM, MAX, MIN."""
    x = as_array("scan", tensor, backend)
    op = as_op(op)
    if op not in SCAN_OPS:
        raise ValueError(f"scan: op {op.name} is not one of {[o.name for o in SCAN_OPS]}")
    choose(SCAN, algorithm, x.nbytes, backend.world_size)  # an unknown algorithm raises now
    out = check_out("scan", out, x.shape, x.dtype)

    def chain(ctx) -> np.ndarray:
        """Rank r takes the prefix of ranks 0..r-1 from r-1, adds its own, passes it on."""
        acc = np.array(x, order="C", copy=True).reshape(-1)
        tag = ctx.next_tag()
        if ctx.rank > 0:
            prefix = ctx.take(acc.size, acc.dtype)
            ctx.wait(ctx.irecv(prefix, ctx.rank - 1, tag), ctx.rank - 1, "the prefix")
            accumulate(prefix, acc, op)  # prefix = op(prefix, mine): the ranks' order
            acc[...] = prefix
        if ctx.rank < ctx.n - 1:
            ctx.send(acc, ctx.rank + 1, tag)
        result = acc.reshape(x.shape)
        if out is None:
            return result
        out[...] = result
        return out

    return Plan("scan", backend, timeout, (x.dtype, x.shape, op, -1), chain,
                algorithm=algorithm, seq=seq)


#: the whole of what adds ``scan`` to ferro-collective: its record
SCAN = Collective("scan", prepare_scan, algorithms=("auto", "chain"))


def scan(tensor, backend, op=ReduceOp.SUM, *, timeout=None, algorithm=None, out=None):
    """The public call a module would give it (as :mod:`ferro_collective.api` does)."""
    return run(SCAN, tensor, backend, op, timeout, algorithm, out)


def scan_suite(b) -> list[str]:
    """Scans of several dtypes, shapes and ops, interleaved with ferro's own collectives,
    against numpy's reference; the failures."""
    import ferro_collective as fc

    n, r = b.world_size, b.rank
    bad = []
    for dtype, shape, op in [(np.int64, (5,), ReduceOp.SUM), (np.float64, (3, 4), ReduceOp.MAX),
                             (np.int32, (70_000,), ReduceOp.MIN), (np.float32, (), ReduceOp.SUM)]:
        xs = [(np.arange(int(np.prod(shape))).reshape(shape) * (k + 1) % 7 - k).astype(dtype)
              for k in range(n)]
        want = xs[0].copy()
        for k in range(1, r + 1):
            want = {ReduceOp.SUM: np.add, ReduceOp.MAX: np.maximum,
                    ReduceOp.MIN: np.minimum}[op](want, xs[k]).astype(dtype)
        got = scan(xs[r], b, op)
        if got.dtype != dtype or got.shape != shape or got.tobytes() != want.tobytes():
            bad.append(f"scan {np.dtype(dtype).name}{shape} {op.name}")
        total = fc.allreduce(np.array([r], np.int64), b)  # ferro's own, in between
        if total.tolist() != [n * (n - 1) // 2]:
            bad.append("allreduce between scans")
    out = np.empty(3, np.int64)
    if scan(np.full(3, r + 1), b, out=out) is not out or out.tolist() != [sum(range(1, r + 2))] * 3:
        bad.append("scan out=")
    return bad


def test_the_record_is_all_it_takes():
    assert SCAN.kind is None and SCAN.algorithms == ("auto", "chain")
    assert run_ranks(scan_suite, 3, timeout=60) == [[]] * 3


def test_its_checks_are_the_dispatchers():
    def mismatched(b):
        with pytest.raises(CollectiveMismatchError, match="scan"):
            scan(np.zeros(2 + b.rank), b, timeout=10)
        return "mismatch"

    assert run_ranks(mismatched, 2, timeout=60) == ["mismatch"] * 2

    def refused(b):
        if b.rank == 0:
            with pytest.raises(ValueError, match="op PRODUCT is not one of"):
                scan(np.zeros(2), b, ReduceOp.PRODUCT, timeout=10)
        else:  # the peer learns of rank 0's refusal in the same call, with its reason
            with pytest.raises(CollectiveMismatchError, match="PRODUCT"):
                scan(np.zeros(2), b, timeout=10)
        with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
            scan(np.zeros(2), b, algorithm="tree")
        return "refused"

    assert run_ranks(refused, 2, timeout=60) == ["refused"] * 2


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_on_real_processes(transport):
    assert run_processes(scan_suite, 3, transport=transport, timeout=90) == [[]] * 3


def test_under_mpirun(tmp_path):
    assert run_mpi("test_add_a_collective", "scan_suite", 3, tmp_path, timeout=90) == [[]] * 3
