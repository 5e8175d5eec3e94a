"""Ranks that do not move together (found by a fifth bug hunt): a collective save one rank
refuses, a rank that runs ahead of its peers without a backend, and the messages' subgroup."""

import os
import time

import numpy as np
import pytest

from ferro_checkpoint import (
    AsyncCheckpointer,
    CheckpointManager,
    InvalidArgumentError,
    ShardMetadata,
    TensorError,
    TensorShardSpec,
    load_distributed,
    open_checkpoint,
    save_distributed,
)
from ferro_checkpoint.layout import tmp_shard_path

SPEC = ShardMetadata(2, {"w": TensorShardSpec((4, 2), 0, (2, 2))})


def _state(step, rank):
    return {"w": np.full((2, 2), step * 10 + rank, np.float32)}


def _loaded(directory):
    return load_distributed(directory, 0, 1)["w"][:, 0].tolist()


def _expected(step):
    return [step * 10, step * 10, step * 10 + 1, step * 10 + 1]


# -- (1) a collective save one rank refuses ------------------------------------------------------

def _refusing(directory, how):
    """Each rank's (error class, message, seconds) of a save rank 1 refuses by ``how``, then
    whether the next save worked."""
    def fn(b):
        said = []
        for attempt in range(2):
            state = _state(attempt + 1, b.rank)
            extra = None
            if attempt == 0 and b.rank == 1:
                if how == "shape":
                    state = {"w": np.zeros((1, 2), np.float32)}
                else:
                    extra = {"x": object()}
            t0 = time.monotonic()
            try:
                save_distributed(state, directory, b.rank, 2, SPEC, backend=b, extra=extra)
                said.append(("ok", "", time.monotonic() - t0))
            except Exception as exc:
                said.append((type(exc).__name__, str(exc), time.monotonic() - t0))
        return said

    from ferro_backend.testing import run_ranks

    return run_ranks(fn, 2, timeout=120, backend_timeout=20)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["shape", "extra"])
def test_a_rank_refusing_a_collective_save_fails_every_rank_at_once(tmp_path, how):
    """Rank 0 waited for the backend's whole timeout (then a CollectiveTimeoutError saying
    nothing of rank 1's error), and rank 1's unread id made the next save time out too."""
    pytest.importorskip("ferro_backend")
    said = _refusing(tmp_path, how)
    kind = "TensorError" if how == "shape" else "InvalidArgumentError"
    for rank in (0, 1):
        first, second = said[rank]
        assert first[0] == kind and first[2] < 10, said
        assert second[0] == "ok", said
    assert "rank 1 refused its save" in said[0][0][1] and "nothing is committed" in \
        said[0][0][1], said
    assert _loaded(tmp_path) == _expected(2)


@pytest.mark.timeout(150)
def test_a_shard_write_failing_on_one_rank_fails_every_rank_at_once(tmp_path, monkeypatch):
    pytest.importorskip("ferro_backend")
    import ferro_checkpoint.save as save_mod
    from ferro_backend.testing import run_ranks

    real = save_mod.write_safetensors

    def full_on_rank_0(path, *args, **kwargs):
        if ".rank_0." in path.name and not (tmp_path / "metadata.json").exists():
            raise OSError(28, "No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(save_mod, "write_safetensors", full_on_rank_0)

    def fn(b):
        said = []
        for step in (1, 2, 3):
            t0 = time.monotonic()
            try:
                save_distributed(_state(step, b.rank), tmp_path, b.rank, 2, SPEC, backend=b)
                said.append(("ok", time.monotonic() - t0))
            except Exception as exc:
                said.append((f"{type(exc).__name__}: {exc}", time.monotonic() - t0))
        return said

    said = run_ranks(fn, 2, timeout=120, backend_timeout=20)
    for rank in (0, 1):
        assert said[rank][0][0].startswith("CheckpointIOError") and said[rank][0][1] < 10, said
        assert all(s[0].startswith("CheckpointIOError") for s in said[rank]), said
    assert "rank 0 refused its save" in said[1][0][0] and "No space left" in said[1][0][0]
    monkeypatch.setattr(save_mod, "write_safetensors", real)
    said = run_ranks(fn, 2, timeout=120, backend_timeout=20)
    assert said == [[("ok", s[1]) for s in said[r]] for r in (0, 1)]
    assert _loaded(tmp_path) == _expected(3)


@pytest.mark.timeout(150)
def test_a_managers_refused_save_tells_its_peers(tmp_path):
    """CheckpointManager.save checks the shard on the caller's thread: the refusing rank raised
    there, never taking part, and its peers waited for their deadline."""
    pytest.importorskip("ferro_backend")
    from ferro_backend.testing import run_ranks

    def fn(b):
        m = CheckpointManager(tmp_path, b.rank, 2, backend=b)
        said = []
        for step in (1, 2):
            state = _state(step, b.rank)
            if step == 1 and b.rank == 1:
                state = {"w": np.zeros((3, 2), np.float32)}
            t0 = time.monotonic()
            try:
                m.save(step, state, SPEC)
                said.append(("ok", time.monotonic() - t0))
            except TensorError as exc:
                said.append((str(exc), time.monotonic() - t0))
        return said, m.steps()

    said = run_ranks(fn, 2, timeout=120, backend_timeout=20)
    for rank in (0, 1):
        (first, t), (second, _) = said[rank][0]
        assert t < 10 and second == "ok", said
    assert "rank 1 refused its save" in said[0][0][0][0], said
    assert said[0][1] == said[1][1] == [2]


# -- (3) the saves' subgroup ---------------------------------------------------------------------

def test_collective_saves_reuse_one_subgroup(tmp_path):
    """Each save made two SubBackends, each registering an abort callback with the transport
    that nothing removes: the list grew by two every save."""
    pytest.importorskip("ferro_backend")
    from ferro_backend.testing import run_ranks

    def callbacks(b):
        return sum(len(v) for v in b._box.on_group_abort.values())

    def fn(b):
        before = callbacks(b)
        for step in range(20):
            save_distributed(_state(step, b.rank), tmp_path, b.rank, 2, SPEC, backend=b)
        return callbacks(b) - before

    assert run_ranks(fn, 2, timeout=60) == [1, 1]
    assert _loaded(tmp_path) == _expected(19)


# -- (5), (6) a rank running ahead without a backend ---------------------------------------------

def test_the_contracts_call_on_a_rank_running_ahead_never_mixes_saves(tmp_path):
    """Rank 0 saved step 1 then step 2 before rank 1 saved step 1: both rank-0 saves took the
    default id g1 (nothing committed yet), and rank 1's step 1 committed rank 0's step 2."""
    assert save_distributed(_state(1, 0), tmp_path, 0, 2, SPEC) == "g1"
    assert save_distributed(_state(2, 0), tmp_path, 0, 2, SPEC) == "g2"
    assert save_distributed(_state(1, 1), tmp_path, 1, 2, SPEC) == "g1"
    assert _loaded(tmp_path) == _expected(1)
    assert save_distributed(_state(2, 1), tmp_path, 1, 2, SPEC) == "g2"
    assert _loaded(tmp_path) == _expected(2)
    for r in (0, 1):  # in step again
        assert save_distributed(_state(3, r), tmp_path, r, 2, SPEC) == "g3"
    assert _loaded(tmp_path) == _expected(3)


def test_a_default_id_save_that_failed_is_retried_under_its_id(tmp_path, monkeypatch):
    import ferro_checkpoint.save as save_mod

    real = save_mod.write_safetensors

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(save_mod, "write_safetensors", full)
    with pytest.raises(OSError):
        save_distributed(_state(1, 0), tmp_path, 0, 2, SPEC)
    monkeypatch.setattr(save_mod, "write_safetensors", real)
    assert [save_distributed(_state(1, r), tmp_path, r, 2, SPEC) for r in (0, 1)] == ["g1"] * 2
    assert _loaded(tmp_path) == _expected(1)


def _saves_steps(b, directory, steps):
    for step in steps:
        save_distributed(_state(step, b.rank), directory, b.rank, 2, SPEC)
    return "ok"


@pytest.mark.timeout(120)
def test_the_contracts_call_commits_on_ranks_in_processes_and_a_restart_agrees(tmp_path):
    pytest.importorskip("ferro_backend")
    from ferro_backend.testing import run_processes, run_ranks

    assert run_processes(_saves_steps, 2, tmp_path, (1, 2, 3), timeout=90) == ["ok", "ok"]
    assert _loaded(tmp_path) == _expected(3)
    # new processes (a restart) agree on g4; threads in this process too, then g5
    assert run_processes(_saves_steps, 2, tmp_path, (4,), timeout=90) == ["ok", "ok"]
    assert open_checkpoint(tmp_path).checkpoint_id == "g4" and _loaded(tmp_path) == _expected(4)
    assert run_ranks(lambda b: _saves_steps(b, tmp_path, (5,)), 2, timeout=60) == ["ok"] * 2
    assert open_checkpoint(tmp_path).checkpoint_id == "g5" and _loaded(tmp_path) == _expected(5)


def test_a_rank_running_ahead_keeps_its_shard_of_the_pending_save(tmp_path):
    """AsyncCheckpointer without a backend: rank 0's save g2 deleted its own shard of g1 while
    rank 1 still wrote g1, so g1 never committed though every rank's save succeeded."""
    ck = [AsyncCheckpointer(tmp_path, r, 2, SPEC) for r in range(2)]
    ck[0].save_async(_state(1, 0)).wait(30)
    ck[0].save_async(_state(2, 0)).wait(30)
    ck[0].save_async(_state(3, 0)).wait(30)  # two saves ahead
    ck[1].save_async(_state(1, 1)).wait(30)
    assert open_checkpoint(tmp_path).checkpoint_id == "g1" and _loaded(tmp_path) == _expected(1)
    ck[1].save_async(_state(2, 1)).wait(30)
    assert _loaded(tmp_path) == _expected(2)
    ck[1].save_async(_state(3, 1)).wait(30)
    assert _loaded(tmp_path) == _expected(3)


def test_a_crash_leftover_goes_at_the_ranks_first_save_after_a_commit(tmp_path):
    for r in (0, 1):
        save_distributed(_state(1, r), tmp_path, r, 2, SPEC, checkpoint_id="step1")
    left = tmp_shard_path(tmp_path, 0, "crashed")
    left.write_bytes(b"a crashed save's shard")
    save_distributed(_state(2, 0), tmp_path, 0, 2, SPEC, checkpoint_id="step2")
    assert left.exists()  # (a peer might still commit it: nothing newer is committed)
    save_distributed(_state(2, 1), tmp_path, 1, 2, SPEC, checkpoint_id="step2")
    old = time.time() - 60  # (written before the committed shard, whatever the clock's tick)
    os.utime(left, (old, old))
    save_distributed(_state(3, 0), tmp_path, 0, 2, SPEC, checkpoint_id="step3")
    assert not left.exists()
    assert _loaded(tmp_path) == _expected(2)


def test_invalid_argument_error_is_still_raised_at_once_without_a_backend(tmp_path):
    with pytest.raises(InvalidArgumentError, match="world_size"):
        save_distributed(_state(1, 0), tmp_path, 0, 3, SPEC)
