"""The object collectives' pickles: an object to the bytes that travel and back, and what every
rank raises when some rank's object could not be pickled.

Shared by their general path (:mod:`.objects`) and their compiled twin (:mod:`._objects_twin`),
so both make the same bytes and raise the same errors. A rank that cannot pickle its object
sends the reason instead (UTF-8) with a flag in its metadata; that rank raises its own error, and
every other rank a TypeError naming it and the reason.
"""

from __future__ import annotations

import pickle

PROTOCOL = pickle.HIGHEST_PROTOCOL


def dumps(name: str, obj) -> tuple[bytes, BaseException | None]:
    """The pickle of ``obj``, or (the reason it cannot be pickled, the error)."""
    try:
        return pickle.dumps(obj, protocol=PROTOCOL), None
    except Exception as exc:  # PicklingError, TypeError, AttributeError, RecursionError...
        why = f"cannot pickle {type(obj).__name__} object: {type(exc).__name__}: {exc}"
        return why.encode("utf-8", "replace"), TypeError(f"{name}: {why}")


def loads(name: str, me: int, src: int, data):
    """Rank ``src``'s object from its pickle ``data`` (a bytes-like object), on rank ``me``."""
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise pickle.UnpicklingError(
            f"{name}: rank {me} cannot unpickle rank {src}'s object ({len(memoryview(data))} "
            f"bytes): {type(exc).__name__}: {exc}") from exc


def broadcast_result(name: str, me: int, root: int, obj, error: BaseException | None,
                     failed: int, data):
    """What broadcast_object returns on rank ``me``: ``obj`` itself on the root, else the
    root's object rebuilt from ``data`` (its pickle, or its reason when ``failed``)."""
    if failed:
        if error is not None:
            raise error
        raise TypeError(f"{name}: root {root} {bytes(data).decode('utf-8', 'replace')}")
    return obj if me == root else loads(name, me, root, data)


def gathered(name: str, me: int, pieces: list, failed: list[int],
             error: BaseException | None) -> list:
    """What all_gather_object returns on rank ``me``: every rank's object rebuilt from its
    piece (``pieces[r]``: rank ``r``'s pickle, or its reason where ``failed[r]``)."""
    bad = [r for r, flag in enumerate(failed) if flag]
    if bad:
        if error is not None:
            raise error
        reasons = "; ".join(f"rank {r} {bytes(pieces[r]).decode('utf-8', 'replace')}" for r in bad)
        raise TypeError(f"{name}: ranks {bad} cannot pickle their objects: {reasons}")
    return [loads(name, me, r, p) for r, p in enumerate(pieces)]


__all__ = ["PROTOCOL", "broadcast_result", "dumps", "gathered", "loads"]
