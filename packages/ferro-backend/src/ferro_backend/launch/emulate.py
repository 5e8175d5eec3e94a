"""``ferrorun --emulate-nodes N``: rehearse a multi-node job on this machine before queueing it.

    ferrorun --emulate-nodes 2 --nproc 2 --link-rate 1gbit train.py
    ferrorun --emulate-nodes 2 --nproc 1 --cut-link 1@5 train.py      # cut node 1's link at 5 s

ferrorun makes an :class:`~.netns.EmulatedCluster` (a network namespace, an address and a host
name per node, links through a bridge, each shaped to ``--link-rate`` and cuttable) and starts one
ferrorun *agent* per node inside that node, exactly as ``--nnodes N --node-rank i`` would on a
real cluster: the agent starts the node's ranks, which join the job through node 0's address, use
the same-host engine inside their node and the network (TCP) between nodes. Nothing crosses
between nodes except through the shaped links. When the job ends, or ferrorun is killed (even by
SIGKILL), the agents, their ranks and the namespaces go with it.
"""

from __future__ import annotations

import os
import secrets
import shlex
import sys
import threading
import time
from dataclasses import dataclass

from .. import settings
from .netns import EmulatedCluster, EmulationError
from .supervisor import Job

#: the port rank 0 listens on inside node 0 (a fresh namespace: nothing else is there); each
#: restart takes the next one, so no socket of the last attempt is in the way
BASE_PORT = 29500


@dataclass(frozen=True)
class Cut:
    """``--cut-link NODE@SECONDS``: cut node ``node``'s link ``after`` seconds into the job."""

    node: int
    after: float

    @classmethod
    def parse(cls, text: str) -> Cut:
        node, sep, after = text.partition("@")
        try:
            cut = cls(int(node), float(after)) if sep else None
        except ValueError:
            cut = None
        if cut is None or cut.node < 0 or not cut.after >= 0:
            raise EmulationError(f"--cut-link {text!r}: expected NODE@SECONDS, e.g. 1@5 (cut "
                                 "node 1's link 5 s after the ranks start)")
        return cut


def validate(args) -> list[Cut]:
    """Check the options of an emulated job (before anything is made); returns the cuts."""
    n = args.emulate_nodes
    elastic = getattr(args, "min_nodes", None) is not None
    if (args.nnodes != (n if elastic else 1)) or args.node_rank != 0:
        raise EmulationError(f"--emulate-nodes makes the nodes itself: leave out --nnodes (or "
                             f"give MIN:{n} for an elastic job) and --node-rank")
    if args.transport == "shm" and n > 1:
        raise EmulationError(f"--transport shm needs every rank on one host; --emulate-nodes {n}"
                             " makes separate hosts (use tcp, or leave the default: the engine "
                             "inside each node, TCP between them)")
    cuts = [Cut.parse(c) for c in args.cut_link or ()]
    for cut in cuts:
        if cut.node >= n:
            raise EmulationError(f"--cut-link {cut.node}@{cut.after:g}: the job has nodes 0 to "
                                 f"{n - 1}")
    return cuts


def agent_command(args, node: int, nodes: int, addr: str, port: int, restart: int = 0
                  ) -> list[str]:
    """The ferrorun command line of node ``node``'s agent (its token travels in the env) for
    attempt ``restart`` of the job: the agent runs that one attempt (ferrorun's restart loop is
    the outer one's), and passes the count on (its ranks' FERRO_RESTART_COUNT, its log files
    appended to rather than emptied, as in a plain ferrorun)."""
    elastic = getattr(args, "min_nodes", None)
    cmd = [sys.executable, "-u", "-m", "ferro_backend.launch", "--nproc", str(args.nproc),
           "--nnodes", f"{elastic}:{nodes}" if elastic else str(nodes), "--node-rank", str(node),
           "--master-addr", addr, "--master-port", str(port), "--grace", str(args.grace)]
    if elastic:
        cmd += ["--settle", str(args.settle), "--join-timeout", str(args.join_timeout),
                "--max-restarts", str(args.max_restarts)]
    for flag, value in (("--transport", args.transport), ("--timeout", args.timeout),
                        ("--log-level", args.log_level), ("--log-dir", args.log_dir)):
        if value is not None:
            cmd += [flag, str(value)]
    if args.no_prefix:
        cmd.append("--no-prefix")
    if restart:
        cmd += ["--restart-count", str(restart)]
    return cmd + (["-m"] if args.module else []) + [args.script, *args.args]


def describe(cluster: EmulatedCluster) -> str:
    nodes = ", ".join(f"{n.host} {n.address}" for n in cluster.nodes)
    rate = f"links shaped to {cluster.link_rate}" if cluster.link_rate else "links unshaped"
    cut = shlex.join(["nsenter", f"--net=/proc/{cluster.switch_pid}/ns/net", "ip", "link", "set",
                      "p<node>", "down"])
    return (f"ferrorun: emulating {len(cluster.nodes)} nodes on this host ({nodes}; {rate}); "
            f"cut a node's link with: {cut}\n")


def _schedule(cluster: EmulatedCluster, cuts: list[Cut], stop: threading.Event) -> None:
    start = time.monotonic()
    for cut in sorted(cuts, key=lambda c: c.after):
        if stop.wait(max(0.0, start + cut.after - time.monotonic())):
            return
        try:
            cluster.cut(cut.node)
            sys.stderr.write(f"ferrorun: cut node {cut.node}'s link at {cut.after:g} s\n")
        except EmulationError as exc:  # the job ended in between
            sys.stderr.write(f"ferrorun: could not cut node {cut.node}'s link: {exc}\n")


def run(args, caps: dict[str, str], supervise, received: list[int] | None = None,
        set_current=None) -> int:
    """Run the job of ``args`` on ``args.emulate_nodes`` emulated nodes. ``supervise(make_job)``
    is ferrorun's restart loop; ``make_job(attempt)`` returns the :class:`.Job` of the agents.
    An elastic job's agents run once, outside that loop: ``set_current`` registers them with
    ferrorun's signal handler, and a signal already in ``received`` is passed on to them."""
    cuts = validate(args)
    n = args.emulate_nodes
    token = args.token or settings.TOKEN.get() or secrets.token_hex(16)
    with EmulatedCluster(n, link_rate=args.link_rate) as cluster:
        sys.stderr.write(describe(cluster))
        stop = threading.Event()

        def make_job(attempt: int) -> Job:
            port = BASE_PORT + attempt
            addr = cluster.nodes[0].address
            cmds = [agent_command(args, i, n, addr, port, attempt) for i in range(n)]
            env = dict(os.environ, **caps, PYTHONUNBUFFERED="1")
            env[settings.TOKEN.name] = token
            env.pop("MASTER_ADDR", None)
            env.pop("MASTER_PORT", None)
            job = Job(cmds, [env] * n, list(range(n)), args.grace, False, None,
                      spawn=lambda i, cmd, e: cluster.popen(i, cmd, env=e, **Job.PIPES),
                      label="node")
            if cuts:
                threading.Thread(target=_schedule, args=(cluster, cuts, stop), daemon=True,
                                 name="ferrorun-cuts").start()
            return job

        try:
            if getattr(args, "min_nodes", None) is not None:
                job = make_job(0)
                if set_current is not None:
                    set_current(job)
                if received:
                    job.interrupt(received[-1])
                return _elastic(job)
            return supervise(make_job)
        finally:
            stop.set()


def _elastic(job: Job) -> int:
    """An elastic job's agents: node 0's (it holds the coordinator) decides the exit code; a
    node that fails or is cut off does not stop the others; when node 0's agent ends, any
    agent left (a cut-off node waiting for a coordinator it cannot reach) is stopped."""
    reported: set[int] = set()
    while job.procs[0].poll() is None:
        job.kill_overdue()
        for i, p in enumerate(job.procs[1:], 1):
            code = p.poll()
            if code not in (None, 0) and i not in reported:
                reported.add(i)
                sys.stderr.write(f"ferrorun: node {i}'s agent ended with {code}; the elastic "
                                 "job goes on without it\n")
        time.sleep(0.05)
    code = job.procs[0].returncode
    job.stop_all()
    job.finish_output()
    return code if code >= 0 else 128 - code
