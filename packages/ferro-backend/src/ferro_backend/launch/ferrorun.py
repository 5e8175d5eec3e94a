"""``ferrorun``: start the ranks of a ferro job on this machine, in the spirit of torchrun.

    ferrorun --nproc 4 train.py --epochs 3
    ferrorun --nproc 2 -m mypackage.train
    ferrorun --nnodes 2 --node-rank 0 --nproc 8 --master-addr 10.0.0.1 --master-port 29500 \\
             --token $SECRET train.py

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
FERRO_TOKEN (fresh per single-node job) and FERRO_TRANSPORT (``--transport``, else the user's
own, else the fastest), so ``ferro_backend.init_from_env()`` joins the job, and
OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS = max(1, cores // local ranks) unless
they are set already. Every line a rank prints is prefixed with
``[rank N]``, once (``[proc N]`` in an elastic job, whose ranks change: :mod:`.elastic_run`;
a progress bar redrawn with ``\\r`` animates on a terminal and is written once, as it last
read, to a file or pipe: :mod:`.output`). When a rank fails, the others are
stopped (SIGTERM, then SIGKILL after ``--grace`` seconds; each rank runs in its own process
group, so its children go too) and ferrorun exits with that rank's exit code. SIGINT and
SIGTERM sent to ferrorun reach every rank (even a signal that came while the ranks were
starting); the ranks still running ``--grace`` seconds later get SIGKILL.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import signal
import sys
from pathlib import Path

from .. import settings, timeline
from ..errors import SettingError
from ..joining.meet import choose_transport
from ..mesh.rendezvous import free_port
from . import emulate
from .elastic_run import ElasticRun, parse_range
from .netns import EmulationError
from .output import LogDirError, prepare_log_dir
from .supervisor import Job, supervise

_DESCRIPTION = "Start the ranks of a ferro job on this machine, in the spirit of torchrun."
_EPILOG = """examples:
  ferrorun --nproc 4 train.py --epochs 3
  ferrorun --nproc 2 -m mypackage.train
  ferrorun --nproc 2 --max-restarts 3 train.py        # restart the job when a rank fails
  ferrorun --nproc 2:4 --max-restarts 2 train.py      # elastic: goes on while 2 ranks live
  ferrorun --nnodes 2 --node-rank 0 --nproc 8 --master-addr 10.0.0.1 --master-port 29500 \\
           --token $SECRET train.py
  ferrorun --emulate-nodes 2 --nproc 2 --link-rate 1gbit train.py   # rehearse 2 nodes (root)

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
FERRO_TOKEN, FERRO_TRANSPORT and FERRO_RESTART_COUNT, so ferro_backend.init_from_env() joins
the job; BLAS/OpenMP threads are capped per rank unless OMP_NUM_THREADS etc. are set. When a
rank fails the others are stopped and ferrorun exits with its code (or restarts the job)."""



class _Version(argparse.Action):
    """``--version``: reads the installed metadata only when asked (importlib.metadata costs
    every launch about 60 ms)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import version

        print(f"ferrorun (ferro-backend {version('ferro-backend')})")
        parser.exit()

def _bounded(kind, low: float, high: float | None = None, what: str = "",
             above: bool = False):
    """An argparse type: ``kind(text)`` in ``[low, high]`` (``(low, high]`` with ``above``;
    NaN refused), else the usage error naming the range, before any rank starts."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not ((value > low if above else value >= low)  # (NaN fails every comparison)
                and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {what or ('> ' if above else '>= ') + str(low)}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferrorun", description=_DESCRIPTION, epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", "--nproc-per-node", default="1", dest="nproc",
                   help="ranks to start on this node (default 1); MIN:MAX makes the job "
                        "elastic: it goes on while MIN ranks live (ferro_backend.elastic)")
    p.add_argument("--nnodes", default="1", help="number of nodes (default 1); MIN:MAX: an "
                   "elastic job that goes on while MIN nodes live")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   help="rank 0's host (default: MASTER_ADDR, else 127.0.0.1)")
    p.add_argument("--master-port", type=_bounded(int, 0, 65535, "a port (0-65535)"),
                   default=_env_port(),
                   help="rank 0's port (default: MASTER_PORT, else a free port; required with "
                        "--nnodes > 1)")
    p.add_argument("--transport", choices=["tcp", "shm"], default=None,
                   help="transport for init_from_env (default: FERRO_TRANSPORT if set, else shm "
                        "on one node when available; on several nodes TCP between nodes and the "
                        "engine inside each)")
    p.add_argument("--token", default=None, help="job secret (default: FERRO_TOKEN, or a fresh "
                   "one for a single-node job)")
    p.add_argument("--timeout", type=_bounded(float, 0.0, above=True,
                                              what="a number of seconds > 0 (inf: no deadline)"),
                   default=None,
                   help="default timeout of blocking calls in the ranks, seconds > 0, inf for "
                        "none (FERRO_TIMEOUT)")
    p.add_argument("--version", action=_Version, nargs=0, help="show the version and exit")
    p.add_argument("--max-restarts", type=_bounded(int, 0), default=0,
                   help="on a rank's failure, stop every rank and start the whole job again, up "
                        "to this many times (each rank sees FERRO_RESTART_COUNT; default 0)")
    p.add_argument("--settle", type=_bounded(float, 0.0), default=10.0,
                   help="elastic jobs: seconds a silent (stopped, cut off) rank may delay a new "
                        "membership before it is excluded (default 10)")
    p.add_argument("--join-timeout", type=_bounded(float, 0.0), default=60.0,
                   help="elastic jobs: seconds a replacement ferrorun started is waited for "
                        "while the job is below its minimum (default 60; a member lost with no "
                        "replacement coming ends the job after --settle)")
    p.add_argument("--grace", type=_bounded(float, 0.0, float(sys.float_info.max),
                                            "a finite number of seconds >= 0"), default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="also write each rank's output, unprefixed, to LOG_DIR/rank_<N>.log "
                        "(stdout and stderr as they came), LOG_DIR/rank_<N>.stdout and "
                        "LOG_DIR/rank_<N>.stderr (made if missing, emptied by each run, "
                        "appended by restarts; progress bars as their last state; the files of "
                        "ranks an earlier, larger job had are deleted)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None,
                   help="level of ferro's loggers in the ranks (FERRO_LOG_LEVEL)")
    emu = p.add_argument_group("emulated nodes (Linux, root): rehearse a multi-node job here")
    emu.add_argument("--emulate-nodes", type=int, default=None, metavar="N",
                     help="run the job on N emulated nodes of this machine: each its own network "
                          "namespace, address and host name, --nproc ranks each, links through "
                          "a bridge; one ferrorun agent per node, as --nnodes does")
    emu.add_argument("--link-rate", default=None, metavar="RATE",
                     help="shape every node's link to RATE each way (tc units: 1gbit, 100mbit)")
    emu.add_argument("--cut-link", action="append", default=None, metavar="NODE@SECONDS",
                     help="cut node NODE's link SECONDS after the ranks start (repeatable)")
    p.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="write each rank's timeline to DIR/rank_<r>.json (FERRO_TRACE) and merge "
                        "them into DIR/trace.json for https://ui.perfetto.dev")
    # an emulated node's agent (emulate.agent_command) runs one attempt of the outer ferrorun's
    # restart loop: its ranks see that attempt's FERRO_RESTART_COUNT, and its --log-dir files
    # are appended to from the first restart on, as a plain ferrorun's are
    p.add_argument("--restart-count", type=_bounded(int, 0), default=0, help=argparse.SUPPRESS)
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


def _target_error(script: str, module: bool) -> str | None:
    """Why every rank would fail to start ``script`` (a path, or a module with ``-m``), as
    Python says it, or None; checked once here rather than as a traceback per rank. A module's
    top-level package only is looked up (in this environment, from the working directory as the
    ranks' ``python -m`` does), so nothing of the user's is imported here."""
    if module:
        top = script.partition(".")[0]
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        return None if found else f"No module named {top!r}"
    if os.path.isdir(script):
        if any(os.path.isfile(os.path.join(script, f"__main__.{ext}")) for ext in ("py", "pyc")):
            return None
        return f"can't find '__main__' module in {script!r}"
    try:
        with open(script, "rb"):
            return None
    except OSError as exc:
        return f"can't open file {script!r}: {exc.strerror}"


def _env_settings(args) -> str | None:
    """Check the ``FERRO_*`` settings ferrorun passes on to its ranks (a bad value: one line
    before any rank starts, not a traceback in each): ``FERRO_TRANSPORT`` and
    ``FERRO_LOG_LEVEL`` unless ``--transport``/``--log-level`` replace them, and the user's
    ``FERRO_TRANSPORT`` kept as ``args.transport``. Returns the error, or None."""
    try:
        if args.log_level is None:
            settings.LOG_LEVEL.get()
        if args.transport is None:
            args.transport = settings.TRANSPORT.get()
    except SettingError as exc:
        return str(exc)
    if args.transport == "mpi":
        return (f"{settings.TRANSPORT.name}=mpi: ferrorun's ranks are no MPI job (start them with "
                "mpirun or srun), unset it or give --transport tcp|shm")
    if args.transport == "shm" and args.nnodes > 1 and args.emulate_nodes is None:
        return f"transport shm needs every rank on one host; --nnodes {args.nnodes}: use tcp"
    return None


def _default_transport(nnodes: int) -> str | None:
    """The engine on one Linux node, TCP on one node elsewhere
    (:func:`ferro_backend.joining.meet.choose_transport`); on several nodes None: init_from_env
    then builds the mesh and gives each node its engine (ferro_backend.hierarchy)."""
    return None if nnodes > 1 else choose_transport(None, True, "")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; a ``--`` right after the script is the script's own argument (as
    ``python script.py -- ...`` passes it), though argparse drops the first ``--`` it meets."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    n = len(args.args)
    if (len(argv) >= n + 2 and argv[len(argv) - n - 1] == "--"
            and argv[len(argv) - n - 2] == args.script and "--" not in argv[:len(argv) - n - 1]):
        args.args = ["--", *args.args]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        nproc, nnodes = parse_range(args.nproc, "--nproc"), parse_range(args.nnodes, "--nnodes")
    except ValueError as exc:
        _parser().error(str(exc))
    elastic = ":" in args.nproc or ":" in args.nnodes   # MIN:MAX, even MIN == MAX
    args_nproc = args.nproc
    args.nproc, args.nnodes = nproc[1], nnodes[1]
    if elastic and args.emulate_nodes is not None and ":" in args_nproc:
        _parser().error("--emulate-nodes: an elastic job loses nodes (--nnodes MIN:N), not "
                        "ranks (give --nproc N)")
    args.min_nodes = nnodes[0] if elastic and args.emulate_nodes is not None else None
    if args.nproc < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        _parser().error(f"--nproc {args.nproc}, --nnodes {args.nnodes}, --node-rank "
                        f"{args.node_rank}: need nproc >= 1 and 0 <= node-rank < nnodes")
    if args.emulate_nodes is None and (args.link_rate or args.cut_link):
        _parser().error("--link-rate and --cut-link shape the links of --emulate-nodes")
    if args.nnodes > 1 and args.master_port is None and args.emulate_nodes is None:
        _parser().error("--master-port is required with --nnodes > 1")
    problem = _target_error(args.script, args.module) or _env_settings(args)
    if problem is not None:
        sys.stderr.write(f"ferrorun: {problem}\n")
        return 2
    token = args.token or settings.TOKEN.get()
    if token is None:
        if args.nnodes > 1 and args.emulate_nodes is None:
            _parser().error("multi-node jobs need a shared secret: --token or FERRO_TOKEN")
        token = secrets.token_hex(16)
    if args.log_dir is not None:
        try:
            # (an elastic job's processes are numbered apart; a restart appends)
            prepare_log_dir(args.log_dir, None if elastic or args.restart_count
                            else args.nproc * args.nnodes)
        except LogDirError as exc:
            sys.stderr.write(f"ferrorun: {exc}\n")
            return 2
    if args.trace is not None:   # made here: every rank writes its timeline there
        try:
            args.trace.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            sys.stderr.write(f"ferrorun: --trace: cannot create the directory "
                             f"{str(args.trace)!r}: {exc.strerror or exc}\n")
            return 2
        problem = _clear_trace(args.trace)
        if problem is not None:
            sys.stderr.write(f"ferrorun: --trace: {problem}\n")
            return 2
        if not os.access(args.trace, os.W_OK | os.X_OK):
            sys.stderr.write(f"ferrorun: --trace: cannot write to the directory "
                             f"{str(args.trace)!r}: Permission denied\n")
            return 2
    local = args.nproc * (args.emulate_nodes or 1)  # ranks sharing this machine's cores
    caps = thread_caps(local)
    if caps:
        sys.stderr.write(f"ferrorun: {', '.join(sorted(caps))} set to "
                         f"{next(iter(caps.values()))} per rank ({local} local ranks); set "
                         "them yourself to choose another value\n")
    if args.emulate_nodes is not None and settings.HOST_RANKS.name not in os.environ:
        # every emulated node's ranks run on this machine's cores: the engines count them all
        caps = dict(caps, **{settings.HOST_RANKS.name: str(local)})
    if args.trace is not None:
        caps = dict(caps, **{settings.TRACE.name: str(args.trace.resolve())})
    received: list[int] = []
    current: list[Job] = []

    def forward(signum, frame):
        received.append(signum)
        if current:
            current[-1].interrupt(signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}

    def run(make_job) -> int:
        if args.trace is None:
            return supervise(make_job, args.max_restarts, received, current.append)

        def fresh_job(restart):  # each attempt's timeline alone: the earlier one's files go
            if restart:
                _clear_trace(args.trace)
            return make_job(restart)

        return supervise(fresh_job, args.max_restarts, received, current.append)

    try:
        if args.emulate_nodes is not None:
            try:
                return emulate.run(args, caps, run, received, current.append)
            except EmulationError as exc:
                sys.stderr.write(f"ferrorun: {exc}\n")
                return 2
        if elastic and args.emulate_nodes is None:
            target = ["-m", args.script] if args.module else [args.script]
            cmd = [sys.executable, "-u", "-m", "ferro_backend.launch._rank_main",
                   str(os.getpid()), *target, *args.args]
            job = ElasticRun(args, token, caps, cmd, nproc, nnodes, args.settle)
            current.append(job)
            if received:  # a signal came while the ranks started: forward() could not pass it on
                job.interrupt(received[-1])
            return job.wait(received)
        return run(lambda restart: _local_job(args, token, caps, args.restart_count + restart))
    except LogDirError as exc:   # a rank's log file that cannot be written: no rank started
        sys.stderr.write(f"ferrorun: {exc}\n")
        return 2
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if args.trace is not None:
            _merge_trace(args.trace)


def _clear_trace(directory: Path) -> str | None:
    """Remove the ranks' files (``rank_<r>.json``) an earlier run or attempt left in the
    ``--trace`` directory, and only those. Returns the problem, or None."""
    try:
        stale = timeline.rank_files(directory)
    except OSError as exc:
        return f"cannot list the directory {str(directory)!r}: {exc.strerror or exc}"
    for path in stale:
        try:
            path.unlink()
        except OSError as exc:
            return f"cannot remove {str(path)!r}: {exc.strerror or exc}"
    return None


def _merge_trace(directory: Path) -> None:
    """The ranks' files merged into ``directory/trace.json``; a failure is one line on stderr
    (ferrorun's exit code stays the ranks')."""
    try:
        files = timeline.rank_files(directory)
        if files:
            out = timeline.merge(files, directory / "trace.json")
            sys.stderr.write(f"ferrorun: timeline of {len(files)} ranks: {out} (open it in "
                             "https://ui.perfetto.dev)\n")
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"ferrorun: --trace: could not merge the ranks' timelines: {exc}\n")


def _local_job(args, token: str, caps: dict[str, str], restart: int) -> Job:
    """This node's ranks, attempt ``restart``: a fresh rendezvous port and, for a single-node
    job without a given token, a fresh token each time."""
    world = args.nproc * args.nnodes
    transport = args.transport or _default_transport(args.nnodes)
    target = ["-m", args.script] if args.module else [args.script]
    cmd = [sys.executable, "-u", "-m", "ferro_backend.launch._rank_main", str(os.getpid()), *target,
           *args.args]
    port = args.master_port or free_port(args.master_addr if args.master_addr != "localhost"
                                         else "127.0.0.1")
    if restart and not (args.token or settings.TOKEN.get()):
        token = secrets.token_hex(16)
    envs, ranks = [], []
    for local in range(args.nproc):
        rank = args.node_rank * args.nproc + local
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(args.nproc), GROUP_RANK=str(args.node_rank),
                   MASTER_ADDR=args.master_addr, MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
                   **caps)
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
    return Job([cmd] * args.nproc, envs, ranks, args.grace, not args.no_prefix, args.log_dir,
               append=restart > 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
