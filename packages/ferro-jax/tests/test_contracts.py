"""Contracts found broken once: the order of jitted computations on different CPU devices,
dtypes of the same width named apart, recv and barrier refused under vmap, the Python path's
registrations bounded."""

from __future__ import annotations

import sys

import contract_workers
import pytest

from ferro_backend.testing import run_processes

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux engine")


@linux
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_computations_on_two_cpu_devices_run_in_dispatch_order(transport):
    for res in run_processes(contract_workers.two_devices, 2, transport=transport,
                             timeout=150, backend_timeout=30):
        assert res["devices"] == 2
        assert res["sums"] == [[3.0, 30.0]] * 3, res
