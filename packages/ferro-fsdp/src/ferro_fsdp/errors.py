"""ferro-fsdp's one error of its own; everything else reuses the ferro-backend family.

Bad world sizes raise :class:`ferro_backend.InvalidWorldSizeError`, transport and collective
failures surface as the ferro-backend / ferro-collective errors they are. :class:`FSDPStateError`
is a call in the wrong order: a second prefetch before ``forward``, ``sync_gradients`` or
``backward`` without a ``forward``, a prefetch on a strategy that has nothing to gather.
"""

from __future__ import annotations

from ferro_backend import DistributedError


class FSDPStateError(DistributedError):
    """An FSDP / DDP method called in a state where it cannot run (a ``RuntimeError``)."""


__all__ = ["FSDPStateError"]
