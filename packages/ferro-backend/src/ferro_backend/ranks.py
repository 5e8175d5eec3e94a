"""Ranks and nodes as people read them, and the rank bookkeeping transports share:
:func:`describe_topology` (what :meth:`~ferro_backend.Backend.describe` returns),
:func:`rank_ranges` and the :class:`FixedRanks` mixin."""

from __future__ import annotations

from typing import Any


def describe_topology(backend: Any) -> str:
    """``backend``'s job as it sees it: ranks per node and the transport of each kind of link
    (the text of :meth:`~ferro_backend.Backend.describe`)."""
    n = backend.world_size
    head = f"{type(backend).__name__}: {n} rank{'s' * (n != 1)}"
    within, between = backend.link_transports()
    if backend.nodes is None:
        return "\n".join([f"{head}, nodes not known (this is rank {backend.rank})",
                          f"  links: {within} within a node, {between} between nodes"])
    by_node: dict[str, list[int]] = {}
    for r, node in enumerate(backend.nodes):
        by_node.setdefault(node, []).append(r)
    k = len(by_node)
    lines = [f"{head} on {k} node{'s' * (k != 1)} (this is rank {backend.rank})"]
    lines += [f"  node {node!r}: ranks {rank_ranges(ranks)}" for node, ranks in by_node.items()]
    lines.append(f"  links within a node: {within}")
    if k > 1:
        lines.append(f"  links between nodes: {between}")
    return "\n".join(lines)


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts: list[str] = []
    start = prev = None
    for r in [*sorted(ranks), None]:
        if start is not None and (r is None or r != prev + 1):
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = None
        if r is not None and start is None:
            start = r
        prev = r
    return ", ".join(parts)


class FixedRanks:
    """Mixin for transports whose rank and world size are fixed at construction: they set
    ``self._rank`` and ``self._world``; this provides :attr:`Backend.rank`/``world_size``."""

    _rank: int
    _world: int

    @property
    def rank(self) -> int:
        """This process's rank, ``0 <= rank < world_size``, fixed when the backend was made."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks of this backend (of the subgroup, for a ``SubBackend``), fixed
        when the backend was made.
        """
        return self._world
