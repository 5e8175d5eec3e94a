"""torch's DDP and FSDP2 (fully_shard) and every collective over "ferro" against gloo on the
same inputs, in the same processes: 2 ranks under torchrun (shared-memory engine: the compiled
backend), 4 ranks under ferrorun over TCP (the Python backend; with subgroups and a 2-D
DeviceMesh, HSDP)."""

import pytest
from _launch import ferrorun, torchrun
from test_compiled_backend import TOOLCHAIN


def _check(run, n: int, transport: str, kind: str) -> dict[int, dict]:
    assert run.returncodes == [0], run.output[-6000:]
    ranks = run.by_rank()
    assert sorted(ranks) == list(range(n)), run.output[-3000:]
    for r in ranks.values():
        assert r["transport"] == transport and r["kind"] == kind, r
        assert r["sources"]["gloo"] > 50  # most cases compared with gloo itself
        for name in ("ddp", "fsdp"):
            assert len(r[name]) == 6 and all(x == x for x in r[name])  # 6 finite losses
    return ranks


@pytest.mark.timeout(150)
def test_two_ranks_under_torchrun_match_gloo(compiled_backend):
    # the engine's job: the compiled backend wherever it builds (no silent fallback)
    kind = "python" if compiled_backend is None and not TOOLCHAIN else "compiled"
    ranks = _check(torchrun("suite", 2), 2, "ShmBackend", kind)
    # each rank trains on its own data: the ranks' local losses differ, the models do not
    assert ranks[0]["ddp"] != ranks[1]["ddp"]


@pytest.mark.timeout(150)
def test_four_ranks_under_ferrorun_over_tcp_match_gloo_with_subgroups_and_hsdp():
    ranks = _check(ferrorun("suite", 4, args=("--transport", "tcp")), 4, "TcpBackend", "python")
    for r in ranks.values():
        assert len(r["hsdp"]) == 6
        assert r["subgroup_sources"]["gloo"] > 50
