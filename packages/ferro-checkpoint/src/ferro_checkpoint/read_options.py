"""How a load reads: the keywords of ``load_distributed``, ``reshard``, ``consolidate`` and
``CheckpointManager.restore`` (``verify``, ``mmap``, ``out``, ``threads``), checked once."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .errors import InvalidArgumentError

MAX_THREADS = 8


def default_threads() -> int:
    """Threads per load: the CPUs this process may use, shared with the other ranks on the host
    (``LOCAL_WORLD_SIZE``, set by ferrorun and torchrun), at most :data:`MAX_THREADS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(MAX_THREADS, cpus // local))


def resolve_threads(threads, op: str) -> int:
    """``threads`` itself (an int >= 1), or :func:`default_threads` for None."""
    if threads is None:
        return default_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidArgumentError(f"{op}: threads {threads!r:.40} must be an int >= 1 or None")
    return threads


def resolve_verify(verify: bool | None, op: str) -> bool:
    """``verify`` itself when a bool, True when None (the default); anything else raises
    InvalidArgumentError naming it."""
    if verify is None:
        return True
    if isinstance(verify, bool):
        return verify
    raise InvalidArgumentError(f"{op}: verify {verify!r:.40} must be True, False or None")


@dataclass
class ReadOptions:
    """How a load reads (the keywords of :func:`load_distributed`, checked)."""

    verify: bool = True
    lazy: bool = False
    mmap: bool = False
    out: Mapping[str, np.ndarray] | None = None
    threads: int = 1

    @classmethod
    def of(cls, op: str, verify=None, mmap=False, out=None, threads=None) -> ReadOptions:
        if not isinstance(mmap, bool):
            raise InvalidArgumentError(f"{op}: mmap {mmap!r:.40} must be True or False")
        lazy = isinstance(verify, str) and verify == "lazy"
        if lazy and not mmap:
            raise InvalidArgumentError(f"{op}: verify='lazy' needs mmap=True (copies are "
                                       "verified as they are read)")
        if out is not None and (mmap or not isinstance(out, Mapping)):
            raise InvalidArgumentError(
                f"{op}: out must be a mapping of names to arrays, and not with mmap=True "
                f"(got {type(out).__name__}, mmap={mmap})")
        return cls(True if lazy else resolve_verify(verify, op), lazy, mmap, out,
                   resolve_threads(threads, op))


