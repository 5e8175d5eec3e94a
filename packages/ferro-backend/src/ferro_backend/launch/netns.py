"""Emulated nodes on one Linux host: a network namespace and a host name per node, joined through
a bridge that lives in a namespace of its own, each link optionally rate-limited and cuttable.

Layout of a cluster of N nodes::

    switch namespace   br0 ─┬─ p0 ─┬─ p1 ... p{N-1}       (no uplink: no route out of the cluster)
                            │      │
    node i namespace   eth0 10.213.0.{i+1}/24, lo up; host name node{i} (its own UTS namespace)

Every link is a veth pair created straight into the switch's namespace from inside the node's
(so no end ever appears in the host's namespace). ``link_rate`` puts a token bucket (``tc`` tbf)
at the root of both ends, so each direction of each link is shaped. :meth:`EmulatedCluster.cut`
takes the switch's end down (the node's ``eth0`` loses its carrier), :meth:`restore` brings it back.

The namespaces are anonymous: each is held by one small *holder* process that dies with the
process that made the cluster (``PR_SET_PDEATHSIG``, and the end of its standard input), and
everything started inside a node dies with its starter too (:meth:`EmulatedCluster.preexec`). So
even after a SIGKILL of the maker nothing stays behind: once the last process in a namespace is
gone the kernel destroys the namespace, its addresses and its veth ends. Traffic can only go to
the addresses this cluster configured, which exist nowhere else.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import LauncherError

CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
#: the most nodes one emulated cluster may have (one /24 of addresses)
MAX_NODES = 250
SUBNET = "10.213.0"
#: what --link-rate accepts: tc's rate units
RATE_PATTERN = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_COMMAND_TIMEOUT = 20.0

# The holder: dies with its maker, leaves for new namespaces, names its host, reports, then waits
# for the end of its stdin (run with -S: no site import, about 15 ms).
_HOLDER = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, signal.SIGKILL, 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
def fail(what):
    e = ctypes.get_errno()
    print("error", what, e, os.strerror(e), flush=True)
    os._exit(1)
if libc.unshare(int(sys.argv[2])) != 0:
    fail("unshare")
name = sys.argv[3].encode()
if name and libc.sethostname(name, len(name)) != 0:
    fail("sethostname")
print("ok", flush=True)
sys.stdin.buffer.read()
"""


class EmulationError(LauncherError):
    """An emulated cluster could not be made or driven (no root, no ``ip``/``tc``, a bad rate)."""


def rate_bits(rate: str) -> float:
    """``rate`` (tc's syntax: ``1gbit``, ``100mbit``, ``10mbps``) in bits per second."""
    m = RATE_PATTERN.match(rate.strip())
    if not m:
        raise EmulationError(f"link rate {rate!r}: expected a number and a tc unit such as "
                             "1gbit, 100mbit, 500kbit or 10mbps")
    bits = float(m.group(1)) * _SCALE[m.group(2).lower()] * (8 if m.group(3).lower() == "bps"
                                                             else 1)
    if not 8e3 <= bits <= 1e12:
        raise EmulationError(f"link rate {rate!r}: must lie between 8kbit and 1tbit")
    return bits


def check_support(link_rate: str | None = None) -> None:
    """Raise :class:`EmulationError` naming what this host lacks for an emulated cluster."""
    if not sys.platform.startswith("linux"):
        raise EmulationError(f"emulated nodes need Linux network namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise EmulationError("emulated nodes need root (network and UTS namespaces, veth links, "
                             f"qdiscs); this process runs as uid {os.geteuid()}")
    for tool, needed in (("ip", True), ("tc", link_rate is not None)):
        if needed and shutil.which(tool) is None:
            raise EmulationError(f"emulated nodes need iproute2's {tool!r} on PATH "
                                 "(Debian/Ubuntu: apt install iproute2)")
    if link_rate is not None:
        rate_bits(link_rate)


def unavailable(link_rate: str | None = None) -> str | None:
    """Why emulated nodes cannot run on this host (the checks of :func:`check_support`, then a
    one-node cluster made and unmade), or None when they can (tests skip with the reason)."""
    try:
        check_support(link_rate)
        with EmulatedCluster(1):
            pass
    except EmulationError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class EmulatedNode:
    """One node: its index, host name, address and the pid whose namespaces are the node's."""

    index: int
    host: str
    address: str
    pid: int


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _enter(fds: Sequence[int], die_with_parent: bool) -> Callable[[], None]:
    """A ``preexec_fn``: join the namespaces open as ``fds`` (opened by the parent: nothing is
    allocated after the fork) and, if asked, die when the parent does."""
    def pre() -> None:
        if die_with_parent:
            _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        for fd in fds:
            if _LIBC.setns(fd, 0) != 0:
                os._exit(126)
    return pre


class EmulatedCluster:
    """``nodes`` emulated nodes on this host (see the module docstring); a context manager.

    >>> with EmulatedCluster(2, link_rate="1gbit") as cluster:        # doctest: +SKIP
    ...     cluster.run(1, ["ping", "-c1", cluster.nodes[0].address])
    """

    def __init__(self, nodes: int, *, link_rate: str | None = None) -> None:
        if not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise EmulationError(f"emulated nodes: {nodes!r}; expected 1 to {MAX_NODES}")
        check_support(link_rate)
        self.link_rate = link_rate
        self.count = nodes
        self.nodes: list[EmulatedNode] = []
        self.switch_pid: int | None = None
        self._holders: list[subprocess.Popen] = []

    # ---- making and unmaking ----
    def _holder(self, flags: int, host: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-S", "-c", _HOLDER, str(os.getpid()), str(flags),
                              host], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             start_new_session=True)  # a Ctrl-C meant for the job must not end it
        self._holders.append(p)
        line = p.stdout.readline().decode().split()
        if line[:1] != ["ok"]:
            detail = " ".join(line[1:]) or f"the holder exited with {p.wait(5)}"
            raise EmulationError(f"cannot make a namespace for {host or 'the switch'}: {detail}"
                                 " (emulated nodes need root and namespaces the kernel allows)")
        return p

    def start(self) -> EmulatedCluster:
        try:
            self.switch_pid = self._holder(CLONE_NEWNET, "").pid
            self._ip(self.switch_pid, ["link add br0 type bridge", "link set br0 up",
                                       "link set lo up"])
            for i in range(self.count):
                node = EmulatedNode(i, f"node{i}", f"{SUBNET}.{i + 1}",
                                    self._holder(CLONE_NEWNET | CLONE_NEWUTS, f"node{i}").pid)
                self._ip(node.pid, [
                    "link set lo up",
                    f"link add eth0 type veth peer name p{i} netns {self.switch_pid}",
                    f"addr add {node.address}/24 dev eth0", "link set eth0 up"])
                self._ip(self.switch_pid, [f"link set p{i} master br0", f"link set p{i} up"])
                if self.link_rate is not None:
                    self._shape(node)
                self.nodes.append(node)
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> EmulatedCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End every holder (the namespaces go once nothing else runs in them)."""
        for p in self._holders:
            if p.poll() is None:
                p.stdin.close()
        for p in self._holders:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self._holders.clear()

    # ---- running inside ----
    def _pid(self, node: int | None) -> int:
        if self.switch_pid is None:
            raise EmulationError("the emulated cluster is not started (use start() or `with`)")
        return self.switch_pid if node is None else self.nodes[self._index(node)].pid

    def popen(self, node: int, cmd: Sequence[str], *, die_with_parent: bool = True,
              **kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside node ``node`` (its network and host name); it dies with this
        process unless ``die_with_parent`` is false."""
        fds = _open_ns(self._pid(node), ("net", "uts"))
        try:
            return subprocess.Popen(list(cmd), preexec_fn=_enter(fds, die_with_parent), **kwargs)
        finally:
            for fd in fds:
                os.close(fd)

    def run(self, node: int | None, cmd: Sequence[str], *, check: bool = True,
            timeout: float = _COMMAND_TIMEOUT, **kwargs) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside node ``node`` (None: the switch) and wait for it; with ``check``,
        a failure raises :class:`EmulationError` with its output."""
        return _run_in(self._pid(node), cmd, "the switch" if node is None else f"node {node}",
                       check, timeout, **kwargs)

    def _ip(self, pid: int, commands: Sequence[str]) -> None:
        """Run ``ip`` commands (one batch) inside the namespaces of ``pid``."""
        _run_in(pid, ["ip", "-batch", "-"], f"the namespace of pid {pid}", True,
                _COMMAND_TIMEOUT, input="\n".join(commands).encode() + b"\n")

    def _shape(self, node: EmulatedNode) -> None:
        bits = rate_bits(self.link_rate)
        # a millisecond of traffic per burst (at least a few full frames), a 20 ms queue
        burst = max(16384, int(bits / 8 / 1000))
        spec = ["root", "tbf", "rate", self.link_rate, "burst", str(burst), "latency", "20ms"]
        _run_in(node.pid, ["tc", "qdisc", "replace", "dev", "eth0", *spec], node.host, True,
                _COMMAND_TIMEOUT)
        _run_in(self.switch_pid, ["tc", "qdisc", "replace", "dev", f"p{node.index}", *spec],
                "the switch", True, _COMMAND_TIMEOUT)

    # ---- faults ----
    def cut(self, node: int) -> None:
        """Cut node ``node``'s link: nothing passes between it and any other node."""
        self._ip(self._pid(None), [f"link set p{self._index(node)} down"])

    def restore(self, node: int) -> None:
        """Bring node ``node``'s link back after :meth:`cut`."""
        self._ip(self._pid(None), [f"link set p{self._index(node)} up"])

    def _index(self, node: int) -> int:
        if not isinstance(node, int) or not 0 <= node < len(self.nodes):
            raise EmulationError(f"node {node!r}: this cluster has nodes 0 to "
                                 f"{len(self.nodes) - 1}")
        return node


def _open_ns(pid: int, kinds: Sequence[str]) -> list[int]:
    fds: list[int] = []
    try:
        for kind in kinds:
            fds.append(os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY))
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        raise EmulationError(f"the namespaces of pid {pid} are gone ({exc})") from exc
    return fds


def _run_in(pid: int, cmd: Sequence[str], where: str, check: bool, timeout: float,
            **kwargs) -> subprocess.CompletedProcess:
    fds = _open_ns(pid, ("net", "uts"))
    try:
        done = subprocess.run(list(cmd), preexec_fn=_enter(fds, True), capture_output=True,
                              timeout=timeout, **kwargs)
    finally:
        for fd in fds:
            os.close(fd)
    if check and done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip() if isinstance(
            done.stderr, bytes) else done.stderr
        raise EmulationError(f"{' '.join(cmd)!r} in {where} failed (exit {done.returncode}): "
                             f"{err}")
    return done
