"""``ferrorun``: start the ranks of a ferro job on this machine, in the spirit of torchrun.

    ferrorun --nproc 4 train.py --epochs 3
    ferrorun --nproc 2 -m mypackage.train
    ferrorun --nnodes 2 --node-rank 0 --nproc 8 --master-addr 10.0.0.1 --master-port 29500 \\
             --token $SECRET train.py

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
FERRO_TOKEN (fresh per single-node job) and FERRO_TRANSPORT, so ``ferro_backend.init_from_env()``
joins the job, and OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS = max(1, cores //
local ranks) unless they are set already. Every line a rank prints is prefixed with
``[rank N]``. When a rank fails, the others are stopped (SIGTERM, then SIGKILL after
``--grace`` seconds; each rank runs in its own process group, so its children go too) and
ferrorun exits with that rank's exit code. SIGINT and SIGTERM sent to ferrorun reach every rank.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from importlib.metadata import version as _version
from pathlib import Path

from .. import settings
from ..mesh.rendezvous import free_port
from .join import choose_transport

_DESCRIPTION = "Start the ranks of a ferro job on this machine, in the spirit of torchrun."
_EPILOG = """examples:
  ferrorun --nproc 4 train.py --epochs 3
  ferrorun --nproc 2 -m mypackage.train
  ferrorun --nproc 2 --max-restarts 3 train.py        # restart the job when a rank fails
  ferrorun --nnodes 2 --node-rank 0 --nproc 8 --master-addr 10.0.0.1 --master-port 29500 \\
           --token $SECRET train.py

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
FERRO_TOKEN, FERRO_TRANSPORT and FERRO_RESTART_COUNT, so ferro_backend.init_from_env() joins
the job; BLAS/OpenMP threads are capped per rank unless OMP_NUM_THREADS etc. are set. When a
rank fails the others are stopped and ferrorun exits with its code (or restarts the job)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferrorun", description=_DESCRIPTION, epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", "--nproc-per-node", type=int, default=1, dest="nproc",
                   help="ranks to start on this node (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   help="rank 0's host (default: MASTER_ADDR, else 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=_env_port(),
                   help="rank 0's port (default: MASTER_PORT, else a free port; required with "
                        "--nnodes > 1)")
    p.add_argument("--transport", choices=["tcp", "shm"], default=None,
                   help="transport for init_from_env (default: shm on one node when available; "
                        "on several nodes TCP between nodes and the engine inside each)")
    p.add_argument("--token", default=None, help="job secret (default: FERRO_TOKEN, or a fresh "
                   "one for a single-node job)")
    p.add_argument("--timeout", type=float, default=None,
                   help="default timeout of blocking calls in the ranks, seconds (FERRO_TIMEOUT)")
    p.add_argument("--version", action="version",
                   version=f"ferrorun (ferro-backend {_version('ferro-backend')})")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="on a rank's failure, stop every rank and start the whole job again, up "
                        "to this many times (each rank sees FERRO_RESTART_COUNT; default 0)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="also write each rank's output to LOG_DIR/rank_<N>.log")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None,
                   help="level of ferro's loggers in the ranks (FERRO_LOG_LEVEL)")
    p.add_argument("-m", dest="module", action="store_true",
                   help="run the target as a module (python -m)")
    p.add_argument("script", help="the script (or module with -m) every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="[ARG ...]",
                   help="the script's own arguments (optional)")
    return p


def _env_port() -> int | None:
    raw = os.environ.get("MASTER_PORT")
    return int(raw) if raw and raw.isdigit() else None


#: the BLAS/OpenMP thread-count variables ferrorun caps per rank unless the user set them
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def thread_caps(local_ranks: int, environ: dict[str, str] | None = None,
                cores: int | None = None) -> dict[str, str]:
    """The thread caps every rank gets: ``max(1, cores // local_ranks)`` for each variable of
    :data:`THREAD_VARS` the user has not set (without caps, every rank's BLAS starts one thread
    per core, and N ranks fight over the cores: torchrun caps them too)."""
    environ = os.environ if environ is None else environ
    if cores is None:
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
    per_rank = str(max(1, cores // max(1, local_ranks)))
    return {var: per_rank for var in THREAD_VARS if var not in environ}


def _default_transport(nnodes: int) -> str | None:
    """The engine on one Linux node, TCP on one node elsewhere (:func:`.join.choose_transport`);
    on several nodes None: init_from_env then builds the mesh and gives each node its engine
    (ferro_backend.hierarchy)."""
    return None if nnodes > 1 else choose_transport(None, True, "")


_OUTPUT_LOCK = threading.Lock()


def _pump(stream, out, prefix: str, log=None) -> None:
    """Copy a rank's output whole line by whole line, each prefixed; a carriage return
    (a redrawn progress bar) ends a line too, so the bar keeps its prefix. ``log``: a binary
    file that also gets the rank's output, unprefixed."""
    tag = prefix.encode()
    pending = b""
    while True:
        chunk = stream.read1(65536)
        if chunk:
            pending += chunk
            cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
            if not cut:
                continue
            ready, pending = pending[:cut], pending[cut:]
        else:
            ready, pending = pending, b""
        if ready and log is not None:
            log.write(ready)
            log.flush()
        if ready:
            if tag:
                ready = b"".join(tag + part for part in re.split(rb"(?<=[\r\n])", ready)
                                 if part)
            with _OUTPUT_LOCK:
                out.buffer.write(ready)
                out.buffer.flush()
        if not chunk:
            break
    stream.close()


def _describe(code: int) -> str:
    """How a rank ended: ``exited with code 3`` or ``was killed by SIGKILL``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Job:
    def __init__(self, cmd: list[str], envs: list[dict[str, str]], ranks: list[int],
                 grace: float, prefix: bool, log_dir: Path | None = None) -> None:
        self.grace = grace
        self.failure: tuple[int, int] | None = None  # (rank, return code) of the first failure
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.logs: list = []
        self.ranks = ranks
        for env, rank in zip(envs, ranks):
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True)
            self.procs.append(p)
            tag = f"[rank {rank}] " if prefix else ""
            log = None
            if log_dir is not None:
                log = open(log_dir / f"rank_{rank}.log", "ab")
                self.logs.append(log)
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, out, tag, log), daemon=True)
                t.start()
                self.pumps.append(t)

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, sig)  # the rank and everything it started
            except ProcessLookupError:
                pass

    def stop_all(self) -> None:
        self.signal_all(signal.SIGTERM)
        end = time.monotonic() + self.grace
        while time.monotonic() < end and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def wait(self) -> int:
        """Wait for every rank; on the first failure stop the rest. Returns the exit code
        (128 + N for a rank killed by signal N); :attr:`failure` names the failed rank."""
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                self.failure = (self.ranks[i], code)
                sys.stderr.write(f"ferrorun: rank {self.ranks[i]} {_describe(code)}; "
                                 f"stopping the other ranks\n")
                self.stop_all()
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                # ranks done: make sure no child they left behind outlives the job
                self.signal_all(signal.SIGKILL)
                return 0
            time.sleep(0.05)

    def finish_output(self) -> None:
        for t in self.pumps:
            t.join(5)
        for log in self.logs:
            log.close()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.nproc < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        _parser().error(f"--nproc {args.nproc}, --nnodes {args.nnodes}, --node-rank "
                        f"{args.node_rank}: need nproc >= 1 and 0 <= node-rank < nnodes")
    if args.nnodes > 1 and args.master_port is None:
        _parser().error("--master-port is required with --nnodes > 1")
    token = args.token or settings.TOKEN.get()
    if token is None:
        if args.nnodes > 1:
            _parser().error("multi-node jobs need a shared secret: --token or FERRO_TOKEN")
        token = secrets.token_hex(16)
    world = args.nproc * args.nnodes
    transport = args.transport or _default_transport(args.nnodes)
    target = ["-m", args.script] if args.module else [args.script]
    cmd = [sys.executable, "-u", "-m", "ferro_backend.launch._rank_main", str(os.getpid()), *target,
           *args.args]
    caps = thread_caps(args.nproc)
    if caps:
        sys.stderr.write(f"ferrorun: {', '.join(sorted(caps))} set to "
                         f"{next(iter(caps.values()))} per rank ({args.nproc} local ranks); set "
                         "them yourself to choose another value\n")
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    received: list[int] = []
    job: Job | None = None

    def forward(signum, frame):
        received.append(signum)
        if job is not None:
            job.signal_all(signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    restart = 0
    try:
        while True:
            # a fresh rendezvous (port) and, for a single-node job, a fresh token each time
            port = args.master_port or free_port(args.master_addr if args.master_addr !=
                                                 "localhost" else "127.0.0.1")
            if not (args.token or settings.TOKEN.get()):
                token = secrets.token_hex(16)
            envs, ranks = [], []
            for local in range(args.nproc):
                rank = args.node_rank * args.nproc + local
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                           LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(args.nproc),
                           GROUP_RANK=str(args.node_rank), MASTER_ADDR=args.master_addr,
                           MASTER_PORT=str(port), PYTHONUNBUFFERED="1", **caps)
                env[settings.TOKEN.name] = token
                env[settings.RESTART_COUNT.name] = str(restart)
                if transport is not None:
                    env[settings.TRANSPORT.name] = transport
                if args.timeout is not None:
                    env[settings.TIMEOUT.name] = str(args.timeout)
                if args.log_level is not None:
                    env[settings.LOG_LEVEL.name] = args.log_level
                envs.append(env)
                ranks.append(rank)
            job = Job(cmd, envs, ranks, args.grace, not args.no_prefix, args.log_dir)
            try:
                code = job.wait()
            finally:
                if any(p.poll() is None for p in job.procs):
                    job.stop_all()
                job.finish_output()
            if received:
                return code if code else 128 + received[0]
            if code == 0 or restart >= args.max_restarts:
                return code
            restart += 1
            failed_rank, failed_code = job.failure
            sys.stderr.write(f"ferrorun: rank {failed_rank} {_describe(failed_code)}; "
                             f"restarting the job ({restart} of {args.max_restarts})\n")
    finally:
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
