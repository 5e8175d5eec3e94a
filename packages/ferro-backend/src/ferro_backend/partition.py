"""The one rule for splitting ``n`` items over ``parts`` ranks, used by every layer above.

Rank ``r`` gets ``n // parts + (1 if r < n % parts else 0)`` items, contiguous and in rank order:
the first ``n % parts`` ranks hold one extra. ferro-collective's ring chunks, ferro-fsdp's flat
shards and ferro-checkpoint's ``shard_sizes`` all follow it (ferro-checkpoint keeps its own copy
because it may not depend on ferro-backend; a test checks that the two agree).
"""

from __future__ import annotations


def split_sizes(n: int, parts: int) -> tuple[int, ...]:
    """Sizes of ``parts`` contiguous pieces of ``n`` items; the first ``n % parts`` get one more.

    Parameters
    ----------
    n : int
        The number of items (0 or more).
    parts : int
        The number of pieces (1 or more): one per rank.

    Returns
    -------
    tuple of int
        ``parts`` sizes, in rank order, summing to ``n``.

    Raises
    ------
    ValueError
        ``n`` is negative or ``parts`` is less than 1 (names both).

    Examples
    --------
    >>> split_sizes(10, 4)
    (3, 3, 2, 2)
    """
    n, parts = int(n), int(parts)
    if n < 0 or parts < 1:
        raise ValueError(f"split_sizes: cannot split {n} items into {parts} parts")
    base, extra = divmod(n, parts)
    return tuple(base + (1 if r < extra else 0) for r in range(parts))


def split_bounds(n: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``(start, end)`` of each piece of :func:`split_sizes`.

    >>> split_bounds(5, 2)
    ((0, 3), (3, 5))
    """
    bounds, start = [], 0
    for size in split_sizes(n, parts):
        bounds.append((start, start + size))
        start += size
    return tuple(bounds)


def split_starts(n: int, parts: int) -> tuple[int, ...]:
    """The start offset of each piece of :func:`split_sizes`.

    Parameters
    ----------
    n, parts : int
        As for :func:`split_sizes`.

    Returns
    -------
    tuple of int
        ``parts`` offsets, in rank order (the first is 0).

    Raises
    ------
    ValueError
        As :func:`split_sizes`.

    Examples
    --------
    >>> split_starts(10, 4)
    (0, 3, 6, 8)
    """
    return tuple(s for s, _ in split_bounds(n, parts))


__all__ = ["split_bounds", "split_sizes", "split_starts"]
