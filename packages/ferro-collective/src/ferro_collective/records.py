"""Every collective's record, in one list: each is declared in its collective's own module
(:class:`.plan.Collective`: its name, its ``prepare`` with the checks and the plans, its
algorithms, its one-call path on the engine's door, the names of its torch and JAX bindings).
The dispatcher reads a record when it runs a call, :mod:`.api` hands it the public calls'
records; nothing registers itself anywhere by being imported. Adding a collective is writing
its record (see ``docs/guide/architecture.md``)."""

from __future__ import annotations

from .all_gather import ALL_GATHER
from .allreduce import ALLREDUCE
from .barrier import BARRIER
from .broadcast import BROADCAST
from .exchange import ALL_GATHER_V, ALL_TO_ALL, ALL_TO_ALL_SINGLE
from .objects import ALL_GATHER_OBJECT, BROADCAST_OBJECT
from .plan import Collective
from .reduce_scatter import REDUCE_SCATTER
from .rooted import GATHER, REDUCE, SCATTER

#: every collective ferro-collective has, in the order of its header codes
ALL: tuple[Collective, ...] = (
    BARRIER, ALLREDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER, REDUCE, GATHER, SCATTER,
    ALL_GATHER_V, ALL_TO_ALL, ALL_TO_ALL_SINGLE, BROADCAST_OBJECT, ALL_GATHER_OBJECT)
#: each record by its name
BY_NAME: dict[str, Collective] = {c.name: c for c in ALL}
#: every collective's algorithms by name, those whose public call takes no ``algorithm=`` too
#: (reduce, gather, scatter, all_gather_v, all_to_all: "auto" picks among them; a plan of
#: their records may force one, as the tests do)
ALL_ALGORITHMS: dict[str, tuple[str, ...]] = {c.name: c.algorithms for c in ALL if c.algorithms}
#: the collectives whose public call (and its ``*_async`` form) takes ``algorithm=``
CHOOSABLE: tuple[str, ...] = ("allreduce", "broadcast", "all_gather", "reduce_scatter")
#: the algorithms a user may pick, by collective: those with an ``algorithm=`` argument only
#: ("auto": the measured thresholds up to 4 ranks, the cost model beyond; a forced one must be
#: the same on every rank)
ALGORITHMS: dict[str, tuple[str, ...]] = {n: ALL_ALGORITHMS[n] for n in CHOOSABLE}

__all__ = ["ALGORITHMS", "ALL", "ALLREDUCE", "ALL_ALGORITHMS", "ALL_GATHER", "ALL_GATHER_OBJECT",
           "ALL_GATHER_V", "ALL_TO_ALL", "ALL_TO_ALL_SINGLE", "BARRIER", "BROADCAST",
           "BROADCAST_OBJECT", "BY_NAME", "CHOOSABLE", "GATHER", "REDUCE", "REDUCE_SCATTER",
           "SCATTER"]
