"""Failures reach torch as errors carrying ferro's message: a dead peer, a process without the
job's token; and init_method="tcp://" joins without any MASTER_* variable."""

import pytest
from _launch import env_vars, processes

from ferro_backend.testing import free_port


@pytest.mark.timeout(60)
def test_a_dead_peer_raises_a_torch_dist_error_on_the_others():
    port = free_port()
    run = processes("dead_peer", 2, lambda r: env_vars(r, 2, port, FERRO_TOKEN="t0k"))
    assert run.returncodes == [0, 17], run.output[-4000:]
    (r0,) = run.results
    # torch's DistBackendError (the Python backend's FerroTorchError is one)
    assert r0["rank"] == 0 and r0["is_backend_error"], r0
    assert r0["is_ferro"] or r0["kind"] == "compiled", r0
    assert "rank 1" in r0["message"], r0  # ferro's message names the peer
    assert r0["seconds"] < 15  # noticed at once, not after torch's timeout


@pytest.mark.timeout(60)
def test_a_process_without_the_token_cannot_join():
    port = free_port()
    run = processes("token", 2, lambda r: env_vars(r, 2, port, TEST_TIMEOUT="6",
                                                   **({"FERRO_TOKEN": "job-secret"}
                                                      if r == 0 else {})))
    assert run.returncodes == [0, 0], run.output[-4000:]
    ranks = {r["rank"]: r for r in run.results}
    assert ranks[1]["is_ferro"] and "AuthenticationError" in ranks[1]["message"], ranks[1]
    assert ranks[0]["error"] is not None  # rank 0 never saw its peer join


@pytest.mark.timeout(60)
def test_tcp_init_method_over_tcp_transport():
    init = f"tcp://127.0.0.1:{free_port()}"
    run = processes("tcp_init", 2, lambda r: {"TEST_INIT_METHOD": init, "TEST_RANK": str(r),
                                               "TEST_WORLD": "2", "FERRO_TRANSPORT": "tcp",
                                               "FERRO_TOKEN": "x"})
    assert run.returncodes == [0, 0], run.output[-4000:]
    assert [(r["value"], r["transport"]) for r in run.results] == [(3.0, "TcpBackend")] * 2
