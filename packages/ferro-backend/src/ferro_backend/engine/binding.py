"""Binding an engine's ranks to cores of their own (``FERRO_SHM_BIND``), as MPI does by default.

The engine's waits spin while every rank has a core of its own. Linux does not know that: it
often starts two freshly woken ranks of a job on one core (it places a task woken by another
near its waker), and there each spin keeps the peer it waits for from running. Measured here
(2 ranks on 2 cores, 4 KiB allreduce, a timed cell of 200 calls right after the job formed):
1.8-2.3 us per call in most runs, 100-117 us in some (the whole spin, then a sleep, per call),
until the scheduler moved one rank away. Bound, each rank keeps its core from the start.

``auto`` (the default) binds when the engine's ranks are exactly as many as the cores this
process may use (every core runs a rank anyway), or a whole multiple of them; ``cores`` binds
whenever there are at least as many cores as ranks, or the ranks are a whole multiple of the
cores (two jobs on one host then share cores: set it only for one job per host); ``off`` never
binds; nor does any mode where ranks of other nodes share the host (``FERRO_HOST_RANKS``:
emulated nodes), which would be bound to the same cores. The calling thread (the rank's) is
bound to the ``rank % cores``-th of the usable cores in order; :func:`unbind` gives it its
earlier set back.

More ranks than cores (their waits yield): bound, k ranks to each core, the cores share the
work evenly from the first call, as Intel MPI pins them. Unbound, Linux sometimes leaves three
of 4 ranks on one of 2 cores (a yielding rank looks busy to its load balancer): 4 ranks on 2
cores here, a 1 MiB reduce_scatter read 68-78 us in 5 of 5 bound launches, 68-105 unbound, and
a 1 MiB allreduce 115-123 against 116-192. A count that is not a multiple (3 ranks on 2 cores)
stays unbound: one core would carry two ranks and the other one, and bound that way they read
no better than unbound here (1 MiB allreduce 108-151 us against 115-157).
"""

from __future__ import annotations

import os

from .. import settings


def host_ranks(nranks: int) -> int:
    """The ranks running on this host: an engine's ``nranks``, or more where other nodes of the
    job share the host (``FERRO_HOST_RANKS``, which ``ferrorun --emulate-nodes`` sets)."""
    return max(nranks, settings.HOST_RANKS.get() or 0)


def usable_cores() -> list[int]:
    """The cores this thread may run on, in order (empty where the platform cannot tell)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


def bind(rank: int, nranks: int) -> frozenset[int] | None:
    """Bind the calling thread to a core of its own per ``FERRO_SHM_BIND``; returns the set it
    had before (for :func:`unbind`), or None when it did not bind."""
    mode = settings.SHM_BIND.get()
    cores = usable_cores()
    if mode == "off" or not cores or not 0 <= rank < nranks or host_ranks(nranks) > nranks:
        return None  # (ranks of other nodes on this host would be bound to the same cores)
    multiple = nranks > len(cores) and nranks % len(cores) == 0
    if not multiple and (len(cores) < nranks or (mode == "auto" and len(cores) != nranks)):
        return None
    before = frozenset(cores)
    try:
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    except OSError:  # a cgroup or seccomp policy may refuse it: run unbound
        return None
    return before


def unbind(before: frozenset[int] | None) -> None:
    """Give the calling thread back the cores :func:`bind` took from it (nothing if it did not
    bind)."""
    if before is None:
        return
    try:
        os.sched_setaffinity(0, before)
    except OSError:
        pass


__all__ = ["bind", "host_ranks", "unbind", "usable_cores"]
