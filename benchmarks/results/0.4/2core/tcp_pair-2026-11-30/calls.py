"""The calls this study times on 2 processes over TCP (`run.py`), by kind, in three modes:
"pair" (as shipped: a call of two ranks sends its header with its data), "off" (the same
code sending the header first: `pair.FUSE_MAX = pair.BROADCAST_FUSE_MAX = -1`, and the
collectives with a metadata round exchanging the header, then the metadata) and "big" (one
message up to 8 MiB)."""

import time

import numpy as np

import ferro_collective as fc
from ferro_collective import metadata_step, pair
from ferro_collective.p2p import bruck_all_gather, header_exchange


def header_first() -> None:
    """Mode "off": every two-rank call exchanges its header first."""
    pair.FUSE_MAX = pair.BROADCAST_FUSE_MAX = -1

    def two(self, ctx):
        header_exchange(ctx, self.encoded())
        return bruck_all_gather(ctx, self._block(), ctx.next_tag(), "the metadata")

    metadata_step.MetaPlan._two = two


def calls(b, kind: str, sizes: list[int]):
    """(label, call, between barriers) of ``kind`` at each of ``sizes`` (bytes)."""
    out = []
    for nb in sizes:
        x = np.ones(nb // 4, np.float32)
        if kind == "symmetric":
            out += [(f"allreduce {nb}", lambda x=x: fc.allreduce(x, b), False),
                    (f"all_gather {nb}", lambda x=x: fc.all_gather(x, b), False),
                    (f"reduce_scatter {nb}", lambda x=x: fc.reduce_scatter(x, b), False)]
        elif kind == "metadata":
            out += [(f"all_to_all_single {nb}", lambda x=x: fc.all_to_all_single(x, b), False),
                    (f"all_gather_v {nb}", lambda x=x: fc.all_gather_v(x, b), False),
                    (f"all_gather_object {nb}",
                     lambda nb=nb: fc.all_gather_object({"a": nb}, b), False)]
        elif kind == "rooted":
            out += [(f"gather {nb}", lambda x=x: fc.gather(x, b, 0), True),
                    (f"reduce {nb}", lambda x=x: fc.reduce(x, b, 0), True)]
        else:  # broadcast: arrays on both ranks, then a non-root that passes None
            out += [(f"broadcast {nb}", lambda x=x: fc.broadcast(x, b, 0), True),
                    (f"broadcast None {nb}", lambda x=x: fc.broadcast(
                        x if b.rank == 0 else None, b, 0), True)]
    if kind == "symmetric":
        out.append(("barrier", lambda: fc.barrier(b), False))
    return out


def bench(b, kind: str, mode: str, iters: int, sizes: list[int]) -> dict:
    """Each call's median over 5 loops of ``iters`` calls (after 20 warm-up calls), us; a
    rooted call's loops between barriers (its non-root would otherwise run ahead)."""
    if mode == "off":
        header_first()
    elif mode == "big":  # (where one message stops paying)
        pair.FUSE_MAX = pair.BROADCAST_FUSE_MAX = 8 << 20
    out = {}
    for label, f, fenced in calls(b, kind, sizes):
        for _ in range(20):
            f()
        ts = []
        for _ in range(5):
            if fenced:
                fc.barrier(b)
            t = time.perf_counter()
            for _ in range(iters):
                f()
            if fenced:
                fc.barrier(b)
            ts.append((time.perf_counter() - t) / iters * 1e6)
        out[label] = round(sorted(ts)[2], 1)
    return out
