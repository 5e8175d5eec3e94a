"""ferro-fsdp: fully sharded data parallel (FSDP: ZeRO-3, ZeRO-2, DDP, hybrid) for numpy models.

``FSDP`` and ``DistributedDataParallel`` wrap a ``Module``; ``ferro_fsdp.nn`` and
``ferro_fsdp.optim`` are enough to train a real model. See ``../../shared/API.md`` for the contract.
"""

from importlib.metadata import version as _version

from . import nn, optim
from .ddp import DDP, DistributedDataParallel
from .errors import FSDPStateError
from .flat import FlatLayout, split_sizes, split_starts
from .fsdp import FSDP
from .module import Module, Parameter
from .strategy import ShardingStrategy

__version__ = _version("ferro-fsdp")

__all__ = [
    "DDP",
    "FSDP",
    "DistributedDataParallel",
    "FSDPStateError",
    "FlatLayout",
    "Module",
    "Parameter",
    "ShardingStrategy",
    "nn",
    "optim",
    "split_sizes",
    "split_starts",
]
