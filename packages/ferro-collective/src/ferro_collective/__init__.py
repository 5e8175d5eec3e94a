"""ferro-collective: allreduce, broadcast, all_gather, reduce_scatter and barrier on numpy arrays."""

from importlib.metadata import version as _version

from ferro_backend import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistributedError,
    InvalidRankError,
    PeerAbortedError,
    PeerClosedError,
    SizeMismatchError,
)

from . import _reduce  # noqa: F401 - the compiled kernel, imported unconditionally
from .algorithms import set_stall_report
from .api import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    all_gather,
    all_gather_async,
    allreduce,
    allreduce_async,
    barrier,
    broadcast,
    broadcast_async,
    reduce_scatter,
    reduce_scatter_async,
)
from .call import ALGORITHMS
from .header import set_mismatch_check
from .ops import ReduceOp
from .work import Work

__version__ = _version("ferro-collective")

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
    "all_gather_async",
    "allreduce",
    "allreduce_async",
    "barrier",
    "broadcast",
    "broadcast_async",
    "reduce_scatter",
    "reduce_scatter_async",
    "set_mismatch_check",
    "set_stall_report",
]
