"""Jobs on several nodes: the same-host engine inside each node, the job's mesh between nodes.

:func:`attach_hierarchy` gives a multi-node :class:`~ferro_backend.TcpBackend` (or
ShmBackend) a :class:`Hierarchy`: ``node``, the ranks of this rank's node as a
:class:`~ferro_backend.SubBackend` that carries its own same-host engine (``node.engine``, so
ferro-collective runs its engine collectives on it), and ``cross``, the ranks with this rank's
local index on every node (their messages cross the network). Point-to-point messages between
two ranks of one node travel that engine's rings (:mod:`.engine.rings`, installed as the
backend's route), as on a :class:`~ferro_backend.ShmBackend`. ferro-collective's
hierarchical collectives compose the two: an allreduce reduces inside the node on the engine,
then each local rank allreduces its 1/L slice of the node's sum across nodes, then the node
gathers the slices, so each rank sends 1/L of the data over the network instead of all of it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .engine import AVAILABLE as SAME_HOST_ENGINE
from .sub import SubBackend

log = logging.getLogger(__name__)


@dataclass
class Hierarchy:
    """The node structure of a job: ``node`` (this rank's node, with ``node.engine``),
    ``cross`` (the ranks with this rank's local index on every node, in node order),
    ``members`` (every node's global ranks, in node order: node ``k`` is ``members[k]``).
    ``simulated``: built by :func:`attach_simulated_hierarchy` on a modelled network, with no
    engine: the node stages run the point-to-point algorithms over the intra-node links."""

    node: SubBackend
    cross: SubBackend
    members: tuple[tuple[int, ...], ...]
    simulated: bool = False

    @property
    def local_rank(self) -> int:
        return self.node.rank

    @property
    def local_world(self) -> int:
        return self.node.world_size

    @property
    def num_nodes(self) -> int:
        return len(self.members)

    def link_transports(self) -> tuple[str, str]:
        """How the job's messages travel ``(within a node, between nodes)``, in words."""
        engine = self.node.engine
        if engine is None:
            return "modelled intra-node links", "modelled inter-node links"
        p2p = (f"point-to-point: {engine.ring_bytes >> 10} KiB rings" if self.node.root.routes()
               else "TCP loopback for point-to-point")
        return (f"shared-memory engine (the collectives' node stages: "
                f"{engine.slot_bytes >> 10} KiB slots; {p2p})", "TCP (the collectives' "
                "cross-node stages: each local rank carries 1/L of the data)")


def node_members(nodes: tuple[str, ...] | list[str]) -> tuple[tuple[int, ...], ...]:
    """Global ranks per node (nodes in order of their lowest rank, ranks ascending)."""
    by_node: dict[str, list[int]] = {}
    for rank, key in enumerate(nodes):
        by_node.setdefault(key, []).append(rank)
    return tuple(tuple(ranks) for ranks in sorted(by_node.values()))


def attach_hierarchy(backend: Any, nodes: tuple[str, ...] | list[str] | None = None, *,
                     slot_bytes: int | None = None) -> Hierarchy | None:
    """Give ``backend`` (the whole job, every rank calls this) its :class:`Hierarchy` as
    ``backend.hierarchy`` and return it; None (and nothing attached) when the job is on one
    node, the nodes hold different numbers of ranks, a node has one rank only, or this platform
    has no engine. ``nodes``: every rank's node key, index = rank (default ``backend.nodes``).

    Collective over ``backend``: each node maps its own engine (the memfd rendezvous of
    :meth:`ferro_backend.engine.Engine.join`, over the node's ranks only), whose rings become
    the backend's route to the node's ranks (:meth:`TcpBackend.install_route`).
    """
    nodes = backend.nodes if nodes is None else tuple(nodes)
    if nodes is None or len(nodes) != backend.world_size or not SAME_HOST_ENGINE:
        return None
    members = node_members(nodes)
    sizes = {len(m) for m in members}
    if len(members) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    from .engine import attach_engine
    from .engine.rings import RingMesh

    mine = next(m for m in members if backend.rank in m)
    local = mine.index(backend.rank)
    node = SubBackend(backend, mine, name="ferro-node")
    # in node order, not sorted: cross rank k is on node k (members[k]) for every local index
    # (on a layout like A B B A, local index 1's ranks ascending would be nodes B, A)
    cross = SubBackend(backend, [m[local] for m in members], name=f"ferro-cross-{local}",
                       ordered=True)
    # the node's engine: its waits end on an abort, this rank's close, or a node peer gone (a
    # rank of another node that finished and closed does not break this node's calls: the
    # cross stages see that rank's failures on the mesh)
    engine = attach_engine(node, slot_bytes=slot_bytes)
    if hasattr(backend, "install_route") and not backend.routes():
        # the node's ranks talk through the engine's rings too (TCP meshes; MPI keeps its own)
        backend.install_route(RingMesh(engine, backend.mailbox, lambda: backend.timeout,
                                       ranks=mine))
    hierarchy = Hierarchy(node, cross, members)
    backend.hierarchy = hierarchy
    log.debug("rank %d: node %s (local rank %d of %d), cross group %s", backend.rank, mine,
              local, len(mine), cross.members)
    return hierarchy


def attach_simulated_hierarchy(backend: Any) -> Hierarchy:
    """Give a :class:`~ferro_backend.SimulatedBackend` made with a ``network`` a simulated
    :class:`Hierarchy` (``simulated=True``, no engine) from the network's node layout; every
    rank of the group calls this (``create_group(..., hierarchical=True)`` does). The node and
    cross groups are SubBackends of ``backend``: their messages travel with global ranks, so the
    network charges them to the intra- and inter-node links. Each carries ``network``, the model
    of its own links (one kind: intra-node for ``node``, inter-node for ``cross``), which "auto"
    plans the stage with. Local work only, no messages.

    Raises ValueError when the network puts fewer than 2 ranks on a node, the world is not a
    whole number of nodes, or it is one node only.
    """
    from .netsim import Network

    network = backend.network
    if network is None:
        raise ValueError("attach_simulated_hierarchy: the backend has no modelled network")
    L, n = network.ranks_per_node, backend.world_size
    if L < 2 or n % L or n // L < 2:
        raise ValueError(f"attach_simulated_hierarchy: {n} ranks at {L} per node is not several "
                         f"nodes of at least 2 ranks each")
    members = tuple(tuple(range(k, k + L)) for k in range(0, n, L))
    mine = members[backend.rank // L]
    local = backend.rank % L
    node = SubBackend(backend, mine, name="ferro-node")
    cross = SubBackend(backend, [m[local] for m in members], name=f"ferro-cross-{local}",
                       ordered=True)
    node.network = Network(network.intra or network.inter)
    cross.network = Network(network.inter)
    hierarchy = Hierarchy(node, cross, members, simulated=True)
    backend.hierarchy = hierarchy
    return hierarchy


__all__ = ["Hierarchy", "attach_hierarchy", "attach_simulated_hierarchy", "node_members"]
