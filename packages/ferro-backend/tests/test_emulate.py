"""Emulated nodes (ferrorun --emulate-nodes): options and errors everywhere; on Linux as root, the
cluster itself (namespaces, host names, shaped links, cuts), a job across emulated nodes, a cut
link surfacing as a typed error on every rank, and nothing left behind after a SIGKILL."""

import argparse
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferro_backend.launch import emulate, netns
from ferro_backend.launch.netns import EmulatedCluster, EmulationError

# func_only: the wait for the emulation lock (below; another lane's emulated tests may hold it
# for minutes, and the lock bounds it itself) is not the test's time
pytestmark = pytest.mark.timeout(90, func_only=True)


@pytest.fixture(autouse=True)
def _one_emulation_at_a_time():
    """Another test session's emulated nodes would count as this test's (see the module)."""
    from ferro_backend.testing.exclusive import one_emulation_at_a_time

    with one_emulation_at_a_time():
        yield
FERRORUN = [sys.executable, "-m", "ferro_backend.launch"]


REASON = netns.unavailable("1gbit")
needs_namespaces = pytest.mark.skipif(REASON is not None, reason=f"no emulated nodes: {REASON}")


def namespaces() -> set[str]:
    """Every network namespace some process is in."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            found.add(os.readlink(f"/proc/{pid}/ns/net"))
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_until(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


# ---- options and errors (any platform, any user) ----

@settings(deadline=None)  # a pure function: a loaded host's stall is no failure of it
@given(st.integers(1, 999), st.sampled_from(["", "k", "m", "g"]), st.sampled_from(["bit", "bps"]))
def test_rate_bits_reads_tc_units(number, prefix, unit):
    bits = number * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[prefix] * (8 if unit == "bps" else 1)
    text = f"{number}{prefix}{unit}"
    if 8e3 <= bits <= 1e12:
        assert netns.rate_bits(text) == pytest.approx(bits)
    else:
        with pytest.raises(EmulationError, match="between 8kbit and 1tbit"):
            netns.rate_bits(text)


@pytest.mark.parametrize("bad", ["fast", "1 gigabit", "1gb", "-5mbit", ""])
def test_bad_rate_names_the_rate(bad):
    with pytest.raises(EmulationError, match="link rate"):
        netns.rate_bits(bad)


def test_without_root_a_clear_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(EmulationError, match="need root.*uid 1000"):
        netns.check_support()


def test_without_ip_or_tc_a_clear_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/x")
    netns.check_support()  # no rate: tc is not needed
    with pytest.raises(EmulationError, match="'tc'"):
        netns.check_support("1gbit")


@pytest.mark.parametrize("count", [0, -1, netns.MAX_NODES + 1, 2.0])
def test_node_count_checked(count):
    with pytest.raises(EmulationError, match="emulated nodes"):
        EmulatedCluster(count)


def _args(**kw):
    base = dict(emulate_nodes=2, nnodes=1, node_rank=0, transport=None, cut_link=None,
                nproc=2, grace=5.0, timeout=None, log_level=None, log_dir=None, no_prefix=False,
                module=False, script="train.py", args=["--epochs", "1"], link_rate=None,
                token=None)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("kw, match", [
    (dict(nnodes=2), "leave out --nnodes"), (dict(transport="shm"), "shm needs every rank"),
    (dict(cut_link=["2@1"]), "nodes 0 to 1"), (dict(cut_link=["1"]), "NODE@SECONDS"),
    (dict(cut_link=["x@1"]), "NODE@SECONDS"), (dict(cut_link=["1@-2"]), "NODE@SECONDS")])
def test_bad_options_named(kw, match):
    with pytest.raises(EmulationError, match=match):
        emulate.validate(_args(**kw))


def test_an_elastic_job_gives_its_agents_the_node_range():
    args = _args(nnodes=2, min_nodes=1, settle=2.0, join_timeout=30.0, max_restarts=1)
    assert emulate.validate(args) == []
    line = " ".join(emulate.agent_command(args, 1, 2, "10.213.0.1", 29500))
    assert "--nnodes 1:2 --node-rank 1" in line
    assert "--settle 2.0 --join-timeout 30.0 --max-restarts 1" in line


def test_agent_command_is_a_node_of_a_multi_node_job():
    cmd = emulate.agent_command(_args(timeout=7.0), 1, 2, "10.213.0.1", 29500)
    line = " ".join(cmd)
    assert "--nproc 2 --nnodes 2 --node-rank 1 --master-addr 10.213.0.1 --master-port 29500" \
        in line
    assert "--timeout 7.0" in line and line.endswith("train.py --epochs 1")
    assert "--token" not in line  # the secret travels in the environment


def test_agent_command_carries_the_attempt():
    """Attempt 2 of an emulated job: the agent's ranks see FERRO_RESTART_COUNT=2 and its log
    files are appended to (before, every agent ran as attempt 0)."""
    assert "--restart-count" not in emulate.agent_command(_args(), 1, 2, "10.213.0.1", 29500)
    cmd = emulate.agent_command(_args(), 1, 2, "10.213.0.1", 29502, 2)
    assert " --restart-count 2 " in " ".join(cmd) and cmd[-3:] == ["train.py", "--epochs", "1"]


def test_ferrorun_rejects_link_options_without_emulation():
    r = subprocess.run([*FERRORUN, "--link-rate", "1gbit", "x.py"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "--emulate-nodes" in r.stderr


# ---- the cluster itself (Linux, root) ----

@needs_namespaces
def test_cluster_hosts_addresses_shaping_and_cuts():
    before = namespaces()
    with EmulatedCluster(2, link_rate="100mbit") as cluster:
        n0, n1 = cluster.nodes
        assert (n0.host, n1.host) == ("node0", "node1")
        assert cluster.run(1, ["hostname"]).stdout.decode().strip() == "node1"
        assert socket.gethostname() not in ("node0", "node1")
        qdisc = cluster.run(0, ["tc", "qdisc", "show", "dev", "eth0"]).stdout.decode()
        assert "tbf" in qdisc and "100Mbit" in qdisc
        assert len(namespaces() - before) == 3  # two nodes and the switch
        probe = ("import socket, sys\n"
                 "try:\n"
                 "    socket.create_connection((sys.argv[1], 9), timeout=1)\n"
                 "except ConnectionRefusedError:\n"
                 "    print('reached')\n"
                 "except OSError as e:\n"
                 "    print('unreachable', type(e).__name__)\n")
        reach = lambda: cluster.run(1, [sys.executable, "-c", probe, n0.address]).stdout
        assert reach().strip() == b"reached"  # node 0 answered (a refusal: nothing listens)
        cluster.cut(1)
        assert reach().startswith(b"unreachable")
        cluster.restore(1)
        assert wait_until(lambda: reach().strip() == b"reached", 5)
        # the host's own addresses do not exist inside a node
        assert b"127.0.0.1" in cluster.run(0, ["ip", "-br", "addr"]).stdout
        assert cluster.run(0, ["ip", "route"]).stdout.decode().split()[0] == "10.213.0.0/24"
        holders = [n0.pid, n1.pid, cluster.switch_pid]
    assert wait_until(lambda: not any(alive(p) for p in holders), 5)
    assert wait_until(lambda: namespaces() <= before, 5)


JOB = """
    import os, socket, sys, time
    import numpy as np
    import ferro_backend as fb
    if "--then-loop" in sys.argv:
        # each rank ends on its own typed error, not on the SIGTERM ferrorun sends once another
        # rank has failed (--grace bounds a rank that hangs)
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # a loaded host may start one node's rank seconds after the other's: --timeout is the
    # collectives' deadline, not the rendezvous'
    b = fb.init_from_env(connect_timeout=60)
    h = b.hierarchy
    print("joined", b.rank, socket.gethostname(), h and h.num_nodes, h and h.local_world,
          os.environ.get("FERRO_HOST_RANKS"), flush=True)
    n = b.world_size

    def ring_pass(x, tag):
        # every rank sends to the next and receives from the one before: crosses every node
        got = np.empty_like(x)
        req = b.irecv(got, (b.rank - 1) % n, tag=tag)
        b.send(x, (b.rank + 1) % n, tag=tag)
        req.wait(b.timeout)
        return got

    x = np.full(1 << 18, float(b.rank), np.float32)
    assert (ring_pass(x, 1) == (b.rank - 1) % n).all()
    print("summed", b.rank, flush=True)
    if "--then-loop" in sys.argv:
        try:
            for step in range(100000):
                ring_pass(x, 2)
                time.sleep(0.01)
        except fb.DistributedError as exc:
            print("raised", b.rank, type(exc).__name__, flush=True)
            sys.exit(3)
    b.close()
"""


def _script(tmp_path: Path) -> Path:
    p = tmp_path / "job.py"
    p.write_text(textwrap.dedent(JOB))
    return p


@needs_namespaces
def test_job_on_two_emulated_nodes(tmp_path):
    before = namespaces()
    r = subprocess.run([*FERRORUN, "--emulate-nodes", "2", "--nproc", "2", "--link-rate",
                        "1gbit", "--timeout", "30", str(_script(tmp_path))],
                       capture_output=True, text=True, timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    joined = sorted(line.split(" joined ")[1] for line in r.stdout.splitlines()
                    if " joined " in line)
    # every rank knows the 4 ranks of the job share this host (engines yield, nothing binds)
    assert joined == ["0 node0 2 2 4", "1 node0 2 2 4", "2 node1 2 2 4", "3 node1 2 2 4"]
    assert r.stdout.count(" summed ") == 4
    assert "emulating 2 nodes" in r.stderr and "1gbit" in r.stderr
    assert wait_until(lambda: namespaces() <= before, 5)


def _wait_for(pred, timeout: float, proc: subprocess.Popen, what: str) -> None:
    """Poll ``pred`` (<= ``timeout`` s) while ``proc`` runs; fail naming ``what`` otherwise."""
    end = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, f"ferrorun ended before {what}"
        assert time.monotonic() < end, f"no {what} within {timeout:g} s"
        time.sleep(0.05)


@needs_namespaces
def test_cut_link_raises_a_typed_error_on_every_rank(tmp_path):
    """Node 1's link is cut once both ranks are in their loop (the command ferrorun prints, run
    by the test: a fixed --cut-link time came before the job formed on a loaded host): each
    rank raises a ferro error by its deadline."""
    before = namespaces()
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen([*FERRORUN, "--emulate-nodes", "2", "--nproc", "1", "--timeout",
                              "2", "--grace", "20", str(_script(tmp_path)), "--then-loop"],
                             stdout=o, stderr=e, text=True,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        _wait_for(lambda: out.read_text().count(" summed ") == 2, 60, p, "both ranks summed")
        line = next(x for x in err.read_text().splitlines() if "cut a node's link with: " in x)
        cut = line.split("cut a node's link with: ", 1)[1].replace("p<node>", "p1")
        subprocess.run(cut, shell=True, check=True, timeout=30)
        t0 = time.monotonic()
        p.wait(60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
    stdout, stderr = out.read_text(), err.read_text()
    raised = sorted(line.split(" raised ")[1] for line in stdout.splitlines()
                    if " raised " in line)
    assert [x.split()[0] for x in raised] == ["0", "1"], stdout + stderr
    assert all(x.split()[1].endswith("Error") for x in raised), raised
    assert p.returncode == 3, stdout + stderr
    # the deadline (2 s), not a hang: a rank that hung would be killed only after --grace 20
    assert took < 2 + 15, took
    assert wait_until(lambda: namespaces() <= before, 5)


CUT_SEEN = """
import socket, subprocess, time
if socket.gethostname() == "node1":
    end = time.monotonic() + 30
    while b"NO-CARRIER" not in subprocess.run(["ip", "-o", "link", "show", "dev", "eth0"],
                                              capture_output=True).stdout:
        if time.monotonic() > end:
            raise SystemExit("node1: eth0 still has its carrier after 30 s")
        time.sleep(0.1)
    print("node1 lost its link", flush=True)
"""


@needs_namespaces
def test_cut_link_cuts_the_node_s_link_on_schedule(tmp_path):
    """--cut-link 1@2: ferrorun cuts node 1's link 2 s into the job and says so (node 1's rank
    waits, <= 30 s, until its eth0 has no carrier)."""
    script = tmp_path / "cut_seen.py"
    script.write_text(CUT_SEEN)
    before = namespaces()
    r = subprocess.run([*FERRORUN, "--emulate-nodes", "2", "--nproc", "1", "--cut-link", "1@2",
                        str(script)], capture_output=True, text=True, timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "node1 lost its link" in r.stdout, r.stdout + r.stderr
    assert "cut node 1's link at 2 s" in r.stderr, r.stderr
    assert wait_until(lambda: namespaces() <= before, 5)


@needs_namespaces
def test_sigkill_of_ferrorun_leaves_nothing(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import os, time\nprint('up', os.getpid(), flush=True)\ntime.sleep(60)\n")
    before = namespaces()
    p = subprocess.Popen([*FERRORUN, "--emulate-nodes", "2", "--nproc", "1", str(script)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        pids = []
        while len(pids) < 2:
            line = p.stdout.readline()
            assert line, "ferrorun ended early"
            if " up " in line:
                pids.append(int(line.split()[-1]))
        assert len(namespaces() - before) == 3
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        assert wait_until(lambda: not any(alive(q) for q in pids), 10), "orphan ranks"
        assert wait_until(lambda: namespaces() <= before, 10), "namespaces left"
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


@needs_namespaces
def test_a_killed_node_gives_the_survivors_a_typed_error(tmp_path):
    """Node 1's agent is SIGKILLed mid-job (its ranks die with it): the rank on node 0 raises a
    ferro error within the deadline, and nothing of node 1 is left."""
    script = _script(tmp_path)
    before = namespaces()
    with EmulatedCluster(2) as cluster:
        env = dict(os.environ, FERRO_TOKEN="emulated-kill-test", PYTHONUNBUFFERED="1")
        agents = [cluster.popen(i, [*FERRORUN, "--nnodes", "2", "--node-rank", str(i),
                                    "--nproc", "1", "--master-addr", cluster.nodes[0].address,
                                    "--master-port", "29500", "--timeout", "3", str(script),
                                    "--then-loop"], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
                  for i in range(2)]
        try:
            line = ""
            while " summed " not in line:
                line = agents[0].stdout.readline()
                assert line, "node 0 ended early"
            agents[1].kill()
            agents[1].wait(10)
            t0 = time.monotonic()
            out, _ = agents[0].communicate(timeout=30)
            took = time.monotonic() - t0
        finally:
            for a in agents:
                if a.poll() is None:
                    a.kill()
                a.wait()
                a.stdout.close()
        assert agents[0].returncode == 3, out
        raised = [x for x in out.splitlines() if " raised 0 " in x]
        assert raised and raised[0].split()[-1] in ("PeerClosedError", "CollectiveTimeoutError"), \
            out
        assert took < 3 + 5, took
    assert wait_until(lambda: namespaces() <= before, 10)


RESTARTS = """
import os, sys, time
r, c = int(os.environ["RANK"]), int(os.environ["FERRO_RESTART_COUNT"])
print(f"rank {r} attempt {c}", flush=True)
# every rank of this attempt has printed before rank 1 fails it (a file each in argv[1])
open(os.path.join(sys.argv[1], f"{c}.{r}"), "w").close()
end = time.monotonic() + 30
while not all(os.path.exists(os.path.join(sys.argv[1], f"{c}.{k}")) for k in (0, 1)):
    if time.monotonic() > end:
        sys.exit(f"rank {r} attempt {c}: the other rank did not start within 30 s")
    time.sleep(0.05)
if r == 1 and c < 2:
    sys.exit(9)     # fails on attempts 0 and 1
"""


@needs_namespaces
def test_emulated_restarts_count_attempts_and_append_the_logs(tmp_path):
    """--emulate-nodes with --max-restarts: each attempt's ranks see its FERRO_RESTART_COUNT
    (a script resumes from its checkpoint on > 0), and --log-dir keeps every attempt."""
    script = tmp_path / "restarts.py"
    script.write_text(RESTARTS)
    logs, up = tmp_path / "logs", tmp_path / "up"
    up.mkdir()
    before = namespaces()
    r = subprocess.run([*FERRORUN, "--emulate-nodes", "2", "--nproc", "1", "--grace", "1",
                        "--max-restarts", "3", "--log-dir", str(logs), str(script), str(up)],
                       capture_output=True, text=True, timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "restarting the job (2 of 3)" in r.stderr and "(3 of 3)" not in r.stderr
    for rank in (0, 1):
        assert (logs / f"rank_{rank}.log").read_text().split("\n")[:-1] == [
            f"rank {rank} attempt {c}" for c in range(3)]
    assert wait_until(lambda: namespaces() <= before, 5)
