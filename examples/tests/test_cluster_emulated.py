"""examples/cluster/emulated.sh: the training demo on 2 emulated nodes x 2 ranks (Linux, root),
against the same run on 4 ranks of one node."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ferro_backend.launch.netns import unavailable
from ferro_backend.testing.exclusive import one_emulation_at_a_time

ROOT = Path(__file__).resolve().parents[2]
# func_only: the wait for the emulation lock (another lane's emulated tests may hold it for
# minutes, and the lock bounds it itself) is not the test's time
pytestmark = pytest.mark.timeout(200, func_only=True)


@pytest.fixture
def one_emulation():
    """ferro-backend's tests count every namespace: one emulated cluster at a time."""
    with one_emulation_at_a_time():
        yield


REASON = unavailable("1gbit")
ARGS = ["--steps", "12", "--dataset", "synthetic", "--dtype", "float64", "--optimizer", "sgd"]


def summary(stdout: str) -> dict:
    line = next(x for x in stdout.splitlines() if "summary: " in x)
    return json.loads(line.split("summary: ", 1)[1])


@pytest.mark.skipif(REASON is not None, reason=f"no emulated nodes: {REASON}")
def test_demo_on_two_emulated_nodes_matches_one_node(tmp_path, one_emulation):
    demo_matches_one_node(tmp_path)


def demo_matches_one_node(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, CKPT=str(tmp_path / "emulated"))
    r = subprocess.run([str(ROOT / "examples/cluster/emulated.sh"), "--timeout", "60", "--",
                        *ARGS], capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "emulating 2 nodes" in r.stderr and "1gbit" in r.stderr
    emulated = summary(r.stdout)
    one = subprocess.run([sys.executable, "-m", "ferro_backend.launch", "--nproc", "4",
                          str(ROOT / "examples/train_mlp.py"), *ARGS, "--no-progress"],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert one.returncode == 0, one.stderr[-3000:]
    single = summary(one.stdout)
    assert emulated["world_size"] == single["world_size"] == 4
    assert emulated["steps"] == 12 and (tmp_path / "emulated").is_dir()
    # the same job: float64 sums in another order (node stages, then across nodes) agree closely
    assert emulated["final_loss"] == pytest.approx(single["final_loss"], rel=1e-9)


@pytest.mark.skipif(REASON is not None, reason=f"no emulated nodes: {REASON}")
def test_an_elastic_job_survives_a_cut_link(tmp_path, one_emulation):
    """`--emulate-nodes 2 --nnodes 1:2`: node 1's link is cut mid-training; node 0's ranks
    time out on it, the coordinator fences node 1 after --settle, and node 0 trains on.

    The test cuts the link itself (the command ferrorun prints) once both ranks have trained
    two steps together: a fixed --cut-link time counts from the agents' start, and on a loaded
    host came before the job formed. --settle 10 is also the first generation's last call: with
    1 s, node 1's rank (behind a second agent) came too late for it on a loaded host, and the
    job started on node 0's rank alone. (4000 steps: the job must outlast the cut, which comes
    a few steps in; 12000 ran for 110 s on one rank of a loaded host.)"""
    history, steps = tmp_path / "history.json", tmp_path / "steps"
    steps.mkdir()
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    settle = 10.0
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen([sys.executable, "-m", "ferro_backend.launch", "--emulate-nodes",
                              "2", "--nnodes", "1:2", "--nproc", "1", "--timeout", "1",
                              "--settle", str(settle), str(ROOT / "examples/train_elastic.py"),
                              "--steps", "4000", "--dtype", "float64", "--history",
                              str(history), "--step-file", str(steps)],
                             stdout=o, stderr=e, text=True, cwd=ROOT,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 120
        while True:
            done = [int(f.read_bytes() or b"0") for f in steps.iterdir()]
            if len(done) == 2 and min(done) >= 2:
                break
            assert p.poll() is None, f"{out.read_text()[-3000:]}\n{err.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the job did not form: steps {done}"
            time.sleep(0.05)
        line = next(x for x in err.read_text().splitlines()
                    if "cut a node's link with: " in x)
        cut = line.split("cut a node's link with: ", 1)[1].replace("p<node>", "p1")
        subprocess.run(cut, shell=True, check=True, timeout=30)
        p.wait(150)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
    stdout, stderr = out.read_text(), err.read_text()
    assert p.returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    changes = json.loads(history.read_text())["changes"]
    assert [(c["world_size"], c["reason"]) for c in changes] == [(1, "a member failed")], changes
    # detected by the deadline (1 s), excluded after the settle time: the coordinator waits
    # --settle from node 0's rank's report on (seconds counts from its error, before it)
    assert settle - 0.2 <= changes[0]["seconds"] < settle + 15, changes
    assert "done: 4000 steps on 1 ranks" in stdout
