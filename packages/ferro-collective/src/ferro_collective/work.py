"""``Work``: the handle of an asynchronous collective."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from ferro_backend import CollectiveTimeoutError


class Work:
    """A collective running in the background.

    ``wait(timeout)`` returns its result (a new array) or raises what the collective raised;
    ``is_completed()`` tells without blocking. Several may be in flight on one backend at once;
    their messages never mix with each other or with synchronous calls.
    """

    def __init__(self, name: str, seq: int) -> None:
        self.name = name
        self.seq = seq
        self._done = threading.Event()
        self._result: np.ndarray | None = None
        self._error: BaseException | None = None

    def _run(self, fn: Callable[[], np.ndarray]) -> None:
        try:
            self._result = fn()
        except BaseException as exc:
            self._error = exc
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        """True once the collective finished, successfully or not."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Block until done (at most ``timeout`` seconds; None waits for the collective's own
        timeout to fire) and return the result; raises the collective's error."""
        if not self._done.wait(timeout):
            raise CollectiveTimeoutError(
                f"Work.wait: {self.name} (seq {self.seq}) not complete after {timeout:g}s")
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<Work {self.name} seq={self.seq} {state}>"
