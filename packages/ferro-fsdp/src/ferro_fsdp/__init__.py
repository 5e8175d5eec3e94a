"""ferro-fsdp: fully sharded data parallel (FSDP: ZeRO-3, ZeRO-2, DDP, hybrid) for numpy models.

``FSDP`` and ``DistributedDataParallel`` wrap a ``Module``; ``ferro_fsdp.nn`` and
``ferro_fsdp.optim`` are enough to train a real model. The package README describes the
strategies, padding and state-dict format.
"""


from ferro_backend._version import version_getattr
from ferro_backend.partition import split_sizes, split_starts

from . import comm_hooks, nn, optim
from .ddp import DDP, DistributedDataParallel
from .errors import FSDPStateError
from .flat import FlatLayout
from .fsdp import FSDP
from .module import Module
from .parameter import Parameter
from .strategy import ShardingStrategy, StrategySpec

__all__ = [
    "DDP",
    "FSDP",
    "DistributedDataParallel",
    "FSDPStateError",
    "FlatLayout",
    "Module",
    "Parameter",
    "ShardingStrategy",
    "StrategySpec",
    "comm_hooks",
    "nn",
    "optim",
    "split_sizes",
    "split_starts",
]


__getattr__ = version_getattr(__name__, "ferro-fsdp")  # __version__, read when asked
