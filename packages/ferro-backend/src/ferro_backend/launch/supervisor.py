"""How ``ferrorun`` watches the processes it starts (ranks, or one agent per emulated node): their
output copied line by line with a prefix (:mod:`.output`), the first failure stopping the rest
(SIGTERM, then SIGKILL after a grace period, each process group whole), and the restart loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .output import Sink, open_logs, pump


def _describe(code: int) -> str:
    """How a rank ended: ``exited with code 3`` or ``was killed by SIGKILL``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, SIGTSTP: state ``T`` in /proc; not one a
    debugger holds, ``t``); False where /proc does not tell (not Linux, the process gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 1:].split()   # the command name may hold anything
    return bool(fields) and fields[0] == b"T"


Spawn = Callable[[int, list[str], dict[str, str]], subprocess.Popen]


class Job:
    """Processes ``cmds[i]`` with ``envs[i]``, named ``f"{label} {ranks[i]}"``; each in a session of
    its own (:data:`PIPES`), started by ``spawn(i, cmd, env)`` (default: plainly)."""

    PIPES = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "start_new_session": True}

    def __init__(self, cmds: list[list[str]], envs: list[dict[str, str]], ranks: list[int],
                 grace: float, prefix: bool, log_dir: Path | None = None, *,
                 spawn: Spawn | None = None, label: str = "rank", append: bool = False) -> None:
        self.grace = grace
        self.label = label
        self.failure: tuple[int, int] | None = None  # (rank, return code) of the first failure
        self.interrupted = False  # ferrorun passed a SIGINT/SIGTERM on to every process
        self.signal: int | None = None  # the signal it passed on (the first one)
        self.kill_at: float | None = None  # when the processes still running then get SIGKILL
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.stop_pumps = threading.Event()
        self.logs: list = []
        self.ranks = ranks
        spawn = spawn or (lambda i, cmd, env: subprocess.Popen(cmd, env=env, **Job.PIPES))
        # log files first: one that cannot be written (LogDirError) starts no process
        files: list[dict] = []
        try:
            for rank in ranks:
                files.append(open_logs(log_dir, rank, append) if log_dir is not None else {})
                self.logs += files[-1].values()
        except OSError:
            for log in self.logs:
                log.close()
            raise
        sinks = {"stdout": Sink(sys.stdout), "stderr": Sink(sys.stderr)}
        for i, (cmd, env, rank) in enumerate(zip(cmds, envs, ranks)):
            p = spawn(i, cmd, env)
            self.procs.append(p)
            tag = f"[{label} {rank}] " if prefix else ""
            for name, stream in (("stdout", p.stdout), ("stderr", p.stderr)):
                logs = [files[i][k] for k in ("log", name) if k in files[i]]
                t = threading.Thread(target=pump, name=f"ferrorun-{name}-{rank}", daemon=True,
                                     args=(stream, sinks[name], tag, logs, self.stop_pumps))
                t.start()
                self.pumps.append(t)

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, sig)  # the rank and everything it started
            except ProcessLookupError:
                pass

    def interrupt(self, sig: int) -> None:
        """Pass ``sig`` (sent to ferrorun) on to every process; each gets the grace period,
        counted from the first signal, to end on its own (one that ends first must not cut the
        others' own handling short); then :meth:`kill_overdue` (or :meth:`stop_all`) sends
        SIGKILL to the rest, as ``--grace`` says (a rank whose SIGTERM handler carries on, or
        hangs, must not keep the job for ever)."""
        if not self.interrupted:
            self.interrupted, self.signal = True, sig
            self.kill_at = time.monotonic() + self.grace
        self.signal_all(sig)

    def terminate(self, why: str) -> None:
        """End every process ferrorun decided not to wait for (``why`` says which and why):
        SIGTERM, then SIGCONT (a stopped process acts on its SIGTERM only once continued), and
        :meth:`kill_overdue` sends SIGKILL to those still running ``--grace`` seconds later."""
        sys.stderr.write(f"ferrorun: {why}; sending SIGTERM\n")
        if self.kill_at is None:
            self.signal, self.kill_at = signal.SIGTERM, time.monotonic() + self.grace
        self.signal_all(signal.SIGTERM)
        self.signal_all(signal.SIGCONT)

    def kill_overdue(self) -> bool:
        """After :meth:`interrupt`, once the grace period is over: SIGKILL to the processes
        still running (each process group whole); True when it sent it (once)."""
        if self.kill_at is None or time.monotonic() < self.kill_at:
            return False
        alive = [rank for p, rank in zip(self.procs, self.ranks) if p.poll() is None]
        if not alive:
            return False
        self.kill_at = float("inf")
        who = (f"{self.label} {alive[0]}" if len(alive) == 1
               else f"{self.label}s {', '.join(map(str, alive))}")
        sys.stderr.write(f"ferrorun: {who} still running {self.grace:g} s after "
                         f"{signal.Signals(self.signal).name}; sending SIGKILL\n")
        self.signal_all(signal.SIGKILL)
        return True

    def _await_all(self, end: float | None = None) -> None:
        end = time.monotonic() + self.grace if end is None else end
        while time.monotonic() < end and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)

    def stop_all(self) -> None:
        if self.interrupted:
            # they have had the signal: what is left of the grace period, then SIGKILL
            self._await_all(self.kill_at)
        else:
            self.signal_all(signal.SIGTERM)
            self.signal_all(signal.SIGCONT)  # (a stopped rank acts on it once continued)
            self._await_all()
        self.signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def wait(self) -> int:
        """Wait for every rank; on the first failure stop the rest. Returns the exit code
        (128 + N for a rank killed by signal N); :attr:`failure` names the failed rank (among
        ranks found ended at once, one killed by a signal)."""
        while True:
            if self.kill_overdue():
                for p in self.procs:
                    p.wait()
                return 128 + self.signal
            codes = [p.poll() for p in self.procs]
            # a rank killed by a signal first: when one is killed, its peers soon exit with an
            # error of their own (a peer gone), and one poll can find both ended
            failed = sorted(((i, c) for i, c in enumerate(codes) if c not in (None, 0)),
                            key=lambda f: f[1] > 0)
            if failed:
                i, code = failed[0]
                self.failure = (self.ranks[i], code)
                # (a signal sent to ferrorun and passed on: said so, not taken for the rank's)
                passed = (f" (ferrorun's own {signal.Signals(self.signal).name}, passed on)"
                          if self.interrupted and code == -self.signal else "")
                sys.stderr.write(f"ferrorun: {self.label} {self.ranks[i]} {_describe(code)}"
                                 f"{passed}; stopping the other {self.label}s\n")
                self.stop_all()
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                # ranks done: make sure no child they left behind outlives the job
                self.signal_all(signal.SIGKILL)
                return 0
            time.sleep(0.05)

    def finish_output(self, timeout: float = 5.0) -> None:
        """Let the pumps copy what the processes left in their pipes (``timeout`` seconds in
        all: a child that outlives its rank may hold a pipe open), then stop them; each writes
        its unfinished line."""
        end = time.monotonic() + timeout
        for t in self.pumps:
            t.join(max(0.0, end - time.monotonic()))
        self.stop_pumps.set()
        for t in self.pumps:
            t.join(1.0)
        for log in self.logs:
            log.close()


def supervise(make_job: Callable[[int], Job], max_restarts: int, received: list[int],
              set_current: Callable[[Job], None]) -> int:
    """Run ``make_job(attempt)`` until it succeeds, is interrupted (``received`` holds the
    signals ferrorun was sent) or has failed ``max_restarts`` + 1 times; returns the exit code.

    A signal that came while ``make_job`` started the processes (before ``set_current``
    registered them, so ferrorun's handler could not pass it on) is passed on as soon as they
    are registered: it must stop the job, not wait for it to end by itself."""
    restart = 0
    while True:
        job = make_job(restart)
        set_current(job)
        if received and not job.interrupted:
            job.interrupt(received[-1])
        try:
            code = job.wait()
        finally:
            if any(p.poll() is None for p in job.procs):
                job.stop_all()
            job.finish_output()
        if received:
            return code if code else 128 + received[0]
        if code == 0 or restart >= max_restarts:
            return code
        restart += 1
        failed, failed_code = job.failure
        sys.stderr.write(f"ferrorun: {job.label} {failed} {_describe(failed_code)}; "
                         f"restarting the job ({restart} of {max_restarts})\n")
