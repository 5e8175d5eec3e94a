"""Real processes: FSDP and DDP training over TcpBackend matches one process on the whole batch."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _helpers import assert_close_rel, make_data, reference_training

from ferro_backend.testing import free_port

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from _helpers import full_params, make_data, make_mlp, make_opt, train_steps, wrap
    from ferro_backend import TcpBackend
    from ferro_fsdp import nn

    b = TcpBackend.from_env(timeout=60.0)
    world = b.world_size
    x, y = make_data(16)
    per = 16 // world
    sl = slice(b.rank * per, (b.rank + 1) * per)
    strategy = sys.argv[1]
    w = wrap(make_mlp(), b, strategy, 2 if strategy == "hybrid_shard" else None)
    opt = make_opt("adam", w.module.parameters())
    train_steps(w, opt, nn.CrossEntropyLoss(), x[sl], y[sl], 6, prefetch=strategy == "full_shard")
    np.savez(sys.argv[2], **full_params(w))
    b.close()
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy,world", [("full_shard", 2), ("hybrid_shard", 4), ("ddp", 2)])
def test_training_over_tcp_processes(tmp_path, strategy, world):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    port = free_port()
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(script), strategy,
                                       str(tmp_path / f"rank{r}.npz")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=150))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out}\n{err}"
    x, y = make_data(16)
    ref, _ = reference_training("adam", 6, x, y)
    for r in range(world):
        got = np.load(tmp_path / f"rank{r}.npz")
        for name in ref:
            assert_close_rel(got[name], ref[name], 1e-10)
