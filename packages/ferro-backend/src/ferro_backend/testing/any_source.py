"""``check_any_source``: the conformance kit of ``Backend.irecv_any``/``recv_any`` (receives
from any rank), for the transports that offer them: every ferro transport, and any outside
transport that implements them. Ranks run as threads on a fresh group per promise, as
:func:`~ferro_backend.testing.check_backend` runs them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from ..base import Backend
from ..errors import CollectiveTimeoutError, PeerAbortedError, PeerClosedError, SizeMismatchError
from .conformance import run_promises

GO = 90  # the tag of the go-ahead messages that order the promises' steps


def _from_everyone(b: Backend) -> None:
    """Every other rank sends 4 messages of 4 KiB and one of 1 MiB: rank 0 takes them all
    from any rank, each sender's in its order, each naming its sender."""
    n = b.world_size
    if b.rank != 0:
        for i in range(4):
            b.send(np.full(512, b.rank * 100 + i, np.int64), 0, tag=7)
        b.send(np.full(1 << 17, b.rank, np.int64), 0, tag=8)
        return
    seen: dict[int, int] = dict.fromkeys(range(1, n), 0)
    out = np.empty(512, np.int64)
    for _ in range(4 * (n - 1)):
        src = b.recv_any(out, tag=7, timeout=20)
        assert src in seen, f"recv_any named rank {src} as the sender"
        assert (out == src * 100 + seen[src]).all(), (
            f"message {seen[src]} from rank {src} arrived out of order or garbled: {out[:2]}")
        seen[src] += 1
    big = np.empty(1 << 17, np.int64)
    senders = set()
    for _ in range(n - 1):
        src = b.recv_any(big, tag=8, timeout=20)
        assert (big == src).all(), f"the 1 MiB message from rank {src} arrived garbled"
        senders.add(src)
    assert senders == set(range(1, n)), f"1 MiB messages came from {sorted(senders)}"


def _posting_order(b: Backend) -> None:
    """Receives match in the order they were posted, from one rank or from any."""
    if b.rank == 0:
        one, anyone = bytearray(1), bytearray(1)
        first = b.irecv(one, 1, tag=3)
        second = b.irecv_any(anyone, tag=3)
        b.send(b"g", 1, tag=GO)
        first.wait(20)
        second.wait(20)
        assert (bytes(one), bytes(anyone), second.source) == (b"A", b"B", 1), (
            f"posted from rank 1 then from any: got {bytes(one)!r}, {bytes(anyone)!r} "
            f"(source {second.source})")
        third = b.irecv_any(anyone, tag=4)
        fourth = b.irecv(one, 1, tag=4)
        b.send(b"g", 1, tag=GO)
        third.wait(20)
        fourth.wait(20)
        assert (bytes(anyone), bytes(one)) == (b"C", b"D"), (
            f"posted from any then from rank 1: got {bytes(anyone)!r}, {bytes(one)!r}")
    elif b.rank == 1:
        for tag, pair in ((3, b"AB"), (4, b"CD")):
            b.recv(bytearray(1), 0, tag=GO, timeout=20)
            b.send(pair[:1], 0, tag=tag)
            b.send(pair[1:], 0, tag=tag)


def _queued_first(b: Backend) -> None:
    """Messages that arrived before the receive are taken, each once."""
    n = b.world_size
    if b.rank == 0:
        for r in range(1, n):
            b.recv(bytearray(1), r, tag=GO, timeout=20)  # sent after its message
        got = {}
        for _ in range(n - 1):
            out = bytearray(2)
            src = b.recv_any(out, tag=5, timeout=20)
            got[src] = bytes(out)
        assert got == {r: bytes([r, r]) for r in range(1, n)}, f"queued messages: got {got}"
        req = b.irecv_any(bytearray(2), tag=5)
        assert not req.poll(0.05), "a receive from any rank completed with nothing sent"
    else:
        b.send(bytes([b.rank, b.rank]), 0, tag=5)
        b.send(b"q", 0, tag=GO)


def _raises(call: Callable[[], object], error: type[BaseException], what: str) -> BaseException:
    """``call()`` must raise ``error`` (returned); AssertionError saying ``what`` if not."""
    try:
        call()
    except error as exc:
        return exc
    raise AssertionError(what)


def _timeout_then_later_message(b: Backend) -> None:
    """A receive from any rank times out at its deadline and is withdrawn: the message sent
    after goes to the next receive."""
    if b.rank == 0:
        start = time.monotonic()
        exc = _raises(lambda: b.recv_any(bytearray(4), tag=6, timeout=0.3),
                      CollectiveTimeoutError, "recv_any with nothing sent did not time out")
        took = time.monotonic() - start
        assert 0.25 <= took < 5, f"recv_any(timeout=0.3) raised after {took:.2f}s"
        assert "any rank" in str(exc), f"the timeout does not say 'any rank': {exc}"
        b.send(b"g", 1, tag=GO)
        out = bytearray(4)
        src = b.recv_any(out, tag=6, timeout=20)
        assert (src, bytes(out)) == (1, b"late"), f"after a timeout: {src}, {bytes(out)!r}"
    elif b.rank == 1:
        b.recv(bytearray(1), 0, tag=GO, timeout=20)
        b.send(b"late", 0, tag=6)


def _size_mismatch(b: Backend) -> None:
    if b.rank == 0:
        exc = _raises(lambda: b.recv_any(bytearray(4), tag=2, timeout=20), SizeMismatchError,
                      "an 8-byte message into 4 bytes did not raise SizeMismatchError")
        assert "8" in str(exc) and "4" in str(exc), f"sizes not named: {exc}"
        out = bytearray(2)
        assert (b.recv_any(out, tag=2, timeout=20), bytes(out)) == (1, b"ok")
    elif b.rank == 1:
        b.send(np.zeros(8, np.uint8), 0, tag=2)
        b.send(b"ok", 0, tag=2)


def _abort(b: Backend) -> None:
    if b.rank == 0:
        exc = _raises(lambda: b.recv_any(bytearray(1), tag=1, timeout=20), PeerAbortedError,
                      "recv_any after an abort returned")
        assert "rank 1" in str(exc) and "gave up" in str(exc), exc
    elif b.rank == 1:
        time.sleep(0.1)
        b.abort("gave up")


def _everyone_gone(b: Backend) -> None:
    """Messages sent before their senders closed are still received; then, every other rank
    gone, a receive from any rank fails (no wait for the timeout)."""
    if b.rank == 0:
        time.sleep(0.3)  # the others have sent and closed by now
        for _ in range(b.world_size - 1):
            out = bytearray(1)
            src = b.recv_any(out, tag=1, timeout=20)
            assert bytes(out) == bytes([src]), f"last message of rank {src}: {bytes(out)!r}"
        start = time.monotonic()
        _raises(lambda: b.recv_any(bytearray(1), tag=1, timeout=20), PeerClosedError,
                "recv_any with every other rank closed returned")
        assert time.monotonic() - start < 15, "PeerClosedError only near the timeout"
    else:
        b.send(bytes([b.rank]), 0, tag=1)
        b.close()


PROMISES: list[tuple[str, Callable[[Backend], None]]] = [
    ("messages from every rank, per-sender FIFO, sources named", _from_everyone),
    ("receives match in posting order", _posting_order),
    ("queued messages are taken, each once", _queued_first),
    ("a timeout names 'any rank' and withdraws the receive", _timeout_then_later_message),
    ("a wrong-size message gives SizeMismatchError", _size_mismatch),
    ("an abort gives PeerAbortedError", _abort),
    ("queued messages outlive their closed senders, then PeerClosedError", _everyone_gone),
]


def check_any_source(make_group: Callable[[int], list[Backend]],
                     world_sizes: Sequence[int] = (2, 3)) -> None:
    """Check every promise of ``Backend.irecv_any``/``recv_any`` on groups of each size in
    ``world_sizes`` (``make_group`` as for :func:`check_backend`); AssertionError naming the
    broken promise.

    >>> from ferro_backend import SimulatedBackend
    >>> check_any_source(SimulatedBackend.create_group)
    """
    run_promises("check_any_source", make_group, world_sizes, PROMISES)


__all__ = ["check_any_source"]
