"""Compiled kernels every platform builds: the reduction kernel (:mod:`._fold`)."""

from . import _fold

__all__ = ["_fold"]
