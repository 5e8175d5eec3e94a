"""ferro-collective: collectives on numpy arrays over any ferro_backend.Backend.

allreduce, broadcast, all_gather, reduce_scatter and barrier; the rooted reduce, gather and
scatter (``ferro_collective.rooted``); the uneven all_gather_v, all_to_all and all_to_all_single
(``ferro_collective.exchange``); broadcast_object and all_gather_object on picklable objects
(``ferro_collective.objects``); the ``*_async`` forms returning :class:`Work`.
"""


from ferro_backend import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistributedError,
    InvalidRankError,
    PeerAbortedError,
    PeerClosedError,
    SizeMismatchError,
)
from ferro_backend._version import version_getattr

from . import (
    dispatch,  # noqa: F401 - the compiled dispatcher and its one-call paths, imported unconditionally
    elastic,
    wire,
)
from .api import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    all_gather,
    all_reduce,
    allreduce,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from .api_async import (
    all_gather_async,
    allreduce_async,
    broadcast_async,
    gather_async,
    reduce_async,
    reduce_scatter_async,
    scatter_async,
)
from .api_uneven import (
    all_gather_object,
    all_gather_v,
    all_gather_v_async,
    all_to_all,
    all_to_all_async,
    all_to_all_single,
    all_to_all_single_async,
    broadcast_object,
)
from .header import set_mismatch_check
from .learn import learn_network
from .ops import ReduceOp
from .p2p import set_stall_report
from .records import ALGORITHMS
from .work import Work

__all__ = [
    "ALGORITHMS",
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DistributedError",
    "InvalidRankError",
    "PeerAbortedError",
    "PeerClosedError",
    "ReduceOp",
    "SizeMismatchError",
    "Work",
    "all_gather",
    "learn_network",
    "all_gather_async",
    "all_gather_object",
    "all_gather_v",
    "all_gather_v_async",
    "all_reduce",
    "all_to_all",
    "all_to_all_async",
    "all_to_all_single",
    "all_to_all_single_async",
    "allreduce",
    "allreduce_async",
    "barrier",
    "broadcast",
    "broadcast_async",
    "broadcast_object",
    "elastic",
    "gather",
    "gather_async",
    "reduce",
    "reduce_async",
    "reduce_scatter",
    "reduce_scatter_async",
    "scatter",
    "scatter_async",
    "set_mismatch_check",
    "set_stall_report",
    "wire",
]


__getattr__ = version_getattr(__name__, "ferro-collective")  # __version__, read when asked
