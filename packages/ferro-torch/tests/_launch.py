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


def processes(scenario: str, n: int, rank_env, timeout: float = 60) -> Run:
    """``n`` processes started directly; ``rank_env(rank)`` is each one's extra environment
    (torchrun's variables, a token, or none of them)."""
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [subprocess.Popen([sys.executable, WORKERS, scenario], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env=_base_env({**rank_env(r), "TEST_RESULT_DIR": out_dir}))
                 for r in range(n)]
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
