"""Run torch's own multi-process c10d suite (``DistributedTest._DistTestBase``, shipped in the
torch wheel) against backend "gloo" or "ferro", and record each test's outcome.

Usage:
  python tools/torch_suite/run_suite.py --backend ferro [--world-size 2] [--out out.json]
         [--expected expected_gloo_ws2.json] [-k SUBSTRING ...] [TEST_NAME ...]

The suite is configured as torch's own runner (test/distributed/test_distributed_spawn.py, not
in the wheel) configures it for gloo: BACKEND, WORLD_SIZE, TEMP_DIR (with ``barrier`` and
``test_dir``), file:// init, spawn start method. Under ``--backend ferro`` the suite's gates
are read as for gloo (``BACKEND`` is "gloo" while the module is imported, so every
``BACKEND != "gloo"`` skip and ``require_backend_is_available({"gloo"})`` decides as it does for
gloo), then the tests run with ``BACKEND`` the string "ferro" that also compares equal to
"gloo" (:class:`FerroAsGloo`): ``init_process_group`` makes a "ferro" group, a test body's
``if BACKEND == "gloo":`` takes gloo's branch, and every table of ``DistTestCases`` that lists
gloo lists ferro too.
So a test gloo runs is never skipped on ferro for its name. The one gate torch itself keeps
(``dist.monitored_barrier`` accepts only a backend named "gloo") is replaced by
``ferro_torch.monitored_barrier``, the same function without that check.

Outcomes (passed, failed, skipped) go to ``--out`` as JSON; with ``--expected`` (a previous run's
JSON, e.g. gloo's), every test whose outcome differs is listed and the exit status is 1 if any
test that passed there does not pass here.
"""

from __future__ import annotations

import os
import sys

#: which backend the spawned ranks use (children inherit it through the environment)
MODE = os.environ.setdefault("FERRO_SUITE_BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ["BACKEND"] = "gloo"  # the gates are read as for gloo, in the parent and the ranks
os.environ.setdefault("TEMP_DIR", "/tmp")  # replaced per test by TestDistBackend.setUp

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal import common_distributed as cd  # noqa: E402
from torch.testing._internal.distributed import distributed_test as dt  # noqa: E402

torch.set_num_threads(1)


class FerroAsGloo(str):
    """The suite's ``BACKEND`` while the tests run on ferro: the string "ferro" (what
    ``init_process_group(backend=BACKEND)``, ``BACKEND.lower()`` and ``dist.Backend(BACKEND)``
    see) that compares equal to "gloo" too, so a test body's ``if BACKEND == "gloo":`` takes
    gloo's branch on ferro."""

    def __eq__(self, other: object) -> bool:
        return other in ("gloo", "ferro") if isinstance(other, str) else NotImplemented

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other) if isinstance(other, str) else NotImplemented

    __hash__ = str.__hash__


def _take_gloo_gates_as_ferro() -> None:
    """Run the suite on "ferro" with every gloo gate read as passing for ferro."""
    import ferro_torch  # registers "ferro"

    dt.BACKEND = FerroAsGloo("ferro")
    # torch's own monitored_barrier refuses any backend not named "gloo" (a gate in
    # distributed_c10d.py, not in the suite): ferro_torch's is the same function without it
    dist.monitored_barrier = ferro_torch.monitored_barrier
    for table in (cd.DistTestCases.skip_collective, cd.DistTestCases.backend_feature):
        for names in table.values():
            if "gloo" in names:
                names.add("ferro")
    # not the profiling tables (PROFILING_SUPPORTED_BACKENDS...): they are not gates but ask
    # for torch profiler events named "<backend>:<op>", which ferro does not record


if MODE == "ferro":
    _take_gloo_gates_as_ferro()
elif MODE != "gloo":
    raise SystemExit(f"FERRO_SUITE_BACKEND {MODE!r}: expected 'gloo' or 'ferro'")


class TestDistBackendWithSpawn(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
    """torch's suite, each test's ranks started with the spawn method (as upstream's runner)."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    from _suite_main import main

    sys.exit(main(TestDistBackendWithSpawn, MODE))
