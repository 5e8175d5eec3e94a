"""One emulated cluster at a time across test processes.

The tests of ``ferrorun --emulate-nodes`` prove that nothing is left behind by counting every
network namespace on the machine before and after a job; two test sessions running at once
(``./dev tests`` runs them in parallel lanes) would see each other's nodes. Tests that make
network namespaces hold :func:`one_emulation_at_a_time` (an exclusive ``flock`` on a file in
the temporary directory) for their whole run.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: the lock file every test process uses (one per machine and temporary directory)
LOCK = Path(tempfile.gettempdir()) / "ferro-emulation-tests.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - another user's process
        return True
    return True


def _first_in_line(ticket: Path) -> bool:
    """Whether ``ticket`` is the oldest ticket of a live process (dead ones' are removed)."""
    for other in sorted(LOCK.parent.glob(LOCK.name + ".ticket.*")):
        if other == ticket:
            return True
        if not _alive(int(other.name.rsplit(".", 1)[1])):
            other.unlink(missing_ok=True)
            continue
        return False
    return True  # pragma: no cover - our ticket was removed by someone


@contextmanager
def one_emulation_at_a_time(timeout: float = 600.0) -> Iterator[None]:
    """Hold the machine's emulation lock while the block runs; TimeoutError naming the lock
    file if another process holds it for ``timeout`` seconds.

    Processes take the lock in the order they asked for it (a ticket file each, named by the
    time it was taken): a test file that takes it for every test cannot starve another lane's
    test of it, as a lock polled every 0.1 s let it."""
    deadline = time.monotonic() + timeout
    ticket = LOCK.parent / f"{LOCK.name}.ticket.{time.time_ns():020d}.{os.getpid()}"
    ticket.touch()
    try:
        with open(LOCK, "a") as f:
            while True:
                if _first_in_line(ticket):
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"one_emulation_at_a_time: {LOCK} held by another "
                                       f"process for {timeout:g}s") from None
                time.sleep(0.05)
            ticket.unlink(missing_ok=True)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        ticket.unlink(missing_ok=True)


__all__ = ["LOCK", "one_emulation_at_a_time"]
