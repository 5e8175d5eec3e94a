"""The flat-parameter layout: a unit's parameters as one buffer, split into equal shards.

Parameter ``i`` with ``n`` elements is split over ``world`` ranks by ferro's one split rule
(:mod:`ferro_backend.partition`, which ferro-checkpoint's resharding follows too): rank ``r``
holds the ``len_r = n // world + (r < n % world)`` elements that
start at ``sum(len_q for q < r)`` of the flattened parameter. Every rank's chunk is padded with
zeros to the same ``chunk = ceil(n / world)`` elements, so shards have equal sizes whatever ``n``
is (at most one padding element per rank and parameter: the last element of the chunk of ranks
``r >= n % world`` when ``n % world != 0``).

A rank's flat shard is its chunks of every parameter, back to back: ``shard_numel`` =
``sum(chunk_i)``. One all-gather of the flat shards gives the ``(world, shard_numel)`` matrix
from which :meth:`FlatLayout.gathered_to_full` copies every full parameter, and one
reduce-scatter of the buffer that :meth:`FlatLayout.full_to_scatter` fills gives each rank its
flat gradient shard. The padded flat parameter is that matrix read row by row; ``world *
shard_numel`` is a multiple of the world size by construction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ferro_backend import pack, unpack
from ferro_backend.partition import split_bounds


class FlatLayout:
    """Shapes, offsets and padding of a list of same-dtype parameters sharded over ``world`` ranks.

    Parameters
    ----------
    shapes : sequence of sequence of int
        Each parameter's shape, in order.
    dtype : numpy dtype
        The parameters' (and buffers') dtype.
    world : int
        Number of shards (>= 1).

    Raises
    ------
    ValueError
        ``world`` < 1.

    Examples
    --------
    >>> layout = FlatLayout([(3, 2), (5,)], np.float32, 4)
    >>> layout.chunks, layout.shard_numel, layout.padded_numel
    ((2, 2), 4, 16)
    """

    def __init__(self, shapes: Sequence[Sequence[int]], dtype: np.dtype, world: int) -> None:
        if world < 1:
            raise ValueError(f"FlatLayout: world {world}, expected >= 1")
        self.shapes: tuple[tuple[int, ...], ...] = tuple(tuple(int(d) for d in s) for s in shapes)
        self.dtype = np.dtype(dtype)
        self.world = int(world)
        self.numels: tuple[int, ...] = tuple(math.prod(s) for s in self.shapes)
        self.chunks: tuple[int, ...] = tuple(-(-n // self.world) for n in self.numels)
        offsets, acc = [], 0
        for c in self.chunks:
            offsets.append(acc)
            acc += c
        self.shard_offsets: tuple[int, ...] = tuple(offsets)
        self.shard_numel: int = acc
        self.numel: int = sum(self.numels)
        self.padded_numel: int = acc * self.world

    def __len__(self) -> int:
        return len(self.shapes)

    # -- one parameter ------------------------------------------------------------------------
    def region(self, i: int, r: int) -> tuple[int, int]:
        """``(start, length)`` of parameter ``i``'s real elements on rank ``r``.

        Parameters
        ----------
        i, r : int
            Parameter index and rank.

        Returns
        -------
        (int, int)
            Offset into the flattened parameter and number of elements (no padding).
        """
        start, end = split_bounds(self.numels[i], self.world)[r]
        return start, end - start

    def shard_of(self, i: int, full: np.ndarray, r: int) -> np.ndarray:
        """Rank ``r``'s padded chunk of parameter ``i`` (a new ``(chunk,)`` array).

        Parameters
        ----------
        i : int
            Parameter index.
        full : array_like
            The full parameter (``numels[i]`` elements).
        r : int
            The rank.

        Returns
        -------
        numpy.ndarray

        Raises
        ------
        ValueError
            ``full`` has another number of elements.
        """
        flat = np.asarray(full, dtype=self.dtype).reshape(-1)
        if flat.size != self.numels[i]:
            raise ValueError(f"FlatLayout.shard_of: parameter {i} has {flat.size} elements, "
                             f"expected {self.numels[i]}")
        start, length = self.region(i, r)
        out = np.zeros(self.chunks[i], dtype=self.dtype)
        out[:length] = flat[start:start + length]
        return out

    # -- the whole unit ---------------------------------------------------------------------
    def check_shards(self, op: str, shards: Sequence[np.ndarray]) -> None:
        """Check that ``shards`` fit this layout: one per parameter, each of the layout's dtype and
        of its chunk size (padding included).

        Parameters
        ----------
        op : str
            The caller's name, first in the error message.
        shards : sequence of numpy.ndarray
            A rank's shards, one per parameter in layout order.

        Raises
        ------
        ValueError
            Another number of shards, or a shard of another dtype or size (a ``.data`` that was
            replaced instead of written into).
        """
        if len(shards) != len(self.shapes):
            raise ValueError(f"{op}: {len(shards)} shards, expected {len(self.shapes)}")
        for i, s in enumerate(shards):
            if s.dtype != self.dtype or s.size != self.chunks[i]:
                raise ValueError(f"{op}: parameter {i}'s shard has {s.size} elements of {s.dtype}, "
                                 f"expected {self.chunks[i]} of {self.dtype} (was .data replaced?)")

    def pack_shards(self, shards: Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """The rank's flat shard: ``shards`` back to back in one ``(shard_numel,)`` array.

        Parameters
        ----------
        shards : sequence of numpy.ndarray
            One chunk per parameter, of ``chunks[i]`` elements of ``dtype``.
        out : numpy.ndarray, optional
            A contiguous ``(shard_numel,)`` array to fill and return.

        Returns
        -------
        numpy.ndarray

        Raises
        ------
        ValueError
            Another number of shards, or a shard of another size or dtype.
        """
        self.check_shards("FlatLayout.pack_shards", shards)
        if out is None:
            out = np.empty(self.shard_numel, dtype=self.dtype)
        pack([np.ascontiguousarray(s) for s in shards], out=out.view(np.uint8))
        return out

    def shard_views(self, flat_shard: np.ndarray) -> list[np.ndarray]:
        """Views of each parameter's chunk in a ``(shard_numel,)`` flat shard.

        Parameters
        ----------
        flat_shard : numpy.ndarray
            A ``(shard_numel,)`` array.

        Returns
        -------
        list of numpy.ndarray
        """
        return [flat_shard[o:o + c] for o, c in zip(self.shard_offsets, self.chunks)]

    def unpack_shards(self, flat_shard: np.ndarray, outs: Sequence[np.ndarray]) -> None:
        """Copy a flat shard into the per-parameter chunk arrays ``outs`` (contiguous, writable).

        Parameters
        ----------
        flat_shard : array_like
            A ``(shard_numel,)`` flat shard.
        outs : sequence of numpy.ndarray
            One chunk array per parameter.
        """
        unpack(np.ascontiguousarray(flat_shard, dtype=self.dtype), outs)

    def gathered_to_full(self, gathered: np.ndarray, outs: Sequence[np.ndarray] | None = None
                         ) -> list[np.ndarray]:
        """Full parameters from the all-gathered flat shards (``world * shard_numel`` elements).

        Without ``outs`` the parameters are views into one new buffer of ``numel`` elements.

        Parameters
        ----------
        gathered : array_like
            The all-gathered flat shards, rank after rank.
        outs : sequence of numpy.ndarray, optional
            Contiguous arrays of the parameters' shapes to fill.

        Returns
        -------
        list of numpy.ndarray
            ``outs``, or the new views, one per parameter.

        Raises
        ------
        ValueError
            A destination is not contiguous.
        """
        g2 = np.asarray(gathered).reshape(self.world, self.shard_numel)
        if outs is None:
            buf = np.empty(self.numel, dtype=self.dtype)
            outs, acc = [], 0
            for n, shape in zip(self.numels, self.shapes):
                outs.append(buf[acc:acc + n].reshape(shape))
                acc += n
        for i, out in enumerate(outs):
            n, c, off = self.numels[i], self.chunks[i], self.shard_offsets[i]
            flat = out.reshape(-1)
            if not np.shares_memory(flat, out) and flat.size:
                raise ValueError("FlatLayout.gathered_to_full: destination is not contiguous")
            block = g2[:, off:off + c]
            q = n % self.world or self.world
            flat[:q * c].reshape(q, c)[...] = block[:q]
            if q < self.world:
                flat[q * c:].reshape(self.world - q, c - 1)[...] = block[q:, :c - 1]
        return list(outs)

    def full_to_scatter(self, fulls: Sequence[np.ndarray | None], out: np.ndarray | None = None
                        ) -> np.ndarray:
        """The reduce-scatter input: row ``r`` of ``(world, shard_numel)`` is rank ``r``'s chunks.

        ``None`` stands for zeros; padding is zero.

        Parameters
        ----------
        fulls : sequence of (array_like or None)
            One full array per parameter.
        out : numpy.ndarray, optional
            A contiguous ``(padded_numel,)`` array to fill and return.

        Returns
        -------
        numpy.ndarray
            ``padded_numel`` elements.

        Raises
        ------
        ValueError
            An array of another number of elements.
        """
        if out is None:
            out = np.empty(self.padded_numel, dtype=self.dtype)
        o2 = out.reshape(self.world, self.shard_numel)
        for i, full in enumerate(fulls):
            n, c, off = self.numels[i], self.chunks[i], self.shard_offsets[i]
            block = o2[:, off:off + c]
            if full is None:
                block[...] = 0
                continue
            flat = np.asarray(full).reshape(-1)
            if flat.size != n:
                raise ValueError(f"FlatLayout.full_to_scatter: array {i} has {flat.size} elements, "
                                 f"expected {n}")
            q = n % self.world or self.world
            block[:q] = flat[:q * c].reshape(q, c)
            if q < self.world:
                block[q:, :c - 1] = flat[q * c:].reshape(self.world - q, c - 1)
                block[q:, c - 1] = 0
        return out

    def __repr__(self) -> str:
        return (f"FlatLayout({len(self.shapes)} params, numel={self.numel}, world={self.world}, "
                f"shard_numel={self.shard_numel}, padding={self.padded_numel - self.numel})")


__all__ = ["FlatLayout"]
