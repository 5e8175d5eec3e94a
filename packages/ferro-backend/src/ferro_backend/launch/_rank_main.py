"""How ``ferrorun`` starts a rank: die with the launcher, then run the user's script.

``python -m ferro_backend._rank_main <launcher pid> (<script> | -m <module>) [args...]``

Before the script runs, the rank asks the kernel to SIGKILL it when its launcher dies
(``PR_SET_PDEATHSIG``, Linux) and checks that the launcher is still its parent (it may have died
between the fork and the request). A daemon thread also watches the parent every 0.2 s (for
platforms without the prctl, and for a re-parented rank), and ends the rank's whole process
group when the launcher is gone. So ranks never outlive ``ferrorun``, even after a SIGKILL.
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


def _die_with(launcher: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:  # pragma: no cover - no libc to ask: the watch below still works
            pass
    if os.getppid() != launcher:  # the launcher died before the request took effect
        os._exit(128 + signal.SIGKILL)

    def watch() -> None:
        while True:
            time.sleep(WATCH_INTERVAL)
            if os.getppid() != launcher:
                try:
                    os.killpg(os.getpgrp(), signal.SIGKILL)
                finally:
                    os._exit(128 + signal.SIGKILL)

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
