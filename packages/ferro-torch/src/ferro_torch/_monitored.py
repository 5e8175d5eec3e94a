"""``monitored_barrier`` as gloo runs it, on a ferro transport.

Every rank but 0 sends rank 0 a token and waits for its acknowledgement; rank 0 waits for each
token in rank order and acknowledges once all have come. So rank 0 can say which ranks did not
arrive within the timeout, in gloo's words ("Rank 1 failed to pass monitoredBarrier in 2000 ms",
"Ranks 1, 3 failed ..." with ``wait_all_ranks``, "Rank 0 timed out in monitoredBarrier after
0 ms"), and the other ranks that it did not release say that they reached the barrier but heard
nothing back from rank 0. ferro's own error follows in parentheses.
"""

from __future__ import annotations

import time

from ferro_backend import Backend

from ._work import hand_over_deferred
from .errors import FerroTorchError

#: the messages of a monitored barrier: a tag of ferro's own range ([2**31, 2**32)) that
#: ferro-collective's sequence tags (below 2**32 - 4096) and ferro-backend's fixed tags
#: (2**32 - 1, - 3, - 5) do not use
MONITORED_BARRIER_TAG = (1 << 32) - 64
#: the shortest wait ferro's receives accept, used when no time is left
_MIN_WAIT = 1e-4


def _fail(message: str, cause: BaseException | None = None) -> FerroTorchError:
    detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    err = FerroTorchError(message + detail, cause)
    err.__cause__ = cause
    return err


def monitored_barrier(b: Backend, timeout: float, wait_all_ranks: bool = False) -> None:
    """Block until every rank of ``b`` has called this, or raise :class:`FerroTorchError`
    naming the rank(s) that did not arrive within ``timeout`` seconds (on rank 0) or saying
    that rank 0 did not release this rank (on the others)."""
    n, me = b.world_size, b.rank
    if n == 1:
        return
    hand_over_deferred()  # (point-to-point messages: a peer may wait in a deferred collective)
    ms = f"{timeout * 1000:.0f}"
    token = bytearray(1)
    if me != 0:
        try:
            b.send(b"\x01", 0, tag=MONITORED_BARRIER_TAG)
            b.recv(token, 0, tag=MONITORED_BARRIER_TAG, timeout=max(timeout, _MIN_WAIT))
        except Exception as exc:
            raise _fail(f"Rank {me} successfully reached monitoredBarrier, but received errors "
                        "while waiting for send/recv from rank 0. Please check rank 0 logs for "
                        "faulty rank.", exc) from exc
        return
    start = time.monotonic()
    failed: list[int] = []
    processed: list[int] = []
    for r in range(1, n):  # a receive that times out is withdrawn: no stale buffer is left
        if wait_all_ranks:  # each rank gets the whole timeout, as gloo gives it
            left = timeout
        else:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                raise _fail(f"[Rank 0]: Rank 0 timed out in monitoredBarrier after {ms} ms. "
                            f"Successfully processed ranks: {_join(processed)}")
        try:
            b.recv(token, r, tag=MONITORED_BARRIER_TAG, timeout=max(left, _MIN_WAIT))
        except Exception as exc:
            if not wait_all_ranks:
                raise _fail(f"[Rank 0]: Rank {r} failed to pass monitoredBarrier in {ms} ms",
                            exc) from exc
            failed.append(r)
        else:
            processed.append(r)
    if failed:
        raise _fail(f"[Rank 0]: Ranks {_join(failed)} failed to pass monitoredBarrier in "
                    f"{ms} ms")
    for r in range(1, n):
        b.send(b"\x01", r, tag=MONITORED_BARRIER_TAG)


def _join(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


__all__ = ["MONITORED_BARRIER_TAG", "monitored_barrier"]
