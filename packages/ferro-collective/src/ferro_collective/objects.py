"""Collectives on picklable Python objects: broadcast_object and all_gather_object.

Objects travel as pickles (:mod:`.pickles`). **Unpickling runs code chosen by the sender**: use
these only among ranks that trust each other, that is on a backend whose peers are authenticated
(ferrorun's token on TCP, the same-host engine, MPI), never with data from outside the job.

A metadata round tells every rank each pickle's size (and whether it could be made) before the
bytes move: over messages, a binomial-tree broadcast or the ring all-gather on uneven chunks; on
the same-host engine, the pickles ride in the metadata step itself (in the sender's slot, or
read from its memory beyond it), as all_gather_v's data does, and their compiled twin
(:mod:`._objects_twin`) runs that step byte for byte. An object that cannot be pickled is a
TypeError on the rank that passed it and, naming that rank and the reason, on every other rank
too; none waits for bytes that will never come.
"""

from __future__ import annotations

import numpy as np

from ferro_backend import Backend

from . import _onecall
from .arguments import check_backend, check_root
from .broadcast import broadcast_tree
from .exchange import all_gather_v_ring
from .metadata_step import MetaPlan, get_pieces, pack_ints, put_block, unpack_ints
from .p2p import Ctx
from .pickles import PROTOCOL, broadcast_result, dumps, gathered
from .plan import Collective


def prepare_broadcast_object(obj, backend: Backend, root, timeout, algorithm=None, out=None,
                             seq: int | None = None) -> MetaPlan:
    """The checked plan of one broadcast_object (``arg``: the root; the metadata round carries
    the pickle's size and whether it could be made)."""
    name = "broadcast_object"
    check_backend(name, backend)
    n, me = backend.world_size, backend.rank
    root = check_root(name, root, n)
    payload, error = dumps(name, obj) if me == root else (b"", None)
    data = np.frombuffer(payload, np.uint8)
    meta = pack_ints([len(payload), error is not None]) if me == root else bytes(16)

    def body(ctx: Ctx, metas: list[bytes]) -> object:
        size, failed = unpack_ints(metas[root], 2)
        buf = data if me == root else np.empty(size, np.uint8)
        if n > 1 and size:
            broadcast_tree(ctx, buf, root)
        return broadcast_result(name, me, root, obj, error, failed, buf)

    def put(group, payload_room: np.ndarray) -> None:
        if me == root:
            put_block(group, payload_room, data)

    def run(group, call, step: int, off: int, metas: list[bytes], messages) -> object:
        """The root's pickle rides in the metadata step (or is read from its memory)."""
        size, failed = unpack_ints(metas[root], 2)
        buf = data if me == root else np.empty(size, np.uint8)
        recvs = [buf if r == root and me != root else None for r in range(n)]
        if not get_pieces(group, call, step, off, [size if r == root else 0 for r in range(n)],
                          [0] * n, recvs):
            return messages()
        return broadcast_result(name, me, root, obj, error, failed, buf)

    return MetaPlan(name, backend, timeout, (None, (), None, root), meta, body,
                    engine_path=(put, run))


def prepare_all_gather_object(obj, backend: Backend, arg, timeout, algorithm=None, out=None,
                              seq: int | None = None) -> MetaPlan:
    """The checked plan of one all_gather_object (the metadata round carries every pickle's
    size and whether it could be made)."""
    name = "all_gather_object"
    check_backend(name, backend)
    payload, error = dumps(name, obj)
    data = np.frombuffer(payload, np.uint8)

    def pieces_of(metas: list[bytes]):
        """A buffer for every rank's pickle, the (start, end) of each in it, a view of each,
        and every rank's flag (its object could not be pickled)."""
        info = [unpack_ints(m, 2) for m in metas]
        ends = np.cumsum([size for size, _ in info]).tolist()
        bounds = [(e - size, e) for (size, _), e in zip(info, ends)]
        buf = np.empty(ends[-1], np.uint8)
        return buf, bounds, [buf[s:e] for s, e in bounds], [bad for _, bad in info]

    def body(ctx: Ctx, metas: list[bytes]) -> list:
        buf, bounds, pieces, failed = pieces_of(metas)
        pieces[ctx.rank][...] = data
        if ctx.n > 1 and buf.size:
            all_gather_v_ring(ctx, buf, bounds)
        return gathered(name, ctx.rank, pieces, failed, error)

    def put(group, payload_room: np.ndarray) -> None:
        put_block(group, payload_room, data)

    def run(group, call, step: int, off: int, metas: list[bytes], messages) -> list:
        """Every rank's pickle rides in the metadata step (or is read from its memory)."""
        _, _, pieces, failed = pieces_of(metas)
        if not get_pieces(group, call, step, off, [p.size for p in pieces], [0] * len(pieces),
                          pieces):
            return messages()
        pieces[group.me] = payload  # (unpickled from where it is: no copy)
        return gathered(name, group.me, pieces, failed, error)

    meta = pack_ints([len(payload), error is not None])
    return MetaPlan(name, backend, timeout, (None, (), None, -1), meta, body,
                    engine_path=(put, run))


BROADCAST_OBJECT = Collective("broadcast_object", prepare_broadcast_object,
                              _onecall.BROADCAST_OBJECT, torch="broadcast_object_list")
ALL_GATHER_OBJECT = Collective("all_gather_object", prepare_all_gather_object,
                               _onecall.ALL_GATHER_OBJECT, torch="all_gather_object")

__all__ = ["ALL_GATHER_OBJECT", "BROADCAST_OBJECT", "PROTOCOL", "prepare_all_gather_object",
           "prepare_broadcast_object"]
