"""How ``ferrorun`` starts a rank: die with the launcher, then run the user's script.

``python -m ferro_backend._rank_main <launcher pid> (<script> | -m <module>) [args...]``

Before the script runs, the rank asks the kernel to send it a signal of its own when its launcher
dies (``PR_SET_PDEATHSIG`` with :data:`DEATH_SIGNAL`, Linux), and checks that the launcher is still
its parent (it may have died between the fork and the request). The signal's handler ends the
rank's whole process group (``ferrorun`` starts each rank as the leader of a new one: the rank and
every process it started, which a plain SIGKILL of the rank would leave running) and then the
rank. A daemon thread also watches the parent every 0.2 s (for platforms without the prctl, for a
rank whose main thread is held in C code so the handler cannot run, and for a script that replaced
the handler) and does the same when the launcher is gone. So ranks and their children never
outlive ``ferrorun``, even after a SIGKILL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import runpy
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL = 0.2
#: the signal the kernel sends the rank when its launcher dies: one no library handles (SIGTERM is
#: the script's, to end cleanly), and catchable, so the rank can end its process group first
DEATH_SIGNAL = signal.SIGRTMAX - 2 if hasattr(signal, "SIGRTMAX") else signal.SIGTERM


def _end_all(group: int | None) -> None:
    """SIGKILL to the rank's process group (``group``: None when the rank was not started as
    its leader, so the group is someone else's) and then to the rank itself, wherever it is."""
    if group is not None:
        try:
            os.killpg(group, signal.SIGKILL)  # atomically: the rank and what it started
        except OSError:
            pass
    try:
        os.kill(os.getpid(), signal.SIGKILL)
    finally:
        os._exit(128 + signal.SIGKILL)


def _die_with(launcher: int) -> None:
    rank = os.getpid()
    # the group ferrorun made for this rank (it leads it); a rank that moves itself to another
    # group later still ends this one, which its children stay in, and then itself
    group = rank if os.getpgrp() == rank else None

    def on_death_signal(signum, frame) -> None:
        # a forked copy of the rank is not the rank; the kernel also sends the signal when the
        # launcher's thread that started the rank ends, with the launcher still running
        if os.getpid() == rank and os.getppid() != launcher:
            _end_all(group)

    if sys.platform.startswith("linux"):
        try:
            signal.signal(DEATH_SIGNAL, on_death_signal)  # before the request: no window
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, DEATH_SIGNAL, 0, 0, 0)
        except (OSError, ValueError):  # pragma: no cover - no libc to ask: the watch still works
            pass
    if os.getppid() != launcher:  # the launcher died before the request took effect
        _end_all(group)

    def watch() -> None:
        while True:
            time.sleep(WATCH_INTERVAL)
            if os.getppid() != launcher:
                _end_all(group)

    threading.Thread(target=watch, name="ferrorun-parent-watch", daemon=True).start()


def main() -> None:
    launcher = int(sys.argv[1])
    _die_with(launcher)
    try:
        if sys.argv[2] == "-m":
            sys.argv = [sys.argv[3], *sys.argv[4:]]
            runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.argv = sys.argv[2:]
            sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
            runpy.run_path(sys.argv[0], run_name="__main__")
    except KeyboardInterrupt:
        # Ctrl-C reaches every rank: one line each, not a traceback each
        sys.stderr.write(f"interrupted (rank {os.environ.get('RANK', '?')})\n")
        sys.exit(128 + signal.SIGINT)


if __name__ == "__main__":
    main()
