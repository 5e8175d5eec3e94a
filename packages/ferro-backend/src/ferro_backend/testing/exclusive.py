"""One emulated cluster at a time across test processes.

The tests of ``ferrorun --emulate-nodes`` prove that nothing is left behind by counting every
network namespace on the machine before and after a job; two test sessions running at once
(``./dev tests`` runs them in parallel lanes) would see each other's nodes. Tests that make
network namespaces hold :func:`one_emulation_at_a_time` (an exclusive ``flock`` on a file in
the temporary directory) for their whole run.
"""

from __future__ import annotations

import fcntl
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: the lock file every test process uses (one per machine and temporary directory)
LOCK = Path(tempfile.gettempdir()) / "ferro-emulation-tests.lock"


@contextmanager
def one_emulation_at_a_time(timeout: float = 600.0) -> Iterator[None]:
    """Hold the machine's emulation lock while the block runs; TimeoutError naming the lock
    file if another process holds it for ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with open(LOCK, "a") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"one_emulation_at_a_time: {LOCK} held by another "
                                       f"process for {timeout:g}s") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


__all__ = ["LOCK", "one_emulation_at_a_time"]
