"""Run a snippet as the ranks of a real multi-process TcpBackend job on 127.0.0.1 (test helper)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass

from ferro_backend.testing import free_port

PRELUDE = """
import json, os, sys, time
import numpy as np
from ferro_backend import *
from ferro_backend.errors import *
result = None
"""


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str

    @property
    def result(self):
        for line in reversed(self.stdout.splitlines()):
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise AssertionError(f"rank {self.rank} printed no RESULT (rc {self.returncode}):\n"
                             f"{self.stdout}\n{self.stderr}")


class Job:
    """Start ``world`` ranks running ``body`` (with ``b`` bound to the backend unless
    ``connect=False``); always reaps them."""

    def __init__(self, body: str, world: int, *, port: int | None = None, token: str = "",
                 timeout: float = 20.0, connect: bool = True, ranks=None, env=None,
                 backend: str = "TcpBackend") -> None:
        self.port = port or free_port()
        self.world = world
        fd, self.path = tempfile.mkstemp(suffix=".py", prefix="ferro_tcp_job_")
        setup = (f"b = {backend}.from_env(timeout={timeout!r})\n" if connect else "")
        footer = "\nprint('RESULT ' + json.dumps(result), flush=True)\n" + (
            "b.close()\n" if connect else "")
        with os.fdopen(fd, "w") as f:
            f.write(PRELUDE + setup + textwrap.dedent(body) + footer)
        self.procs: dict[int, subprocess.Popen] = {}
        self.extra_env = env or {}
        self.token = token
        for r in (range(world) if ranks is None else ranks):
            self.start(r)

    def env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(self.world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port), PYTHONUNBUFFERED="1")
        env.pop("FERRO_TOKEN", None)
        if self.token:
            env["FERRO_TOKEN"] = self.token
        env.update(self.extra_env)
        return env

    def start(self, rank: int) -> None:
        self.procs[rank] = subprocess.Popen([sys.executable, self.path], env=self.env(rank),
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            text=True)

    def wait_for_line(self, rank: int, text: str, timeout: float = 20.0) -> None:
        proc = self.procs[rank]
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            line = proc.stdout.readline()
            if text in line:
                return
            if not line and proc.poll() is not None:
                break
        raise AssertionError(f"rank {rank} never printed {text!r}")

    def finish(self, timeout: float = 60.0) -> list[RankResult]:
        end = time.monotonic() + timeout
        results = []
        try:
            for r, p in sorted(self.procs.items()):
                try:
                    out, err = p.communicate(timeout=max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.kill()
                    out, err = p.communicate()
                    raise AssertionError(
                        f"rank {r} did not finish in {timeout}s:\n{out}\n{err}") from None
                results.append(RankResult(r, p.returncode, out, err))
        finally:
            self.kill()
            os.unlink(self.path)
        return results

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
        if os.path.exists(self.path):
            os.unlink(self.path)


def run_job(body: str, world: int, **kwargs) -> list:
    """Run the job to completion; every rank must exit 0. Returns each rank's RESULT."""
    results = Job(body, world, **kwargs).finish()
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} failed (rc {r.returncode}):\n{r.stderr}"
    return [r.result for r in results]
