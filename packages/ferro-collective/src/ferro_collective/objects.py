"""Collectives on picklable Python objects: broadcast_object and all_gather_object.

Objects travel as pickles. **Unpickling runs code chosen by the sender**: use these only among
ranks that trust each other, that is on a backend whose peers are authenticated (ferrorun's
token on TCP, the same-host engine, MPI), never with data from outside the job.

A metadata round tells every rank each pickle's size (and whether it could be made) before the
bytes move (a binomial-tree broadcast; the ring all-gather on uneven chunks). An object that
cannot be pickled is a TypeError on the rank that passed it and, naming that rank and the
reason, on every other rank too; none waits for bytes that will never come.
"""

from __future__ import annotations

import pickle

import numpy as np

from ferro_backend import Backend

from .arguments import check_backend, check_root
from .broadcast import broadcast_tree
from .exchange import all_gather_v_ring
from .metadata_step import MetaPlan, pack_ints, unpack_ints
from .p2p import Ctx
from .plan import Collective

PROTOCOL = pickle.HIGHEST_PROTOCOL


def _dumps(name: str, obj) -> tuple[bytes, BaseException | None]:
    """The pickle of ``obj``, or (the reason it cannot be pickled, the error)."""
    try:
        return pickle.dumps(obj, protocol=PROTOCOL), None
    except Exception as exc:  # PicklingError, TypeError, AttributeError, RecursionError...
        why = f"cannot pickle {type(obj).__name__} object: {type(exc).__name__}: {exc}"
        return why.encode("utf-8", "replace"), TypeError(f"{name}: {why}")


def _loads(name: str, me: int, src: int, data: np.ndarray):
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise pickle.UnpicklingError(
            f"{name}: rank {me} cannot unpickle rank {src}'s object ({data.size} bytes): "
            f"{type(exc).__name__}: {exc}") from exc


def prepare_broadcast_object(obj, backend: Backend, root, timeout, algorithm=None, out=None,
                             seq: int | None = None) -> MetaPlan:
    """The checked plan of one broadcast_object (``arg``: the root; the metadata round carries
    the pickle's size and whether it could be made)."""
    name = "broadcast_object"
    check_backend(name, backend)
    n, me = backend.world_size, backend.rank
    root = check_root(name, root, n)
    payload, error = _dumps(name, obj) if me == root else (b"", None)
    meta = pack_ints([len(payload), error is not None]) if me == root else bytes(16)

    def body(ctx: Ctx, metas: list[bytes]) -> object:
        size, failed = unpack_ints(metas[root], 2)
        buf = np.frombuffer(payload, np.uint8) if me == root else np.empty(size, np.uint8)
        if n > 1 and size:
            broadcast_tree(ctx, buf, root)
        if failed:
            if error is not None:
                raise error
            raise TypeError(f"{name}: root {root} {bytes(buf).decode('utf-8', 'replace')}")
        return obj if me == root else _loads(name, me, root, buf)

    return MetaPlan(name, backend, timeout, (None, (), None, root), meta, body)


def prepare_all_gather_object(obj, backend: Backend, arg, timeout, algorithm=None, out=None,
                              seq: int | None = None) -> MetaPlan:
    """The checked plan of one all_gather_object (the metadata round carries every pickle's
    size and whether it could be made)."""
    name = "all_gather_object"
    check_backend(name, backend)
    payload, error = _dumps(name, obj)

    def body(ctx: Ctx, metas: list[bytes]) -> list:
        info = [unpack_ints(m, 2) for m in metas]
        bounds, start = [], 0
        for size, _ in info:
            bounds.append((start, start + size))
            start += size
        buf = np.empty(start, np.uint8)
        s, e = bounds[ctx.rank]
        buf[s:e] = np.frombuffer(payload, np.uint8)
        if ctx.n > 1 and start:
            all_gather_v_ring(ctx, buf, bounds)
        failed = [r for r, (_, bad) in enumerate(info) if bad]
        if failed:
            if error is not None:
                raise error
            reasons = "; ".join(f"rank {r} {bytes(buf[slice(*bounds[r])]).decode('utf-8', 'replace')}"
                                for r in failed)
            raise TypeError(f"{name}: ranks {failed} cannot pickle their objects: {reasons}")
        return [_loads(name, ctx.rank, r, buf[s:e]) for r, (s, e) in enumerate(bounds)]

    meta = pack_ints([len(payload), error is not None])
    return MetaPlan(name, backend, timeout, (None, (), None, -1), meta, body)


BROADCAST_OBJECT = Collective("broadcast_object", prepare_broadcast_object,
                              torch="broadcast_object_list")
ALL_GATHER_OBJECT = Collective("all_gather_object", prepare_all_gather_object,
                               torch="all_gather_object")

__all__ = ["ALL_GATHER_OBJECT", "BROADCAST_OBJECT", "PROTOCOL", "prepare_all_gather_object",
           "prepare_broadcast_object"]
