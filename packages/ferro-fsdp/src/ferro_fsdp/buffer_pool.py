"""``BufferPool``: the unit-sized arrays an FSDP reuses from step to step instead of allocating.

One pool per :class:`~ferro_fsdp.FSDP`; its :class:`~ferro_fsdp.units.Unit` objects take from
it and give back to it. It is ferro-collective's scratch pool (:mod:`ferro_collective.scratch`,
the one the point-to-point algorithms borrow from) without its bound: an FSDP's pool keeps every
array given back, which is never more than was in use at once.
"""

from __future__ import annotations

from ferro_collective.scratch import ScratchPool


class BufferPool(ScratchPool):
    """Unit-sized arrays handed out and given back, so that a training step allocates none:
    gathers, full parameters, full gradients and reduce-scatter inputs of every unit come from
    here (torch's caching allocator does the same job). What the pool holds never exceeds what
    was in use at once; thread-safe (reductions give their buffers back when they finish)."""

    def __init__(self) -> None:
        super().__init__(keep_bytes=1 << 62, smallest=0)  # (every size: its units reuse theirs)


__all__ = ["BufferPool"]
