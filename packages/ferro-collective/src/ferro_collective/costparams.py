"""The cost model's parameters: the links a job's messages cross, and the local work its ranks
do on the way (folds, copies), at the rates this host gives them in its caches and beyond.

:class:`Params` is what :mod:`.costmodel` plans with and :func:`.learn.learn_network` learns;
:data:`DEFAULT` is what "auto" assumes before it has learned anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Params:
    """``alpha`` seconds and ``beta`` bytes/s between nodes; ``intra_alpha``/``intra_beta``
    within a node of ``ranks_per_node`` consecutive ranks (None: one link kind); ``gamma``
    seconds per byte a rank folds into its buffer (the reduction kernel; 0: free, as in the
    simulated network); ``call`` seconds every call costs each rank outside its messages
    (argument checks, buffers, the Python around them: fitted to real runs by
    ``benchmarks/scale_validate.py``; 0 on the simulated network). ``shared_link``: a node's
    ranks share one link to the network (a real node's NIC: messages leaving, or entering, a
    node one after another), where the simulated network gives every rank an interface of its
    own (False: its rules). ``burst``: bytes a shared link passes at once after it has rested,
    the rest at ``beta`` (a token bucket, as ``tc``'s tbf shapes an emulated node's link; 0: a
    plain link); every call starts on rested links. ``engine_step``: seconds of a node stage's
    step through the node's shared-memory engine within a staged call (None: ``intra_alpha``).

    The host's local rates (None where not learned: folds cost ``gamma`` a byte at any size,
    copies nothing; a node stage's bytes move at ``intra_beta``): ``copy_beta``, bytes/s a rank
    copies within its own memory (the node engine's copies, a call's copy of its input);
    ``gamma_mem`` and ``copy_beta_mem``, the same once an array is larger than
    ``cache_bytes``, where the data streams from memory, not the cache (2 cores, 32 MiB L3,
    one rank: 40 GB/s folded at 4 MiB, 8-16 GB/s at 64 MiB). ``node_of``: each rank's node
    where the nodes do not hold consecutive ranks (``srun --distribution=cyclic``, ``mpirun
    --map-by node``); None: rank ``r`` is on node ``r // ranks_per_node``."""

    alpha: float
    beta: float
    intra_alpha: float | None = None
    intra_beta: float | None = None
    ranks_per_node: int = 1
    gamma: float = 0.0
    call: float = 0.0
    shared_link: bool = False
    burst: float = 0.0
    engine_step: float | None = None
    copy_beta: float | None = None
    gamma_mem: float | None = None
    copy_beta_mem: float | None = None
    cache_bytes: float = math.inf
    node_of: tuple[int, ...] | None = None

    @classmethod
    def of(cls, network) -> Params:
        """The parameters of a :class:`ferro_backend.netsim.Network`."""
        intra = network.intra
        return cls(network.inter.latency, network.inter.bandwidth,
                   intra.latency if intra is not None else None,
                   intra.bandwidth if intra is not None else None, network.ranks_per_node)

    def link(self, crosses: bool) -> tuple[float, float]:
        if crosses or self.intra_alpha is None:
            return self.alpha, self.beta
        return self.intra_alpha, self.intra_beta

    def msg(self, nbytes: float, crosses: bool) -> float:
        a, b = self.link(crosses)
        return a + nbytes / b

    def node(self, rank: int) -> int:
        """The node of ``rank``."""
        return self.node_of[rank] if self.node_of is not None else rank // self.ranks_per_node

    def members(self, n: int) -> list[tuple[int, ...]]:
        """The ranks of each node of an ``n``-rank job, in node order."""
        by_node: dict[int, list[int]] = {}
        for rank in range(n):
            by_node.setdefault(self.node(rank), []).append(rank)
        return [tuple(by_node[k]) for k in sorted(by_node)]

    def node_major(self, n: int) -> tuple[int, ...] | None:
        """The ranks of an ``n``-rank job node by node (the order in which the header exchange's
        rounds, :mod:`.gathered`, number them, so that their cost does not depend on how the
        job names its ranks on its nodes); None where that is rank order."""
        if self.node_of is None or len(self.node_of) != n:
            return None
        return tuple(rank for members in self.members(n) for rank in members)

    def fold(self, nbytes: float) -> float:
        """Seconds a rank takes to fold ``nbytes`` into its buffer."""
        if self.gamma_mem is not None and nbytes > self.cache_bytes:
            return self.gamma_mem * nbytes
        return self.gamma * nbytes

    def copy(self, nbytes: float) -> float:
        """Seconds a rank takes to copy ``nbytes`` within its memory (0 where not learned)."""
        if self.copy_beta is None or nbytes <= 0:
            return 0.0
        if self.copy_beta_mem is not None and nbytes > self.cache_bytes:
            return nbytes / self.copy_beta_mem
        return nbytes / self.copy_beta


def placement(node_of: tuple[int, ...], per_node: int) -> tuple[int, ...] | None:
    """``Params.node_of`` for ranks on nodes ``node_of``: None where the nodes hold
    consecutive ranks, ``per_node`` each (rank ``r`` on node ``r // per_node``)."""
    consecutive = all(k == rank // per_node for rank, k in enumerate(node_of))
    return None if consecutive else tuple(node_of)


#: a 25 Gb/s, 5 us cluster of 16-rank nodes with a 10 GB/s, 0.5 us shared-memory link: what
#: "auto" assumes beyond the sizes its thresholds were measured at
DEFAULT = Params(5e-6, 25e9 / 8, 0.5e-6, 10e9, 16)

__all__ = ["DEFAULT", "Params", "placement"]
