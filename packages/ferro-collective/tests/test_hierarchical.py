"""Hierarchical collectives: 4 TcpBackend processes on two "nodes" (each node maps its own engine
segment), node-major and interleaved rank layouts, and 6 on three (dealt out); results against
numpy, the same bits on every rank, and a mismatch that errors on every rank instead of
hanging."""

import time
from unittest import mock

import numpy as np
import pytest
from hier_fns import DISAGREEMENTS, REFUSED, SIZES, mismatch, reprobes, suite
from hypothesis import given, settings
from hypothesis import strategies as st

import ferro_collective
from ferro_backend import CollectiveMismatchError, SimulatedBackend
from ferro_backend.engine import AVAILABLE as SAME_HOST_ENGINE
from ferro_backend.hierarchy import node_members
from ferro_backend.netsim import Network
from ferro_backend.testing import run_processes, run_threads
from ferro_collective import allreduce, barrier, broadcast, executors

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not SAME_HOST_ENGINE, reason="the engine needs Linux")]

LAYOUTS = {"node-major": ("a", "a", "b", "b"), "interleaved": ("a", "b", "a", "b"),
           # cross-node groups of 3: their small calls ride the header exchange's rounds
           "three nodes": ("a", "b", "c", "a", "b", "c")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hierarchical_collectives(layout):
    nodes = LAYOUTS[layout]
    world = len(nodes)
    results = run_processes(suite, world, nodes)
    members = node_members(nodes)
    first = results[0]
    for r, res in enumerate(results):
        mine = next(m for m in members if r in m)
        assert res["node"] == list(mine)
        assert res["cross"] == [m[mine.index(r)] for m in members]
        assert "shared-memory engine (the collectives' node stages" in res["describe"]
        assert "KiB rings" in res["describe"]  # the node's point-to-point messages
        for key in first:
            if key not in ("node", "cross", "describe", "rs"):
                assert res[key] == first[key], (r, key)  # the same bits on every rank
    for size in SIZES:
        xs = [np.random.default_rng(100 + r).standard_normal(size) for r in range(world)]
        np.testing.assert_allclose(np.frombuffer(first[f"sum{size}"]), np.sum(xs, axis=0),
                                   rtol=1e-12, atol=1e-12)
        mean = np.frombuffer(first[f"mean{size}"], np.float32)
        np.testing.assert_allclose(mean, np.mean(np.float32(xs), axis=0), rtol=1e-5, atol=1e-6)
    assert first["out="] == [first[f"sum{SIZES[-1]}"]] * 3 + [True]
    assert first["int"] == (np.arange(10) * sum(range(1, world + 1))).tolist()
    assert first["max"] == [world - 1, 0]
    half = np.frombuffer(first["half"], np.float16)
    np.testing.assert_allclose(half, np.float32(0.1) * sum(range(1, world + 1)), rtol=2e-3)
    assert first["inplace"] == [[sum(range(world))] * 2] * 3
    assert first["bcast"] == [[10 * k, k] for k in range(world)]
    assert first["bcast_big"] == 200_000.0 * (world - 1)
    assert first["gather"] == np.repeat(np.arange(world), 2)[:, None].repeat(3, 1).tolist()
    assert first["gather0d"] == list(range(world))
    full = (world * np.arange(4 * world)).reshape(2 * world, 2)
    for r, res in enumerate(results):
        assert res["rs"] == full[2 * r:2 * r + 2].tolist()
    assert first["async"] == [list(range(world)), [sum(range(world))] * 3, [world] * 5]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_mismatch_errors_on_every_rank_at_once_and_the_next_call_agrees(layout):
    """Inside a node, between nodes, other collectives, sizes cut in other numbers of pieces,
    roots whose cross stages differ: every rank raises CollectiveMismatchError long before the
    call's deadline (12 s; under 6 s even on a loaded host), and the next allreduce gives the
    right sum on every rank."""
    world = len(LAYOUTS[layout])
    got = run_processes(mismatch, world, LAYOUTS[layout], timeout=150)
    for case in DISAGREEMENTS:
        for r, res in enumerate(got):
            error, took, after = res[case]
            want = REFUSED[case] if r == 0 and case in REFUSED else "CollectiveMismatchError"
            assert error == want, (case, r, res[case])
            assert took < 6.0, (case, r, res[case])
            assert after == [sum(range(1, world + 1))] * 3, (case, r, res[case])


def test_a_mismatch_on_a_simulated_hierarchy_errors_on_every_rank_and_the_next_call_agrees():
    """The same disagreements on threads over a simulated 2 x 2 cluster (no engine: the node
    groups number their calls themselves), but a refused call: on a simulated network the
    peers may run a call flat or staged by its size, which a refusing rank cannot know (it
    publishes nothing there; the peers meet their deadline)."""
    net = Network.cluster(gbit=10, latency_us=20, ranks_per_node=2)
    group = SimulatedBackend.create_group(4, network=net, hierarchical=True, timeout=30)
    cases = [c for c in DISAGREEMENTS if c not in REFUSED]
    got = run_threads(lambda b: mismatch(b, None, 12.0, cases), group, timeout=240)
    for case in cases:
        for r, res in enumerate(got):
            assert res[case][0] == "CollectiveMismatchError", (case, r, res[case])
            assert res[case][1] < 6.0 and res[case][2] == [10.0] * 3, (case, r, res[case])


def test_the_stages_exchange_no_header_of_their_own(monkeypatch):
    """A call exchanges one header on each group, the whole call's (in its first stage's
    place): an allreduce 2 a rank, all naming the user's call; the stages exchange none of
    their own (a barrier's last node stage is the barrier: it keeps its)."""
    from ferro_collective import pair
    from ferro_collective.header import describe

    seen: list = []
    real = pair.exchange

    def exchange(ctx, header, box, incoming):  # (groups of two ranks: every header goes here)
        seen.append(describe(header).split(" (seq")[0])  # (list.append: atomic)
        return real(ctx, header, box, incoming)

    monkeypatch.setattr(pair, "exchange", exchange)
    net = Network.cluster(gbit=10, latency_us=20, ranks_per_node=2)
    group = SimulatedBackend.create_group(4, network=net, hierarchical=True, timeout=30)
    got = run_threads(lambda b: allreduce(np.full(1000, b.rank + 1.0), b).tolist(), group)
    assert got == [[10.0] * 1000] * 4
    assert seen == ["allreduce(float64[1000], SUM)"] * 8
    seen.clear()
    run_threads(lambda b: barrier(b), group)
    assert seen == ["barrier"] * 12


#: calls a rank may make: (collective, dtype, size or root)
CALLS = st.one_of(
    st.tuples(st.sampled_from(["allreduce", "all_gather", "reduce_scatter"]),
              st.sampled_from(["float32", "float64"]), st.sampled_from([12, 24, 600, 612])),
    st.tuples(st.just("broadcast"), st.just("float64"), st.integers(0, 3)),
    st.tuples(st.just("barrier"), st.just(""), st.just(0)))


def _call(b, call, timeout):
    name, dtype, arg = call
    if name == "barrier":
        return barrier(b, timeout=timeout)
    if name == "broadcast":
        return broadcast(np.ones(5), b, root=arg, timeout=timeout)
    return getattr(ferro_collective, name)(np.ones(arg, dtype), b, timeout=timeout)


@settings(max_examples=60, deadline=None)
@given(calls=st.tuples(CALLS, CALLS, CALLS))
def test_any_disagreement_on_a_simulated_cluster_errors_everywhere_and_the_job_goes_on(calls):
    """Rank 0, node 0's other rank and node 1 each make a drawn call (always as stages, as
    real nodes do): where they all made the same one every rank gets its result; else every
    rank raises CollectiveMismatchError long before its deadline; either way the next allreduce
    gives the right sum on every rank."""
    _disagree_on_a_cluster(calls, 2, (0, 1, 2, 2))


@settings(max_examples=25, deadline=None)
@given(calls=st.tuples(CALLS, CALLS, CALLS))
def test_any_disagreement_on_three_nodes_errors_everywhere_and_the_job_goes_on(calls):
    """The same on 3 nodes x 2 ranks, whose cross-node groups have 3 ranks: their small
    calls carry the whole call's header in the header exchange's rounds
    (:mod:`ferro_collective.gathered`). Rank 0, the first ranks of nodes 1 and 2, and the
    second rank of every node each make a drawn call."""
    _disagree_on_a_cluster(calls, 3, (0, 2, 1, 2, 1, 2))


def _disagree_on_a_cluster(calls, nodes: int, which: tuple[int, ...]) -> None:
    net = Network.cluster(gbit=10, latency_us=20, ranks_per_node=2)
    group = SimulatedBackend.create_group(2 * nodes, network=net, hierarchical=True, timeout=30)
    total = float(sum(range(1, 2 * nodes + 1)))

    def run(b):
        start = time.monotonic()
        try:
            _call(b, calls[which[b.rank]], 12.0)
            got = "ok"
        except CollectiveMismatchError:
            got = "mismatch"
        took = time.monotonic() - start
        return got, took, allreduce(np.full(3, b.rank + 1.0), b, timeout=12.0).tolist()

    with mock.patch.object(executors, "prefer_hierarchical", lambda *args: True):
        got = run_threads(run, group, timeout=120)
    want = "ok" if len(set(calls)) == 1 else "mismatch"
    for r, (outcome, took, after) in enumerate(got):
        assert outcome == want and took < 6.0 and after == [total] * 3, (calls, r, got[r])


def test_a_mismatch_names_the_jobs_ranks():
    """The error names global ranks and what each called, inside a node and across nodes (a
    refusal from the node that disagreed)."""
    net = Network.cluster(gbit=10, latency_us=20, ranks_per_node=2)
    group = SimulatedBackend.create_group(4, network=net, hierarchical=True, timeout=30)

    def run(b):
        try:
            allreduce(np.ones(5 if b.rank == 3 else 4), b, timeout=5)
        except CollectiveMismatchError as exc:
            return str(exc)

    got = run_threads(run, group, timeout=60)
    for r in (2, 3):
        assert "ranks [2] called allreduce(float64[4], SUM)" in got[r], got[r]
        assert "ranks [3] called allreduce(float64[5], SUM)" in got[r], got[r]
    for r in (0, 1):
        assert f"rank {r + 2} refused the call" in got[r], got[r]
        assert "ranks [2, 3] of its node disagree" in got[r], got[r]


#: run by hand (ferro_backend.testing.Job: ``result`` comes back) and under ferrorun (the
#: printed line does)
JOB = """
import json
import numpy as np
from ferro_backend import init_from_env
from ferro_collective import allreduce, broadcast
b = init_from_env()
h = b.hierarchy
s = allreduce(np.full(100_000, b.rank + 1.0), b)
c = broadcast(np.array([b.rank]), b, root=3)
result = {"rank": b.rank, "type": type(b).__name__, "local": h and h.local_world,
          "nodes": h and h.num_nodes, "sum": float(s[0]), "bcast": int(c[0])}
print(json.dumps(result), flush=True)
b.close()
"""


def test_init_from_env_on_two_nodes_attaches_the_hierarchy():
    """ferrorun's variables by hand, 2 ranks on each of two "nodes" (FERRO_NODE_ID): TCP between
    the nodes, an engine segment inside each, the collectives hierarchical."""
    from ferro_backend.testing import run_job

    for d in run_job(JOB, 4, connect=False, nodes="aabb",
                     env={"FERRO_TIMEOUT": "30"}):
        assert d["type"] == "TcpBackend" and d["local"] == 2 and d["nodes"] == 2, d
        assert d["sum"] == 10.0 and d["bcast"] == 3, d


def test_ferrorun_on_two_nodes_runs_hierarchically(tmp_path):
    """Two ferrorun agents (--nnodes 2, 2 ranks each) on this host: no transport is forced, so
    init_from_env gives every rank the mesh plus its node's engine."""
    import json
    import subprocess
    import sys

    from ferro_backend.testing import free_port

    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = str(free_port())
    common = [sys.executable, "-m", "ferro_backend.launch", "--nnodes", "2", "--nproc", "2",
              "--master-port", port, "--token", "t0k3n", "--timeout", "30"]
    agents = [subprocess.Popen([*common, "--node-rank", str(k), str(script)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for k in range(2)]
    try:
        outs = [a.communicate(timeout=120) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait(5)
    for a, (_, err) in zip(agents, outs):
        assert a.returncode == 0, err[-3000:]
    res = [json.loads(line.split("] ", 1)[1]) for out, _ in outs for line in out.splitlines()
           if line.startswith("[rank ") and '"rank"' in line]
    assert sorted(d["rank"] for d in res) == [0, 1, 2, 3], outs
    for d in res:
        assert d["type"] == "TcpBackend" and d["local"] == 2 and d["nodes"] == 2, d
        assert d["sum"] == 10.0 and d["bcast"] == 3, d


def test_each_nodes_engine_re_probes_its_link_while_hierarchical_calls_run(monkeypatch):
    monkeypatch.setenv("FERRO_SHM_REPROBE", "0.2")
    got = run_processes(reprobes, 4, LAYOUTS["node-major"], 1.5)
    assert all(right for *_, right in got), got
    for node in ((0, 1), (2, 3)):  # the two ranks of a node's engine, alike
        (f0, l0, _), (f1, l1, _) = (got[r] for r in node)
        assert (f0, l0) == (f1, l1), got
        if f0 is not None:  # (a node engine probes where its ranks each have a core)
            assert l0 >= f0 + 2, got
