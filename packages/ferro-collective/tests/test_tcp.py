"""The collectives over TcpBackend with real processes (world sizes 2 and 4)."""

import numpy as np
import pytest
from tcp_fns import suite

from ferro_backend.testing import run_processes

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_over_tcp(world):
    results = run_processes(suite, world, 7)
    xs = [np.frombuffer(r["inputs"], np.float32) for r in results]
    first = results[0]
    for r, res in enumerate(results):
        for key in ("allreduce-ring", "allreduce-recursive_doubling", "allreduce-star", "mean"):
            assert res[key] == first[key], (r, key)  # bit-identical on every rank
        assert res["max"] == [world - 1, 0]
        assert res["gather"] == np.repeat(np.arange(world), 2)[:, None].repeat(3, 1).tolist()
        rs_full = (world * np.arange(4 * world, dtype=np.float64)).reshape(2 * world, 2)
        assert res["rs"] == rs_full[2 * r:2 * r + 2].tolist()
        assert res["bcast"] == [7 * (world - 1)]
        assert res["async"] == [list(range(world)), [sum(range(world))] * 3, [world] * 5]
    ref = np.sum(np.stack(xs).astype(np.float64), axis=0)
    for key in ("allreduce-ring", "allreduce-recursive_doubling", "allreduce-star"):
        np.testing.assert_allclose(np.frombuffer(first[key], np.float32), ref, rtol=1e-4,
                                   atol=1e-4)
