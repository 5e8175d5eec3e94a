"""Where the ranks landed: the link probe between the ranks' cores (``_probe.h``).

A VM's cores may share a cache or not, and which a job's ranks get can change while it runs
(the hypervisor moves them; the kernel's cache topology reads the same either way). Measured on
this project's two-core VM, 2 ranks, three states: a cache line's round trip between the ranks'
cores 28-60 ns, 88-133 ns or 426-476 ns, a 64 KiB copy from one core to the other at 24-27,
5-7 or 1.5-2 GB/s; a state lasted from under a second to minutes (``benchmarks/README.md``,
"0.4, issue 55").

:func:`probe` runs the probe on an engine (every rank at once; the ranks spin, so never where
they outnumber the cores); :attr:`Engine.link <.segment.Engine.link>` is the latest result:
the join's, :meth:`Engine.probe_link <.segment.Engine.probe_link>`'s, or the engine's own
re-probe. The engine probes again by itself (``door.c``: every rank before the same call) when
rank 0's copies into shared memory change speed by 2x either way (at most every 0.5 s), and at
least every ``FERRO_SHM_REPROBE`` seconds (default 10; 0: never) while calls run. A probe takes
0.2-0.3 ms on 2 ranks here. ``ShmBackend.describe()`` and the timeline (an ``engine`` event per
probe this process asked for) say which state a job runs in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import timeline
from . import _segment

if TYPE_CHECKING:
    from .segment import Engine

#: the bytes of the probe's copies (at most a slot; _probe.h's, the door's re-probes too)
COPY_BYTES = _segment.PROBE_BYTES
#: a round trip of a cache line below this many ns: the ranks' cores share a cache
SHARED_CACHE_NS = 75.0


@dataclass(frozen=True)
class Link:
    """One probe's result, the same on every rank: the slowest pair's (rank 0 and each other
    rank in turn)."""

    #: median round trip of a cache line between the ranks' cores, ns
    rtt_ns: float
    #: rate of a copy (64 KiB, or a slot where slots are smaller) written by rank 0's core and
    #: read by the peer's, GB/s (median)
    copy_gbps: float
    #: when it ran (``time.time()``: rank 0's clock)
    at: float
    #: its number among the job's probes (1: the one as the job formed)
    probe: int = 1

    @property
    def shared_cache(self) -> bool:
        """Whether the ranks' cores share a cache (a round trip below
        :data:`SHARED_CACHE_NS`)."""
        return self.rtt_ns < SHARED_CACHE_NS

    def describe(self) -> str:
        """In words, as ``ShmBackend.describe()`` shows it."""
        state = "share a cache" if self.shared_cache else "share no cache"
        return (f"the ranks' cores {state} (a cache line's round trip {self.rtt_ns:.0f} ns, "
                f"copies from core to core {self.copy_gbps:.1f} GB/s)")


def probe(engine: Engine, timeout: float) -> Link:
    """Run the link probe on ``engine`` (every rank at once, nothing else on the engine
    meanwhile); raises TimeoutError or ConnectionError as ``SegmentMap.probe_links``."""
    t0 = time.time_ns() / 1000.0
    engine._map.probe_links(timeout, nbytes=min(COPY_BYTES, engine.slot_bytes))
    link = engine.link
    assert link is not None  # (rank 0 stamped it before any rank returned)
    rtt, gbps = link.rtt_ns, link.copy_gbps
    timeline.record("link probe", "engine", t0, time.time_ns() / 1000.0 - t0,
                    rtt_ns=round(rtt, 1), copy_gbps=round(gbps, 2),
                    shared_cache=link.shared_cache)
    return link


__all__ = ["COPY_BYTES", "SHARED_CACHE_NS", "Link", "probe"]
