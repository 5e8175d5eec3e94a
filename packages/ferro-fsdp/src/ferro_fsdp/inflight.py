"""What an FSDP unit has in flight: collectives started together and waited for as one,
finished ones shaped like them, and pooled buffers given back once every collective that reads
them is done (a backend's async workers run its calls side by side, so the last one started may
end first)."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import numpy as np

from ferro_collective import Work


class Works:
    """Collectives started together, one per parameter, waited for as one: ``wait`` (or
    ``result``) returns ``value``, the buffer they all write into."""

    def __init__(self, works: list[Work], value: np.ndarray) -> None:
        self.works = works
        self.value = value

    def wait(self, timeout: float | None = None) -> np.ndarray:
        for work in self.works:
            work.wait(timeout)
        return self.value

    def result(self) -> np.ndarray:
        return self.wait()


class DoneWork:
    """A reduction that needed no communication (a group of one), shaped like a Work."""

    def __init__(self, value: np.ndarray) -> None:
        self.value = value

    def wait(self, timeout: float | None = None) -> np.ndarray:
        return self.value


def ready(value: np.ndarray) -> concurrent.futures.Future:
    """A finished all-gather (a group of one) as a future like an async one's."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


def give_when_done(futures: list, pool: Any, buf: np.ndarray | None) -> None:
    """Give ``buf`` back to ``pool`` once every one of ``futures`` is done."""
    left, lock = [len(futures)], threading.Lock()

    def done(_: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            pool.give(buf)

    for future in futures:
        future.add_done_callback(done)


__all__ = ["DoneWork", "Works", "give_when_done", "ready"]
