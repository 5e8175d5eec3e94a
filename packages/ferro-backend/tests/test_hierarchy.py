"""A multi-node job's hierarchy (ferro_backend.hierarchy): 4 TcpBackend processes on two
pretend nodes. Whatever the layout of the ranks on the nodes, cross rank ``k`` of every local
index is on node ``k`` (the collectives' node and cross stages take them so)."""

import pytest

from ferro_backend.engine import AVAILABLE as SAME_HOST_ENGINE
from ferro_backend.hierarchy import attach_hierarchy, node_members
from ferro_backend.testing import run_processes

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not SAME_HOST_ENGINE, reason="the engine needs Linux")]

LAYOUTS = {"node-major": ("a", "a", "b", "b"), "interleaved": ("a", "b", "a", "b"),
           # local index 1's ranks ascending, (1, 2), are nodes b, a: not node order
           "mirrored": ("a", "b", "b", "a"), "mirrored from b": ("b", "a", "a", "b")}


def _cross_in_node_order(b, nodes):
    h = attach_hierarchy(b, nodes)
    cross = h.cross
    # every cross rank tells the others which node it is on (by the job's members, not by its
    # cross rank): the message from cross rank j must name node j
    mine = next(k for k, m in enumerate(h.members) if b.rank in m)
    for peer in range(cross.world_size):
        if peer != cross.rank:
            cross.send(bytes([mine]), peer, tag=3)
    heard = {}
    for peer in range(cross.world_size):
        if peer != cross.rank:
            buf = bytearray(1)
            cross.recv(buf, peer, tag=3, timeout=30)
            heard[peer] = buf[0]
    return list(cross.global_ranks), cross.rank, mine, heard, list(h.node.global_ranks)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cross_rank_k_is_on_node_k_whatever_the_layout(layout):
    nodes = LAYOUTS[layout]
    members = node_members(nodes)
    results = run_processes(_cross_in_node_order, len(nodes), nodes, timeout=150)
    for r, (cross, cross_rank, node, heard, node_ranks) in enumerate(results):
        local = members[node].index(r)
        assert node_ranks == list(members[node])
        assert cross == [m[local] for m in members], (r, cross)  # node order
        assert cross_rank == node  # this rank's cross rank is its node's index
        assert heard == {j: j for j in range(len(members)) if j != node}, (r, heard)
