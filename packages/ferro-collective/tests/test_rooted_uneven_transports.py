"""The rooted and uneven collectives with real processes: over TcpBackend, over ShmBackend (the same-host
engine, interleaved with its fast path; small slots without cross-memory reads for the pieced
paths) and over MpiBackend under mpirun."""


import pytest
import rooted_uneven_fns
from mpi_ranks import run_mpi

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


def test_over_mpi(tmp_path):
    assert run_mpi("rooted_uneven_fns", "suite", WORLD, tmp_path) == [[]] * WORLD
