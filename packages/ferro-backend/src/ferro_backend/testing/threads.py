"""Ranks as threads: one function per rank over a :class:`~ferro_backend.SimulatedBackend`
group (:func:`run_ranks`) or over backends made elsewhere (:func:`run_threads`), every thread
joined with a timeout, the first rank's error re-raised."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..base import Backend
from ..errors import CollectiveTimeoutError, PeerClosedError
from ..simulated import SimulatedBackend

T = TypeVar("T")


class RankFailure(RuntimeError):
    """Raised by :func:`run_ranks` when a rank raised; ``errors`` maps rank -> exception."""

    def __init__(self, errors: dict[int, BaseException]) -> None:
        first = min(errors)
        super().__init__(f"rank {first} raised {type(errors[first]).__name__}: {errors[first]}")
        self.errors = errors


def _start_and_join(body: Callable[[int, Any], None], items: Sequence[Any], timeout: float,
                    name: str) -> list[int]:
    """``body(i, item)`` for each item in a daemon thread of its own, each joined with
    ``timeout``; the indices of the threads still running."""
    threads = [threading.Thread(target=body, args=(i, x), name=f"{name}-{i}", daemon=True)
               for i, x in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return [i for i, t in enumerate(threads) if t.is_alive()]


def run_threads(fn: Callable[[Backend], T], backends: Sequence[Backend], *,
                timeout: float = 60.0, abort_on_error: bool = True,
                raise_first: bool = True) -> list[T]:
    """Run ``fn(backend)`` for each backend in its own thread; return results by index.

    Each thread is joined with ``timeout``. If a rank raises, its backend is aborted (so the
    others stop waiting) and, with ``raise_first``, that rank's exception is re-raised after all
    threads ended; otherwise :class:`RankFailure` carries every rank's error.
    """
    results: list[Any] = [None] * len(backends)
    errors: dict[int, BaseException] = {}

    def body(i: int, backend: Backend) -> None:
        try:
            results[i] = fn(backend)
        except BaseException as exc:
            errors[i] = exc
            if abort_on_error:
                try:
                    backend.abort(f"{type(exc).__name__}: {exc}")
                except Exception:
                    pass

    stuck = _start_and_join(body, backends, timeout, "ferro-rank")
    if stuck:
        for b in backends:
            try:
                b.abort(f"run_threads: ranks {stuck} still running after {timeout:g}s")
            except Exception:
                pass
        raise CollectiveTimeoutError(f"run_threads: ranks {stuck} did not finish in {timeout:g}s")
    if errors:
        if raise_first:
            # The root cause is the error that is not a consequence of another rank's abort.
            primary = {i: e for i, e in errors.items() if not isinstance(e, PeerClosedError)}
            pick = primary or errors
            raise pick[min(pick)]
        raise RankFailure(errors)
    return results


def outcomes(fn: Callable[..., T], calls: Sequence[tuple], *, timeout: float = 60.0
             ) -> list[T | BaseException]:
    """Run ``fn(*args)`` for each ``args`` of ``calls`` in its own thread; each call's result,
    or the exception it raised (returned, not raised: tests of failures inspect every one).
    A thread still running after ``timeout`` is a :class:`CollectiveTimeoutError`."""
    out: list[Any] = [None] * len(calls)

    def body(i: int, args: tuple) -> None:
        try:
            out[i] = fn(*args)
        except BaseException as exc:
            out[i] = exc

    stuck = _start_and_join(body, calls, timeout, "ferro-call")
    if stuck:
        raise CollectiveTimeoutError(f"outcomes: calls {stuck} did not finish in {timeout:g}s")
    return out


def run_ranks(fn: Callable[[Backend], T], world_size: int, *, timeout: float = 60.0,
              backend_timeout: float | None = None, **kwargs: Any) -> list[T]:
    """Create a simulated group of ``world_size`` and run ``fn(backend)`` on every rank.

    Examples
    --------
    >>> run_ranks(lambda b: b.rank * 10, 3)
    [0, 10, 20]
    """
    group = SimulatedBackend.create_group(
        world_size, **({} if backend_timeout is None else {"timeout": backend_timeout}))
    try:
        return run_threads(fn, group, timeout=timeout, **kwargs)
    finally:
        for b in group:
            b.close()


# ----------------------------------------------------------------------------- real processes


__all__ = ["RankFailure", "run_ranks", "run_threads"]
