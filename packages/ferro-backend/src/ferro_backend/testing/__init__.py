"""Helpers for testing code that runs on several ranks (public, like an in-memory exporter).

Threads over the simulated backend:

- :func:`run_ranks` runs one function per rank in threads over a :class:`SimulatedBackend` group,
  joins every thread with a timeout, and re-raises the first rank's error; :func:`run_threads`
  does the same over backends you made.

Real processes on 127.0.0.1 (every package's multi-process tests use these two, nothing else):

- :func:`run_processes` runs a module-level function as every rank of a real job (spawned
  processes, TCP or shared-memory transport) and returns each rank's result;
- :class:`Job` starts a Python snippet (or script) as the ranks of a job with the torchrun
  environment set, for tests that kill ranks, watch their output or check exit codes.

Both reap every process they started, on success, failure and timeout alike.
:func:`free_port` finds a free TCP port on 127.0.0.1, :func:`find_mpirun` the ``mpirun`` a test
under MPI runs, :func:`in_fork` runs a function in a forked child. :func:`check_backend` (from
:mod:`.conformance`) checks a transport written outside ferro against the Backend contract,
:func:`check_any_source` its receives from any rank.
"""

from ..mesh.rendezvous import free_port
from .any_source import check_any_source
from .conformance import check_backend
from .processes import Job, RankResult, find_mpirun, in_fork, run_job, run_processes
from .threads import RankFailure, outcomes, run_ranks, run_threads

__all__ = ["Job", "RankFailure", "RankResult", "check_any_source", "check_backend",
           "find_mpirun", "free_port", "in_fork", "outcomes", "run_job", "run_processes", "run_ranks",
           "run_threads"]
