"""``Work``: the handle of an asynchronous collective, a thin layer over ``concurrent.futures``."""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np

from ferro_backend import CollectiveTimeoutError
from ferro_backend.checks import check_timeout
from ferro_backend.tracebacks import user_facing


class Work:
    """A collective running in the background (torch's name for it).

    ``wait(timeout)`` returns its result (a new array) or raises what the collective raised;
    ``is_completed()`` tells without blocking; its attribute ``future`` is the underlying
    :class:`concurrent.futures.Future` (for ``add_done_callback``, ``as_completed``...). Several
    may be in flight on one backend at once; their messages never mix with each other or with
    synchronous calls.

    Parameters
    ----------
    name : str
        The collective's name (for messages).
    seq : int
        Its sequence number on its backend.
    future : concurrent.futures.Future
        The running call. The ``*_async`` collectives create Work; user code does not.

    Examples
    --------
    >>> work = allreduce_async(grads, backend)
    >>> loss = compute_more()  # overlaps the allreduce
    >>> total = work.wait()
    """

    def __init__(self, name: str, seq: int, future: concurrent.futures.Future) -> None:
        self.name = name
        self.seq = seq
        self.future = future

    def is_completed(self) -> bool:
        """True once the collective finished, successfully or not.

        Returns
        -------
        bool
            Without blocking: whether :meth:`wait` would return (or raise) at once.
        """
        return self.future.done()

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Block until done (at most ``timeout`` seconds; None waits for the collective's own
        timeout to fire) and return the result; raises the collective's error.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most (default None: until the collective completes or fails).

        Returns
        -------
        numpy.ndarray
            The collective's result (a list for all_gather_v/all_to_all, an object for the
            object collectives, None for barrier and off the root of reduce/gather).

        Raises
        ------
        CollectiveTimeoutError
            Not complete after ``timeout`` seconds (the collective keeps running).
        ValueError
            ``timeout`` is negative or not a number.
        Exception
            Whatever the collective raised (CollectiveMismatchError, TypeError...).

        Examples
        --------
        >>> work = allreduce_async(np.ones(4), backend)
        >>> work.wait(timeout=30.0)
        array([4., 4., 4., 4.])
        """
        if timeout is not None:
            timeout = check_timeout(timeout, "Work.wait: timeout")
            if timeout >= threading.TIMEOUT_MAX:  # (inf: as long as it takes, as None)
                timeout = None
        # (not future.result(timeout): the collective's own CollectiveTimeoutError is a
        # TimeoutError too, and must come out as it is)
        done, _ = concurrent.futures.wait([self.future], timeout)
        if not done:
            raise CollectiveTimeoutError(
                f"Work.wait: {self.name} (seq {self.seq}) not complete after {timeout:g}s")
        error = self.future.exception()
        if error is not None:
            raise user_facing(error)  # its traceback ends here, not in the worker thread
        return self.future.result()

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<Work {self.name} seq={self.seq} {state}>"
