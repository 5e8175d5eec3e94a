"""The records of the collectives with a public call in :mod:`.api`: each names its collective,
the function that checks and plans a call of it (in the collective's own module), and its
one-call path on the engine's door (``_fastcall``'s kind), if it has one. The dispatcher
(:func:`.dispatch.run`) takes a record and a call's arguments; :mod:`.api` and the compressed
forms (:mod:`.wire`) call through the same records."""

from __future__ import annotations

from . import _fastcall, rooted
from . import all_gather as _all_gather
from . import allreduce as _allreduce
from . import barrier as _barrier
from . import broadcast as _broadcast
from . import reduce_scatter as _reduce_scatter
from .dispatch import Collective

ALLREDUCE = Collective("allreduce", _allreduce.prepare, _fastcall.ALLREDUCE)
BROADCAST = Collective("broadcast", _broadcast.prepare, _fastcall.BROADCAST)
ALL_GATHER = Collective("all_gather", _all_gather.prepare, _fastcall.ALL_GATHER)
REDUCE_SCATTER = Collective("reduce_scatter", _reduce_scatter.prepare, _fastcall.REDUCE_SCATTER)
BARRIER = Collective("barrier", _barrier.prepare, _fastcall.BARRIER)
REDUCE = Collective("reduce", rooted.prepare_reduce)
GATHER = Collective("gather", rooted.prepare_gather, _fastcall.GATHER)
SCATTER = Collective("scatter", rooted.prepare_scatter)

__all__ = ["ALLREDUCE", "ALL_GATHER", "BARRIER", "BROADCAST", "GATHER", "REDUCE",
           "REDUCE_SCATTER", "SCATTER"]
