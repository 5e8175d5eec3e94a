"""``check_backend``: the conformance kit for transports written outside ferro.

A transport that passes it keeps every promise ferro's collectives, FSDP and checkpoints rely
on. Each promise is checked on a fresh group from ``make_group(n)`` (ranks run as threads), and
a broken one raises AssertionError naming it and what happened.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..base import Backend
from ..errors import CollectiveTimeoutError, PeerAbortedError, PeerClosedError, SizeMismatchError
from .threads import RankFailure, run_threads


def _never_wait(b: Backend) -> None:
    """Every rank sends 3 MiB to every peer before receiving anything."""
    data = np.full(1 << 20, b.rank, dtype=np.uint8)
    for peer in range(b.world_size):
        if peer != b.rank:
            for i in range(3):
                b.send(data, peer, tag=10 + i)
    out = np.empty_like(data)
    for peer in range(b.world_size):
        if peer != b.rank:
            for i in range(3):
                b.recv(out, peer, tag=10 + i, timeout=20)
                assert (out == peer).all(), f"the message {peer} -> {b.rank} arrived garbled"


def _fifo_and_tags(b: Backend) -> None:
    if b.rank == 0:
        for i in range(20):
            b.send(np.array([i], np.int64), 1, tag=5)
        b.send(b"A", 1, tag=1)
        b.send(b"B", 1, tag=2)
    elif b.rank == 1:
        got = np.empty(1, np.int64)
        order = []
        for _ in range(20):
            b.recv(got, 0, tag=5, timeout=20)
            order.append(int(got[0]))
        assert order == list(range(20)), f"FIFO per (src, dst, tag) broken: got {order}"
        x, y = bytearray(1), bytearray(1)
        b.recv(y, 0, tag=2, timeout=20)
        b.recv(x, 0, tag=1, timeout=20)
        assert (bytes(x), bytes(y)) == (b"A", b"B"), f"tags mixed: tag 1 gave {bytes(x)!r}"


def _size_mismatch(b: Backend) -> None:
    if b.rank == 0:
        b.send(np.zeros(8, np.uint8), 1, tag=3)
        b.send(b"ok", 1, tag=3)
    elif b.rank == 1:
        try:
            b.recv(bytearray(4), 0, tag=3, timeout=20)
        except SizeMismatchError:
            pass
        else:
            raise AssertionError("an 8-byte message into a 4-byte buffer raised nothing")
        nxt = bytearray(2)
        b.recv(nxt, 0, tag=3, timeout=20)
        assert bytes(nxt) == b"ok", "the stream is out of step after a SizeMismatchError"


def _timeouts(b: Backend) -> None:
    if b.rank != 0:
        return
    t0 = time.monotonic()
    try:
        b.recv(bytearray(1), 1, tag=99, timeout=0.2)
    except CollectiveTimeoutError:
        # (5 s: room for a loaded host's scheduling stalls, still far past 0.2 s)
        assert time.monotonic() - t0 < 5.0, "the timeout fired long after 0.2 s"
    else:
        raise AssertionError("a receive from a silent peer returned")
    for bad in (float("nan"), -1.0):
        try:
            b.recv(bytearray(1), 1, tag=99, timeout=bad)
        except ValueError:
            continue
        except CollectiveTimeoutError:
            pass
        raise AssertionError(f"timeout={bad!r} did not raise ValueError")
    req = b.irecv(bytearray(1), 1, tag=98)
    assert not req.is_completed() and req.poll(0.01) is False, "a pending irecv says completed"


def _peer_ends(b: Backend, end: Callable[[Backend], None], expected: type, what: str,
               reason: str = "") -> None:
    """Rank 1 ends itself with ``end``; rank 0's receive from it must raise ``expected``
    (naming ``reason`` if given) within 10 s, long before its 30 s timeout (the time counts
    from rank 0's receive, and rank 1's thread may start late on a loaded host)."""
    if b.rank == 1:
        end(b)
    elif b.rank == 0:
        t0 = time.monotonic()
        try:
            b.recv(bytearray(1), 1, tag=7, timeout=30)
        except expected as exc:
            assert time.monotonic() - t0 < 10, f"{expected.__name__} came late"
            assert reason in str(exc), f"the {what} reason is lost: {exc}"
        else:
            raise AssertionError(f"a receive from a peer that {what} returned")


def _closed(b: Backend) -> None:
    _peer_ends(b, lambda me: me.close(), PeerClosedError, "closed")


def _aborted(b: Backend) -> None:
    _peer_ends(b, lambda me: me.abort("conformance abort"), PeerAbortedError, "aborted",
               "conformance abort")


PROMISES: list[tuple[str, Callable[[Backend], None]]] = [
    ("sends never wait for the receiver", _never_wait),
    ("messages are FIFO per (src, dst, tag) and tags are apart", _fifo_and_tags),
    ("a wrong-size receive raises SizeMismatchError and the stream stays in step",
     _size_mismatch),
    ("timeouts fire, bad timeouts raise ValueError, irecv returns a pending Request", _timeouts),
    ("a closed peer gives PeerClosedError", _closed),
    ("abort reaches the peers as PeerAbortedError with the reason", _aborted),
]


def check_backend(make_group: Callable[[int], list[Backend]],
                  world_sizes: Sequence[int] = (2, 3)) -> None:
    """Check every promise of the Backend contract on groups of each size in ``world_sizes``.

    ``make_group(n)`` returns ``n`` connected backends, index ``i`` being rank ``i`` (usable from
    threads, like ``SimulatedBackend.create_group``). Raises AssertionError naming the broken
    promise, the world size and what happened.

    >>> from ferro_backend import SimulatedBackend
    >>> check_backend(SimulatedBackend.create_group)
    """
    run_promises("check_backend", make_group, world_sizes, PROMISES)


def run_promises(kit: str, make_group: Callable[[int], list[Backend]],
                 world_sizes: Sequence[int],
                 promises: Sequence[tuple[str, Callable[[Backend], None]]]) -> None:
    """Run each ``(promise, check)`` on every rank (threads) of a fresh group of each size;
    AssertionError naming the kit, the world size, the promise and what happened."""
    for n in world_sizes:
        group = make_group(n)
        for i, b in enumerate(group):
            assert (b.rank, b.world_size) == (i, n), (
                f"{kit}({n} ranks): backend {i} says rank {b.rank} of {b.world_size}")
        _close_all(group)
        for promise, check in promises:
            group = make_group(n)
            try:
                run_threads(check, group, timeout=60, abort_on_error=False, raise_first=False)
            except RankFailure as exc:
                rank = min(exc.errors)
                err = exc.errors[rank]
                raise AssertionError(f"{kit}({n} ranks): {promise}: rank {rank} raised "
                                     f"{type(err).__name__}: {err}") from err
            except CollectiveTimeoutError as exc:
                raise AssertionError(f"{kit}({n} ranks): {promise}: {exc} (a rank "
                                     "blocked)") from exc
            finally:
                _close_all(group)


def _close_all(group: list[Backend]) -> None:
    """Close every rank at once, as a job's ranks do (a rank's close waits briefly for its
    peers' goodbyes: one after another, each would wait for the next); errors ignored."""
    def close(b: Backend) -> None:
        try:
            b.close()
        except Exception:
            pass

    threads = [threading.Thread(target=close, args=(b,), daemon=True) for b in group]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


__all__ = ["PROMISES", "check_backend"]
