"""``Work``: the handle of an asynchronous collective, a thin layer over ``concurrent.futures``."""

from __future__ import annotations

import concurrent.futures

import numpy as np

from ferro_backend import CollectiveTimeoutError
from ferro_backend.checks import check_timeout


class Work:
    """A collective running in the background (torch's name for it).

    ``wait(timeout)`` returns its result (a new array) or raises what the collective raised;
    ``is_completed()`` tells without blocking; its attribute ``future`` is the underlying
    :class:`concurrent.futures.Future` (for ``add_done_callback``, ``as_completed``...). Several
    may be in flight on one backend at once; their messages never mix with each other or with
    synchronous calls.
    """

    def __init__(self, name: str, seq: int, future: concurrent.futures.Future) -> None:
        self.name = name
        self.seq = seq
        self.future = future

    def is_completed(self) -> bool:
        """True once the collective finished, successfully or not."""
        return self.future.done()

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Block until done (at most ``timeout`` seconds; None waits for the collective's own
        timeout to fire) and return the result; raises the collective's error."""
        if timeout is not None:
            timeout = check_timeout(timeout, "Work.wait: timeout")
        # (not future.result(timeout): the collective's own CollectiveTimeoutError is a
        # TimeoutError too, and must come out as it is)
        done, _ = concurrent.futures.wait([self.future], timeout)
        if not done:
            raise CollectiveTimeoutError(
                f"Work.wait: {self.name} (seq {self.seq}) not complete after {timeout:g}s")
        return self.future.result()

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<Work {self.name} seq={self.seq} {state}>"
