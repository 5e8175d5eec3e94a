"""Works (torch's handle of a running operation) and the ordered runner behind them.

Each process group runs its collectives one at a time in the order they were issued, which is
the order every rank issues them in (torch's rule), so every rank's ferro calls line up. A
call issued with ``async_op=False`` while nothing of its group is pending runs at once in the
caller's thread. An asynchronous one where this host's ranks fill its cores
(``FERRO_BACKGROUND``, as ferro-fsdp's wrappers) is deferred: it runs in the thread that first
waits for, polls or asks its Work's future, or issues the group's next collective; it goes to
the worker when a point-to-point operation is issued in the process (its peer may need that
message before it joins the collective, as gloo's thread would have run it meanwhile) or its
Work is waited for with a timeout. Anything else goes to the group's worker thread, so DDP's
gradient allreduces run while autograd computes.
"""

from __future__ import annotations

import collections
import datetime
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ferro_backend import CollectiveTimeoutError

from .errors import FerroTorchError, as_torch_error


def seconds(timeout: Any) -> float | None:
    """A torch timeout (timedelta, seconds or None) in seconds; None for "none given"
    (torch's unset timeouts are zero or negative)."""
    if timeout is None:
        return None
    secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return secs if secs > 0 else None


class FerroWork(dist.Work):
    """One operation of a ferro process group: ``wait()``, ``is_completed()``,
    ``get_future()`` (its value: the operation's output tensors), ``exception()``."""

    #: the Runner holding it deferred (None: it was not deferred)
    _owner: Runner | None = None

    def __init__(self, name: str, outputs: list[torch.Tensor], timeout: float | None = None
                 ) -> None:
        super().__init__()
        self._name = name
        self._outputs = outputs
        #: the operation's deadline in seconds (for the words of a timeout), when known
        self._timeout_s = timeout
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._lock = threading.Lock()
        self._future: torch.futures.Future | None = None

    # -- completion (the runner's side) ----------------------------------------------------
    def _finish(self, exc: BaseException | None = None) -> None:
        with self._lock:
            self._exc = exc
            self._done.set()
            fut = self._future
        if fut is not None:
            self._complete(fut)

    def _complete(self, fut: torch.futures.Future) -> None:
        if self._exc is not None:
            fut.set_exception(self._exc)
        else:
            fut.set_result(self._outputs)

    # -- torch's side ---------------------------------------------------------------------
    def _claim(self, secs: float | None = None) -> None:
        """A deferred operation: run it here (and what its group deferred before it), or, for a
        wait with a timeout, hand it to the group's worker."""
        if self._owner is not None and not self._done.is_set():
            if secs is None:
                self._owner.run_deferred(self)
            else:
                self._owner.hand_over()

    def wait(self, timeout: Any = None) -> bool:
        secs = seconds(timeout)
        self._claim(secs)
        if not self._done.wait(secs):
            raise FerroTorchError(f"ferro {self._name}: Timed out waiting {secs * 1000:.0f}ms "
                                  f"for {self._name} to complete (Work.wait's timeout); the "
                                  "work goes on: a later wait() can still complete it, and a "
                                  "receive still takes the message it waits for")
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        self._claim()
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._exc is None

    def exception(self) -> BaseException | None:
        return self._exc

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        self._claim()
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                done = self._done.is_set()
            else:
                return self._future
        if done:
            self._complete(self._future)
        return self._future

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<FerroWork {self._name} {state}>"


class DoneWork(dist.Work):
    """A synchronous operation that already ran in the caller's thread (``async_op=False``,
    nothing of its group pending): a Work with nothing left to wait for, made without the
    event and lock a pending one needs."""

    _exc = None
    _future: torch.futures.Future | None = None

    def __init__(self, name: str, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._name = name
        self._outputs = outputs

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            fut = torch.futures.Future()
            fut.set_result(self._outputs)
            self._future = fut
        return self._future

    def __repr__(self) -> str:
        return f"<FerroWork {self._name} done>"


class RequestWork(FerroWork):
    """A point-to-point receive: completes when ferro's ``Request`` does (then ``after()``,
    which copies a staged receive into a non-contiguous tensor)."""

    def __init__(self, name: str, outputs: list[torch.Tensor], request, timeout: float,
                 after: Callable[[], None] | None = None) -> None:
        super().__init__(name, outputs, timeout)
        self._request = request
        self._timeout = timeout
        self._after = after
        self._wait_lock = threading.Lock()
        self._waiter: threading.Thread | None = None

    def _settle(self, secs: float | None) -> None:
        with self._wait_lock:
            if self._done.is_set():
                return
            poll = getattr(self._request, "poll", None)
            if secs is not None and poll is not None:
                # Work.wait's own timeout, as on the compiled backend: the receive goes on (a
                # later wait completes it; it takes the message it waits for), where it was
                # withdrawn and the message went to the next receive under its tag
                try:
                    ready = poll(secs)
                except BaseException as exc:
                    self._finish(as_torch_error(exc, f"ferro {self._name}", secs))
                    return
                if not ready:
                    raise as_torch_error(CollectiveTimeoutError(
                        f"{self._name} not complete after {secs:g}s (Work.wait's timeout); the "
                        "work goes on: a later wait() can still complete it, and a receive "
                        "still takes the message it waits for"), f"ferro {self._name}", secs)
                secs = None  # (complete: what follows finds it done)
            wait = self._timeout if secs is None else secs
            try:
                self._request.wait(wait)
                if self._after is not None:
                    self._after()
            except BaseException as exc:
                self._finish(as_torch_error(exc, f"ferro {self._name}", wait))
            else:
                self._finish()

    def wait(self, timeout: Any = None) -> bool:
        self._settle(seconds(timeout))
        return super().wait()

    def _source_rank(self) -> int:
        """The sender of a completed receive (torch asks after ``recv`` without ``src``)."""
        source = getattr(self._request, "source", None)
        if source is None:
            raise RuntimeError(f"ferro {self._name}: no source rank before the receive "
                               "completes")
        return int(source)

    source_rank = _source_rank

    def is_completed(self) -> bool:
        if not self._done.is_set() and self._request.is_completed():
            self._settle(None)
        return self._done.is_set()

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            start = self._waiter is None and not self._done.is_set()
            if start:
                self._waiter = threading.Thread(target=self._settle, args=(None,), daemon=True,
                                                name=f"ferro-torch-{self._name}")
        if start:
            self._waiter.start()
        return super().get_future()


class AllDone:
    """Works seen as one request (``wait``/``is_completed``): what a coalesced group of
    operations completes with (:func:`all_of`)."""

    def __init__(self, works: list[FerroWork]) -> None:
        self._works = works

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for w in self._works:
            w.wait(None if deadline is None else max(1e-6, deadline - time.monotonic()))

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


def all_of(name: str, works: list[FerroWork], timeout: float) -> FerroWork:
    """One Work over ``works`` (their outputs, in order): complete when all of them are, failed
    with the first one's error; ``works[0]`` itself when there is only one."""
    if len(works) == 1:
        return works[0]
    return RequestWork(name, [t for w in works for t in w._outputs], AllDone(works), timeout)


#: the Runners holding deferred operations (a point-to-point call hands them to their workers)
DEFERRING: set = set()


def hand_over_deferred() -> None:
    """Every deferred operation of this process to its group's worker (a point-to-point call
    is issued: the peer may need its message before it joins the collective)."""
    for runner in list(DEFERRING):
        runner.hand_over()


class Runner:
    """Runs one process group's operations one at a time, in issue order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()  # guards _pending, _deferred, the queue and the thread
        # held while an operation runs (re-entrant: a future's callback may run a deferred one)
        self._running = threading.RLock()
        self._pending = 0  # (the deferred ones included)
        self._deferred: collections.deque = collections.deque()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def run_now(self, name: str, deadline: Callable[[], float | None],
                fn: Callable[[], Any]) -> bool:
        """Run ``fn()`` at once in the caller's thread if nothing of this group is pending
        (True; its error raised here, in torch's words, ``deadline()`` the seconds they name),
        else leave it to :meth:`submit` (False)."""
        with self._lock:
            if self._pending:
                return False
            self._pending = 1  # the worker runs nothing while this is 1: no need of _running
        try:
            fn()
        except BaseException as exc:
            err = as_torch_error(exc, f"ferro {name}", deadline())
            if err is exc:
                raise
            raise err from exc
        finally:
            with self._lock:
                self._pending -= 1
        return True

    def submit(self, work: FerroWork, fn: Callable[[], None], inline: bool) -> FerroWork:
        with self._lock:
            self._pending += 1
            inline = inline and self._pending == 1
            if inline:
                self._running.acquire()  # free: nothing of this group is pending
            else:
                self._start()
                self._queue.put((work, fn))
        if inline:
            try:
                self._execute(work, fn)
            finally:
                self._running.release()
                with self._lock:
                    self._pending -= 1
        return work

    def defer(self, work: FerroWork, fn: Callable[[], None]) -> FerroWork:
        """Hold ``work`` until its Work is claimed (:meth:`FerroWork._claim`), the group's next
        operation, or a hand-over; to the worker at once if the worker has some pending."""
        with self._lock:
            if self._pending != len(self._deferred):
                return self.submit_locked(work, fn)
            self._pending += 1
            work._owner = self
            self._deferred.append((work, fn))
            DEFERRING.add(self)
        return work

    def submit_locked(self, work: FerroWork, fn: Callable[[], None]) -> FerroWork:
        """(``_lock`` held) ``work`` to the worker."""
        self._pending += 1
        self._start()
        self._queue.put((work, fn))
        return work

    def _start(self) -> None:
        """(``_lock`` held) the worker thread, made if it was not."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"ferro-torch-{self._name}")
            self._thread.start()

    def run_deferred(self, upto: FerroWork | None = None) -> None:
        """The deferred operations in this thread, in issue order, up to ``upto`` (None: all)."""
        while True:
            with self._running:
                with self._lock:
                    if not self._deferred or (upto is not None and not any(
                            w is upto for w, _ in self._deferred)):
                        return  # (another thread runs it, or the worker does)
                    work, fn = self._deferred.popleft()
                    if not self._deferred:
                        DEFERRING.discard(self)
                try:
                    self._execute(work, fn)
                finally:
                    with self._lock:
                        self._pending -= 1
            if work is upto:
                return

    def hand_over(self) -> None:
        """The deferred operations to the worker, in issue order."""
        with self._lock:
            DEFERRING.discard(self)
            if not self._deferred:
                return
            self._start()
            while self._deferred:
                self._queue.put(self._deferred.popleft())

    @staticmethod
    def _execute(work: FerroWork, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            work._finish(as_torch_error(exc, f"ferro {work._name}", work._timeout_s))
        else:
            work._finish()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._running:
                self._execute(*item)
            with self._lock:
                self._pending -= 1

    def stop(self) -> None:
        self.hand_over()  # (run first, on the worker)
        with self._lock:
            if self._thread is not None:
                self._queue.put(None)
                self._thread = None


__all__ = ["DEFERRING", "AllDone", "DoneWork", "FerroWork", "RequestWork", "Runner", "all_of",
           "hand_over_deferred", "seconds"]
