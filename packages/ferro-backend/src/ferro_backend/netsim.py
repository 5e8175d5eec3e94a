"""A modelled network for :class:`~ferro_backend.SimulatedBackend`, in virtual time.

``SimulatedBackend.create_group(n, network=Network(...))`` gives every rank a virtual clock
(``backend.clock``, seconds). Every message is charged to it with the Hockney (alpha-beta)
model of its link: the sender's network interface sends one message at a time (a message of
``b`` bytes keeps it busy ``b / bandwidth`` seconds, after what it sent before), and the
message arrives ``latency`` seconds after it has left; a receive completes, in virtual time, at
``max(receiver's clock, arrival)``. Ranks on one node (``ranks_per_node``) talk over the
intra-node link, others over the network. Local work (copies, reductions) costs nothing: the
clocks measure communication only.

The virtual times do not depend on how the threads are scheduled: a message's departure
depends only on its sender's clock and earlier sends (program order), and receives are matched
to messages in FIFO order per ``(src, dst, tag)``, as the transport delivers them. So the same
program gives the same times on every run, whatever the machine is doing. A 256-rank
collective over a 25 Gb/s cluster model runs on one machine in seconds of real time.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from .base import Request


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value < 0:
        raise ValueError(f"Network: {name} {value!r} must be a finite number >= 0")
    return float(value)


@dataclass(frozen=True)
class Link:
    """One kind of link: ``latency`` seconds per message, ``bandwidth`` bytes per second."""

    latency: float
    bandwidth: float

    def __post_init__(self) -> None:
        _positive("latency", self.latency)
        if _positive("bandwidth", self.bandwidth) == 0:
            raise ValueError("Network: bandwidth must be > 0")

    def time(self, nbytes: int) -> float:
        """Seconds for one message of ``nbytes`` on an idle link."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Network:
    """A cluster model: ``inter`` between nodes, ``intra`` within a node, ``ranks_per_node``
    consecutive ranks per node (rank ``r`` is on node ``r // ranks_per_node``).

    >>> net = Network.cluster(gbit=25, ranks_per_node=16)   # 25 Gb/s, 16-core nodes
    >>> net.link(0, 15) == net.intra, net.link(0, 16) == net.inter
    (True, True)
    """

    inter: Link
    intra: Link | None = None
    ranks_per_node: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) \
                or self.ranks_per_node < 1:
            raise ValueError(f"Network: ranks_per_node {self.ranks_per_node!r} must be an int >= 1")

    @classmethod
    def cluster(cls, gbit: float = 25.0, latency_us: float = 5.0, *, ranks_per_node: int = 1,
                intra_gbyte: float = 10.0, intra_latency_us: float = 0.5) -> Network:
        """A typical cluster: ``gbit`` Gb/s and ``latency_us`` between nodes, a shared-memory
        link of ``intra_gbyte`` GB/s and ``intra_latency_us`` within a node."""
        return cls(Link(latency_us * 1e-6, gbit * 1e9 / 8),
                   Link(intra_latency_us * 1e-6, intra_gbyte * 1e9), ranks_per_node)

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def link(self, src: int, dst: int) -> Link:
        if self.intra is not None and self.node(src) == self.node(dst):
            return self.intra
        return self.inter


class VirtualTime:
    """The group's clocks and message timestamps (shared by its ranks; thread-safe)."""

    def __init__(self, network: Network, world: int) -> None:
        self.network = network
        self.clock = [0.0] * world
        self._nic_free = [0.0] * world
        self._arrivals: dict[tuple[int, int, int], dict[int, float]] = defaultdict(dict)
        self._sent: dict[tuple[int, int, int], int] = defaultdict(int)
        self._posted: dict[tuple[int, int, int], int] = defaultdict(int)
        self._lock = threading.Lock()

    def on_send(self, src: int, dst: int, tag: int, nbytes: int) -> None:
        """Stamp the next message on ``(src, dst, tag)`` with its arrival time (call before it
        can be received)."""
        link = self.network.link(src, dst)
        with self._lock:
            start = max(self.clock[src], self._nic_free[src])
            done = start + nbytes / link.bandwidth
            self._nic_free[src] = done
            key = (src, dst, tag)
            k = self._sent[key]
            self._sent[key] = k + 1
            self._arrivals[key][k] = done + link.latency

    def on_post(self, src: int, dst: int, tag: int) -> int:
        """The ticket of a receive posted on ``(src, dst, tag)`` (matched in post order)."""
        key = (src, dst, tag)
        with self._lock:
            k = self._posted[key]
            self._posted[key] = k + 1
            return k

    def on_complete(self, src: int, dst: int, tag: int, ticket: int) -> None:
        """A receive is complete: its receiver's clock moves to the message's arrival."""
        with self._lock:
            arrival = self._arrivals[(src, dst, tag)].pop(ticket)
            if arrival > self.clock[dst]:
                self.clock[dst] = arrival


class TimedRequest(Request):
    """A receive whose completion advances the receiver's virtual clock (once)."""

    def __init__(self, inner: Request, vt: VirtualTime, key: tuple[int, int, int],
                 ticket: int) -> None:
        self._inner, self._vt, self._key, self._ticket = inner, vt, key, ticket
        self._counted = False
        self.source = inner.source

    def _count(self) -> None:
        if not self._counted:
            self._counted = True
            self._vt.on_complete(*self._key, self._ticket)

    def wait(self, timeout: float | None = None) -> None:
        self._inner.wait(timeout)
        self._count()

    def poll(self, timeout: float = 0.0) -> bool:
        done = self._inner.poll(timeout)
        if done:
            self._count()
        return done

    def is_completed(self) -> bool:
        done = self._inner.is_completed()
        if done:
            self._count()
        return done


__all__ = ["Link", "Network", "TimedRequest", "VirtualTime"]
