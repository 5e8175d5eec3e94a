"""``ferrorun --nproc MIN:MAX`` / ``--nnodes MIN:MAX``: an elastic job.

Node 0's ferrorun runs the job's :class:`~.coordinator.Coordinator` (on ``--master-addr``:
``--master-port``, or loopback on one node); every rank gets ``FERRO_ELASTIC`` (where it is)
and joins with :func:`ferro_backend.elastic.join`. A rank that fails does not stop the others:
the survivors form the next generation among themselves (``ferro_collective.elastic``), and
ferrorun starts a replacement for it, up to ``--max-restarts`` times, which the survivors take
in at a step boundary. The job fails when fewer than MIN nodes x MIN ranks remain.

Exit code: 0 when every process ferrorun started exited 0 (as torchrun: a script need not
call ``ElasticJob.close()``, whose connection then closes as a lost member's would), or when
the job finished (a member said it was done) and no member still ran then failed; else the
last failure's code (1 when the coordinator ended the job). A process stopped (SIGSTOP: hung,
not dead) for ``--settle`` seconds once the job is over without it (a member said it was done,
or every other process of this ferrorun has ended) is not waited for: ferrorun names it and
ends it (SIGTERM and SIGCONT, SIGKILL ``--grace`` seconds later), a failure as any other, with
no replacement.

Output lines are prefixed ``[proc N]``: N numbers the processes this ferrorun started (node
``--node-rank`` x 1000 + a counter; a replacement gets the next number), not their rank, which
changes with every generation (each process's log files are ``rank_<N>.*`` with the same N).
"""

from __future__ import annotations

import os
import sys
import time

from .. import settings
from .coordinator import Coordinator, announce_replacement
from .supervisor import Job, _describe, stopped


def parse_range(raw: str, what: str) -> tuple[int, int]:
    """``"4"`` -> (4, 4), ``"2:4"`` -> (2, 4); ValueError naming ``what`` otherwise."""
    lo, sep, hi = raw.partition(":")
    try:
        low, high = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError(f"{what} {raw!r}: expected N or MIN:MAX") from None
    if not 1 <= low <= high:
        raise ValueError(f"{what} {raw!r}: need 1 <= MIN <= MAX")
    return low, high


def elastic_timeout(settle: float, join_timeout: float, timeout: float | None) -> float:
    """A rank's wait for the next generation (``FERRO_ELASTIC_TIMEOUT``): the settle time,
    the join deadline for announced replacements, a peer's deadline (``--timeout``) and 10 s
    of margin."""
    return round(settle + join_timeout + (timeout or 0.0) + 10.0, 3)


class ElasticRun:
    """Run this node's ranks of an elastic job until it ends; :meth:`wait` returns the code."""

    def __init__(self, args, token: str, caps: dict[str, str], cmd: list[str],
                 nproc: tuple[int, int], nnodes: tuple[int, int], settle: float) -> None:
        self.args, self.cmd, self.grace, self.settle = args, cmd, args.grace, settle
        #: processes seen stopped (SIGSTOP), index -> since when; those ferrorun ended itself
        self.stopped_since: dict[int, float] = {}
        self.ended: set[int] = set()
        self.jobs: list[Job] = []
        #: processes whose end _watch has handled (a replacement announced and started, or not)
        self.handled: set[int] = set()
        self.coordinator: Coordinator | None = None
        if args.node_rank == 0:
            host = "127.0.0.1" if nnodes[1] == 1 else ("::" if ":" in args.master_addr
                                                       else "0.0.0.0")
            self.coordinator = Coordinator(token, nnodes[0] * nproc[0], nnodes[1] * nproc[1],
                                           nnodes[1] * nproc[1], host=host,
                                           port=args.master_port or 0, settle=settle,
                                           last_call=settle,
                                           join_deadline=args.join_timeout,
                                           unseen_deaths=self._unseen_death)
            port = self.coordinator.address.rpartition(":")[2]
            where = f"127.0.0.1:{port}" if nnodes[1] == 1 else f"{args.master_addr}:{port}"
        else:
            where = f"{args.master_addr}:{args.master_port}"
        base = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_ADDR=args.master_addr,
                    LOCAL_WORLD_SIZE=str(nproc[1]), WORLD_SIZE=str(nnodes[1] * nproc[1]),
                    GROUP_RANK=str(args.node_rank), **caps)
        base[settings.ELASTIC.name] = where
        base[settings.TOKEN.name] = token
        for name, value in ((settings.TRANSPORT.name, args.transport),
                            (settings.TIMEOUT.name, args.timeout),
                            (settings.LOG_LEVEL.name, args.log_level)):
            if value is not None:
                base[name] = str(value)
        # how long a rank waits for the next generation: as long as the coordinator may take
        # to form one (the settle time, then announced replacements up to the join deadline)
        # and a margin, not the default 120 s: a rank whose coordinator host is stopped ends
        # with the error that says so that much sooner (unless the environment sets it)
        base.setdefault(settings.ELASTIC_TIMEOUT.name,
                        str(elastic_timeout(settle, args.join_timeout, args.timeout)))
        for var in ("RANK", "MASTER_PORT"):   # ranks come from the coordinator, not from here
            base.pop(var, None)
        self.base = base
        self.replacements_left = args.max_restarts
        self.local_of: list[int] = []   # each process's LOCAL_RANK (a replacement takes it over)
        self.started = 0
        self.signal: int | None = None  # the SIGINT/SIGTERM ferrorun passed on (the first)
        for local in range(nproc[1]):
            self._start(local)

    def _start(self, local: int) -> None:
        env = dict(self.base, LOCAL_RANK=str(local))
        label = self.args.node_rank * 1000 + self.started  # a fresh number per process
        self.started += 1
        self.local_of.append(local)
        job = Job([self.cmd], [env], [label], self.grace, not self.args.no_prefix,
                  self.args.log_dir, label="proc")
        self.jobs.append(job)
        if self.signal is not None:  # a signal came while it started: it stops too
            job.interrupt(self.signal)

    def interrupt(self, sig: int) -> None:
        """Pass ``sig`` (sent to ferrorun) on to every process (:meth:`.Job.interrupt`: those
        still running ``--grace`` seconds later get SIGKILL, from :meth:`_watch`)."""
        if self.signal is None:
            self.signal = sig
        for job in self.jobs:
            job.interrupt(sig)

    def wait(self, received: list[int]) -> int:
        """Watch the ranks until the job ends (``received``: signals ferrorun was sent); the
        exit code (module docstring)."""
        try:
            return self._watch(received)
        finally:
            if self.coordinator is not None:
                self.coordinator.close()

    def _watch(self, received: list[int]) -> int:
        last_failure = 0
        done: set[int] = set()
        ok = 0
        late = 0  # the code of a member that failed after the job was done (not one ended here)
        while True:
            state = self.coordinator.snapshot() if self.coordinator else None
            if state and state["failed"] and not self._ending_cleanly(done):
                sys.stderr.write(f"ferrorun: the elastic job cannot go on: {state['failed']}\n")
                self._stop()
                return last_failure or 1
            running = 0
            for i, job in enumerate(self.jobs):
                job.kill_overdue()
                code = job.procs[0].poll()
                if code is None:
                    running += 1
                    continue
                if i in done:
                    continue
                done.add(i)
                if code == 0:
                    ok += 1
                    self.handled.add(i)
                    continue
                last_failure = code if code > 0 else 128 - code
                finished = state is not None and state["finished"]
                if finished and i not in self.ended:
                    late = last_failure
                more = (self.replacements_left > 0 and not received and not finished
                        and i not in self.ended)
                goes_on = ("" if received else
                           " (stopped; ferrorun ended it)" if i in self.ended else
                           " after a member said the elastic job was done" if finished else
                           f"; the elastic job goes on without it"
                           f"{' and starts a replacement' if more else ''}")
                sys.stderr.write(f"ferrorun: proc {job.ranks[0]} {_describe(code)}"
                                 f"{goes_on}\n")
                if more:
                    self.replacements_left -= 1
                    self._expect_replacement()
                    self._start(self.local_of[i])
                self.handled.add(i)   # (after expect(): see _unseen_death)
            if running and not received:
                self._end_stopped(done, state)
            if not running and len(done) == len(self.jobs):
                for job in self.jobs:
                    job.finish_output()
                if received:
                    return 128 + received[0]
                if self.coordinator is not None:
                    self._report()
                clean = ok == len(self.jobs)   # every process exited 0
                if late:
                    sys.stderr.write(f"ferrorun: a member failed (exit code {late}) after the "
                                     "elastic job was done\n")
                    return late
                if ok and (state is None or state["finished"] or clean):
                    return 0
                failed = self.coordinator.snapshot()["failed"] if self.coordinator else None
                if failed:   # (since this turn's snapshot: the members it failed have ended)
                    sys.stderr.write(f"ferrorun: the elastic job cannot go on: {failed}\n")
                    return last_failure or 1
                sys.stderr.write(f"ferrorun: a process failed (exit code {last_failure}) and no "
                                 "member said the elastic job was done (ElasticJob.close())\n")
                return last_failure or 1
            time.sleep(0.05)

    def _unseen_death(self) -> bool:
        """(The coordinator's thread, before it ends the job for too few members.) Whether a
        process of this ferrorun has ended that :meth:`_watch` has not handled yet: it may be
        about to announce a replacement (:meth:`_expect_replacement`, before it marks the
        process handled), so the coordinator waits for its look: on a loaded host the
        survivors' reports and ``--settle`` could otherwise pass before ferrorun (polling every
        50 ms) saw the death, and the job end with a replacement on its way."""
        for i, job in enumerate(list(self.jobs)):
            if i not in self.handled and _has_ended(job.procs[0]):
                return True
        return False

    def _end_stopped(self, done: set[int], state: dict | None) -> None:
        """End the processes that are stopped (SIGSTOP: hung, not dead, so ferrorun would wait
        for them for ever) once the job is over without them: a member said it was done, or
        every other process this ferrorun started has ended. One stopped for less than
        ``--settle`` seconds (the time the coordinator gives a silent member) is left alone:
        it may be continued."""
        now = time.monotonic()
        live = [i for i, job in enumerate(self.jobs) if i not in done]
        for i in live:
            if i in self.ended or not stopped(self.jobs[i].procs[0].pid):
                self.stopped_since.pop(i, None)
            else:
                self.stopped_since.setdefault(i, now)
        hung = [i for i, since in self.stopped_since.items() if now - since >= self.settle]
        if not hung:
            return
        finished = state is not None and state["finished"]
        if not finished and (not done or any(i not in self.stopped_since for i in live)):
            return   # other processes still run (or none has ended yet): they may need it
        why = ("a member said the elastic job was done" if finished else
               "every other process of this ferrorun has ended")
        for i in hung:
            self.ended.add(i)
            del self.stopped_since[i]
            self.jobs[i].terminate(f"proc {self.jobs[i].ranks[0]} (pid "
                                   f"{self.jobs[i].procs[0].pid}) has been stopped (SIGSTOP) "
                                   f"for {self.settle:g} s and {why}: not waiting for it")

    def _ending_cleanly(self, done: set[int]) -> bool:
        """Whether the processes not yet seen to end (all but ``done``) are all ending with 0
        (waiting up to 2 s for them, less when one fails): ranks that exit 0 without
        ``ElasticJob.close()`` close their coordinator connections a moment before ferrorun
        sees them end, and the coordinator has then taken them for lost members ("every
        member ... is gone"). That job ended well, and is not stopped as a failed one."""
        rest = [job.procs[0] for i, job in enumerate(self.jobs)
                if i not in done and i not in self.ended]   # (those ended: _end_stopped)
        end = time.monotonic() + 2.0
        while time.monotonic() < end and any(p.poll() is None for p in rest):
            if any(p.poll() not in (None, 0) for p in rest):
                return False
            time.sleep(0.05)
        return all(p.poll() == 0 for p in rest)

    def _expect_replacement(self) -> None:
        """Tell the coordinator a replacement is coming, so that the job waits for it (up to
        ``--join-timeout``) rather than ``--settle`` alone."""
        if self.coordinator is not None:
            self.coordinator.expect()
            return
        try:
            announce_replacement(self.base[settings.ELASTIC.name], self.base[settings.TOKEN.name])
        except (OSError, ValueError) as exc:  # the job goes on; only the wait is shorter
            sys.stderr.write(f"ferrorun: could not tell the coordinator a replacement is "
                             f"coming ({exc}); it waits --settle seconds for it\n")

    def _stop(self) -> None:
        for job in self.jobs:
            if job.procs[0].poll() is None:
                job.stop_all()
        for job in self.jobs:
            job.finish_output()

    def _report(self) -> None:
        history = self.coordinator.snapshot()["history"]
        for g in history[1:]:
            sys.stderr.write(f"ferrorun: generation {g['generation']}: {g['world_size']} ranks "
                             f"from step {g['step']} ({g['reason']})\n")


def _has_ended(proc) -> bool:
    """Whether ``proc`` (a child) has ended, from any thread, without reaping it: its
    ``poll()`` from another thread answers None while :meth:`ElasticRun._watch` polls it."""
    if proc.returncode is not None:
        return True
    if not hasattr(os, "waitid"):  # (macOS before Python 3.13)
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True   # reaped meanwhile (by _watch's poll)


__all__ = ["ElasticRun", "parse_range"]
