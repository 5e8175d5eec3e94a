"""Start a test's ranks as real processes (ferrorun, torchrun, or plain environment variables)
and collect the JSON each rank wrote (tests/workers.py's ``report``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ferro_backend.testing import free_port
from ferro_backend.testing.processes import fork_server

WORKERS = str(Path(__file__).with_name("workers.py"))
BIN = Path(sys.executable).parent
#: one BLAS/OpenMP thread per rank: the machine has few cores and several ranks
THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass
class Run:
    returncodes: list[int]
    results: list[dict]
    output: str

    def by_rank(self) -> dict[int, dict]:
        return {r["rank"]: r for r in self.results}


def _base_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                        "FERRO_TOKEN", "FERRO_TRANSPORT")}
    env.update(THREADS, PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def _collect(out_dir: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]


def run_launcher(cmd: list[str], timeout: float, env: dict | None = None) -> Run:
    """One launcher process (ferrorun / torchrun) that starts every rank, in a session of its
    own: past ``timeout`` the whole session is killed, ranks included (killing the launcher
    alone left its ranks running), then TimeoutExpired is raised."""
    with tempfile.TemporaryDirectory() as out_dir:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True,
                                env=_base_env({**(env or {}), "TEST_RESULT_DIR": out_dir}))
        try:
            out = proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        return Run([proc.returncode], _collect(out_dir), out)


def ferrorun(scenario: str, n: int, timeout: float = 100, args: tuple = (),
             script: str = WORKERS, env: dict | None = None) -> Run:
    return run_launcher([str(BIN / "ferrorun"), "--nproc", str(n), *args, script, scenario],
                        timeout, env)


def torchrun(scenario: str, n: int, timeout: float = 100, env: dict | None = None) -> Run:
    return run_launcher([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                         str(n), "--master-addr", "127.0.0.1", "--master-port",
                         str(free_port()), WORKERS, scenario], timeout,
                        {"FERRO_TOKEN": "torchrun-test-secret", **(env or {})})


#: what the fork server of processes() imports beside ferro_backend.testing's own (a rank
#: started afresh spends about 2 s of CPU importing torch, most of what a short test's rank
#: does on a 2-core machine)
PRELOAD = ["torch", "torch.distributed", "ferro_torch"]


def _forked_rank(env: dict, argv: list[str], log: str) -> None:
    """In a child of the fork server: ``python workers.py SCENARIO`` as a fresh process would
    run it (this environment, these arguments, its output into ``log``)."""
    import runpy

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        import atexit

        atexit._run_exitfuncs()  # as a process's exit runs them (multiprocessing's children do not)


def processes(scenario: str, n: int, rank_env, timeout: float = 60) -> Run:
    """``n`` processes started directly; ``rank_env(rank)`` is each one's extra environment
    (torchrun's variables, a token, or none of them). Each forks from a fork server that has
    imported torch and ferro (:data:`PRELOAD`), else is a new ``python workers.py``."""
    import time

    ctx = fork_server(PRELOAD, THREADS)  # one BLAS/OpenMP thread as torch loads there
    with tempfile.TemporaryDirectory() as out_dir:
        envs = [_base_env({**rank_env(r), "TEST_RESULT_DIR": out_dir}) for r in range(n)]
        if ctx is None:
            return _spawned(scenario, envs, out_dir, timeout)
        logs = [os.path.join(out_dir, f"output{r}.log") for r in range(n)]
        procs = [ctx.Process(target=_forked_rank, args=(env, [WORKERS, scenario], log))
                 for env, log in zip(envs, logs)]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.exitcode is None:
                    raise subprocess.TimeoutExpired(f"workers.py {scenario}", timeout)
        finally:
            for p in procs:
                if p.pid is not None and p.exitcode is None:
                    p.kill()
                    p.join(5)
        outs = [Path(log).read_text(errors="replace") if os.path.exists(log) else ""
                for log in logs]
        return Run([p.exitcode for p in procs], _collect(out_dir), "".join(outs))


def _spawned(scenario: str, envs: list[dict], out_dir: str, timeout: float) -> Run:
    procs = [subprocess.Popen([sys.executable, WORKERS, scenario], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for env in envs]
    outs, codes = [], []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
            codes.append(p.returncode)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return Run(codes, _collect(out_dir), "".join(outs))


def env_vars(rank: int, n: int, port: int, **extra) -> dict:
    """torchrun's variables (env://) for one rank."""
    return {"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **extra}
