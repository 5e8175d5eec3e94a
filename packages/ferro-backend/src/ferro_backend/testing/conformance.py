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


# tags that differ from 5 only above bit 31: what a subgroup's message carries there (its id,
# bit 31 of the id always set), so a transport that keeps 32 bits of the tag mixes them
WIDE_TAGS = (5, (1 << 32) | 5, (0x80000001 << 32) | 5, (0xFFFFFFFF << 32) | 5)


def _wide_tags(b: Backend) -> None:
    if b.rank == 0:
        for i, tag in reversed(list(enumerate(WIDE_TAGS))):  # the widest first
            b.send(bytes([i]), 1, tag=tag)
    elif b.rank == 1:
        got = bytearray(1)
        for i, tag in enumerate(WIDE_TAGS):  # the narrowest first
            b.recv(got, 0, tag=tag, timeout=20)
            assert got[0] == i, (
                f"tags {WIDE_TAGS[got[0]]:#x} and {tag:#x} mixed (the same low 32 bits): tags "
                f"are 64-bit, a subgroup's id travels above bit 31")


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
    from rank 0's receive, and rank 1's thread may start late on a loaded host); then a send
    to it raises too."""
    if b.rank == 1:
        end(b)
    elif b.rank == 0:
        _raises_within(b, 1, expected, what, reason, tag=7)
        _send_raises(b, 1, what)


def _raises_within(b: Backend, peer: int, expected: type, what: str, reason: str,
                   tag: int) -> None:
    """``b``'s receive from ``peer`` on ``tag`` raises ``expected`` naming ``reason``."""
    t0 = time.monotonic()
    try:
        b.recv(bytearray(1), peer, tag=tag, timeout=30)
    except expected as exc:
        assert time.monotonic() - t0 < 10, f"{expected.__name__} came late"
        assert reason in str(exc), f"the {what} reason is lost: {exc}"
    except PeerClosedError as exc:  # (expected is PeerAbortedError)
        raise AssertionError(
            f"a receive from a peer that {what} raised {type(exc).__name__}, not "
            f"{expected.__name__}: {exc} (the inherited Backend.abort only closes the backend: "
            f"implement abort)") from exc
    else:
        raise AssertionError(f"a receive from a peer that {what} returned")


def _send_raises(b: Backend, peer: int, what: str) -> None:
    try:
        b.send(b"x", peer, tag=7)
    except PeerClosedError:
        return
    raise AssertionError(f"a send to a peer that {what} (known) raised nothing")


def _closed(b: Backend) -> None:
    _peer_ends(b, lambda me: me.close(), PeerClosedError, "closed")


def _aborted(b: Backend) -> None:
    _peer_ends(b, lambda me: me.abort("conformance abort"), PeerAbortedError, "aborted",
               "conformance abort")


def _abort_wins_over_data(b: Backend) -> None:
    """Rank 0 sends, then aborts; once rank 1 knows it, the message is abandoned: its receive
    raises PeerAbortedError (a late rank must not complete a collective rank 0 gave up on)."""
    if b.rank == 0:
        b.send(b"D", 1, tag=7)
        b.abort("conformance abort")
    elif b.rank == 1:
        _raises_within(b, 0, PeerAbortedError, "aborted", "conformance abort", tag=8)  # now known
        try:
            b.recv(bytearray(1), 0, tag=7, timeout=10)
        except PeerAbortedError:
            pass
        else:
            raise AssertionError("a message sent before its sender aborted was delivered "
                                 "after the abort was known (abort must win over data)")
        _send_raises(b, 0, "aborted")


def _after(end: Callable[[Backend], None], what: str) -> Callable[[Backend], None]:
    """Rank 0 ends itself with ``end``; every later call on it raises PeerClosedError (or a
    subclass): peer_failure (which the layers above ask before each collective, on one rank
    too), barrier, send and receive (to and from a peer that is still up); close again
    returns."""
    def check(b: Backend) -> None:
        if b.rank != 0:
            return
        end(b)
        failure = b.peer_failure("conformance", b.rank)
        assert isinstance(failure, PeerClosedError), (
            f"after {what}, peer_failure(op, rank) is {failure!r}, not a PeerClosedError: the "
            f"layers above ask it before every collective (call super().close() in close)")
        calls: list[tuple[str, Callable[[], object]]] = [("barrier", lambda: b.barrier(
            timeout=10))]
        if b.world_size > 1:
            calls += [("send", lambda: b.send(b"x", 1, tag=9)),
                      ("recv", lambda: b.recv(bytearray(1), 1, tag=9, timeout=10))]
        for name, call in calls:
            try:
                call()
            except PeerClosedError:
                continue
            except CollectiveTimeoutError as exc:
                raise AssertionError(f"{name} after {what} waited out its timeout instead of "
                                     f"raising PeerClosedError") from exc
            raise AssertionError(f"{name} after {what} raised nothing")
        b.close()

    return check


_after_close = _after(lambda b: b.close(), "close()")
_after_abort = _after(lambda b: b.abort("conformance abort"), "abort()")
ONE_RANK = frozenset({_after_close, _after_abort})
"""The checks that also run on a one-rank group (the others need two ranks)."""

PROMISES: list[tuple[str, Callable[[Backend], None]]] = [
    ("sends never wait for the receiver", _never_wait),
    ("messages are FIFO per (src, dst, tag) and tags are apart", _fifo_and_tags),
    ("tags are 64-bit: tags equal in their low 32 bits are apart", _wide_tags),
    ("a wrong-size receive raises SizeMismatchError and the stream stays in step",
     _size_mismatch),
    ("timeouts fire, bad timeouts raise ValueError, irecv returns a pending Request", _timeouts),
    ("a closed peer gives PeerClosedError", _closed),
    ("abort reaches the peers as PeerAbortedError with the reason", _aborted),
    ("abort wins over data: once an abort is known, receives from the aborted rank raise "
     "PeerAbortedError even with its earlier messages queued", _abort_wins_over_data),
    ("every call after close() raises PeerClosedError", _after_close),
    ("every call after abort() raises PeerClosedError", _after_abort),
]


def check_backend(make_group: Callable[[int], list[Backend]],
                  world_sizes: Sequence[int] = (2, 3)) -> None:
    """Check every promise of the Backend contract on groups of each size in ``world_sizes``.

    ``make_group(n)`` returns ``n`` connected backends, index ``i`` being rank ``i`` (usable from
    threads, like ``SimulatedBackend.create_group``). Raises AssertionError naming the broken
    promise, the world size and what happened. A world size of 1 runs the promises one rank
    can keep (every call after ``close()`` or ``abort()`` raises ``PeerClosedError``).

    >>> from ferro_backend import SimulatedBackend
    >>> check_backend(SimulatedBackend.create_group)
    """
    run_promises("check_backend", make_group, world_sizes, PROMISES)


def run_promises(kit: str, make_group: Callable[[int], list[Backend]],
                 world_sizes: Sequence[int],
                 promises: Sequence[tuple[str, Callable[[Backend], None]]]) -> None:
    """Run each ``(promise, check)`` on every rank (threads) of a fresh group of each size;
    AssertionError naming the kit, the world size, the promise and what happened. On one rank,
    only the checks in :data:`ONE_RANK` run."""
    for n in world_sizes:
        group = make_group(n)
        for i, b in enumerate(group):
            assert (b.rank, b.world_size) == (i, n), (
                f"{kit}({n} ranks): backend {i} says rank {b.rank} of {b.world_size}")
        _close_all(group)
        for promise, check in promises:
            if n < 2 and check not in ONE_RANK:
                continue
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
