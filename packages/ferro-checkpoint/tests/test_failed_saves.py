"""What a failed save leaves (found by a fourth bug hunt): a retry never commits a peer's shard
of the failed attempt, disk errors come out as CheckpointIOError naming the file, and a
manager's failure already reported by its future does not cost the next save."""

import errno
import os
import time
from pathlib import Path

import numpy as np
import pytest

import ferro_checkpoint.layout as layout_mod
import ferro_checkpoint.save as save_mod
from ferro_checkpoint import (
    AsyncCheckpointer,
    AsyncCheckpointError,
    CheckpointIOError,
    CheckpointManager,
    ShardMetadata,
    TensorShardSpec,
    load_distributed,
    save_distributed,
)

SPEC = ShardMetadata(2, {"w": TensorShardSpec((4, 2), 0, (2, 2))})


def _save(directory, rank, step, **kwargs):
    return save_distributed({"w": np.full((2, 2), step * 10 + rank, np.float32)}, directory,
                            rank, 2, SPEC, **kwargs)


def _loaded(directory):
    return load_distributed(directory, 0, 1)["w"][:, 0].tolist()


def test_the_contracts_call_numbers_its_saves_without_a_backend(tmp_path):
    """``save_distributed(state, directory, rank, world_size, spec)`` (API.md's call, no id,
    no backend) saves and commits on several ranks, one after another: g1, then g2."""
    for step in (1, 2):
        assert [_save(tmp_path, r, step) for r in (0, 1)] == [f"g{step}"] * 2
        assert _loaded(tmp_path) == [step * 10, step * 10, step * 10 + 1, step * 10 + 1]


def test_a_retried_step_commits_the_step_and_later_steps_are_never_mixed(tmp_path):
    """The hunt's sequence with the ids the caller shares (its steps)."""
    for r in (0, 1):
        _save(tmp_path, r, 1, checkpoint_id="step1")
    _save(tmp_path, 1, 2, checkpoint_id="step2")  # rank 0's save of step 2 fails
    assert _loaded(tmp_path) == [10, 10, 11, 11]
    for r in (0, 1):  # both ranks retry step 2
        _save(tmp_path, r, 2, checkpoint_id="step2")
    assert _loaded(tmp_path) == [20, 20, 21, 21]
    for r in (0, 1):
        _save(tmp_path, r, 3, checkpoint_id="step3")
    assert _loaded(tmp_path) == [30, 30, 31, 31]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "metadata.json", "rank_0.safetensors", "rank_1.safetensors"]


def test_async_saves_retried_on_every_rank_are_never_mixed(tmp_path, monkeypatch):
    """AsyncCheckpointer numbers its saves: a failed one counts on every rank."""
    real = save_mod.write_safetensors
    ck = [AsyncCheckpointer(tmp_path, r, 2, SPEC) for r in range(2)]

    def state(step, r):
        return {"w": np.full((2, 2), step * 10 + r, np.float32)}

    for r in (0, 1):
        ck[r].save_async(state(1, r)).wait(30)
    ck[1].save_async(state(2, 1)).wait(30)

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(save_mod, "write_safetensors", full)
    with pytest.raises(AsyncCheckpointError):
        ck[0].save_async(state(2, 0)).wait(30)
    monkeypatch.setattr(save_mod, "write_safetensors", real)
    assert _loaded(tmp_path) == [10, 10, 11, 11]
    for step in (2, 3):  # every rank retries step 2, then saves step 3
        for r in (0, 1):
            ck[r].save_async(state(step, r)).wait(30)
        assert _loaded(tmp_path) == [step * 10] * 2 + [step * 10 + 1] * 2


def test_a_read_only_directory_is_a_checkpoint_io_error(tmp_path, monkeypatch):
    """The cleanup's unlink failed too (EROFS) and its bare OSError replaced the typed one."""
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(save_mod, "write_safetensors", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(CheckpointIOError, match=r"cannot write .*\.rank_0\.step1\.safetensors"
                                                r"\.part.*Read-only file system"):
        _save(tmp_path, 0, 1, checkpoint_id="step1")


def test_a_full_disk_at_the_commit_record_is_a_checkpoint_io_error_and_leaves_nothing(
        tmp_path, monkeypatch):
    """ENOSPC while writing .commit.<id>.json was a bare OSError naming no file, and left an
    empty .commit.<id>.json.part.* until the next save."""
    for r in (0, 1):
        _save(tmp_path, r, 1, checkpoint_id="step1")
    _save(tmp_path, 0, 2, checkpoint_id="step2")
    real_open = open

    class FullFile:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_disk(path, mode="r", *args, **kwargs):
        return FullFile(real_open(path, mode, *args, **kwargs))

    monkeypatch.setattr(layout_mod, "open", full_disk, raising=False)
    with pytest.raises(CheckpointIOError, match=r"cannot write .*\.commit\.step2\.json: .*No "
                                                r"space left"):
        _save(tmp_path, 1, 2, checkpoint_id="step2")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".commit")]
    assert _loaded(tmp_path) == [10, 10, 11, 11]  # the previous checkpoint stays
    monkeypatch.undo()
    _save(tmp_path, 1, 2, checkpoint_id="step2")  # space freed: the retry commits
    assert _loaded(tmp_path) == [20, 20, 21, 21]


def test_write_json_durably_removes_its_temp_file_and_names_the_path(tmp_path, monkeypatch):
    def fails(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(layout_mod.os, "fsync", fails)
    target = tmp_path / "x.json"
    with pytest.raises(CheckpointIOError, match=rf"cannot write {target}"):
        layout_mod.write_json_durably(target, "{}")
    assert os.listdir(tmp_path) == []


def _manager_with_a_failed_async_save(root):
    spec = ShardMetadata(1, {"w": TensorShardSpec((2, 2), 0, (2,))})
    m = CheckpointManager(root, 0, 1)
    (root / "step_5").write_text("")  # step 5's directory cannot be made
    fut = m.save(5, {"w": np.full((2, 2), 5, np.float32)}, spec, blocking=False)
    return m, spec, fut


def test_a_failure_raised_by_the_futures_wait_is_not_raised_again_by_the_next_save(tmp_path):
    """save(6) raised step 5's error a second time and saved nothing."""
    m, spec, fut = _manager_with_a_failed_async_save(tmp_path)
    with pytest.raises(AsyncCheckpointError):
        fut.wait(timeout=30)
    with pytest.raises(AsyncCheckpointError):  # (the future itself still says so)
        fut.wait(timeout=30)
    m.save(6, {"w": np.full((2, 2), 6, np.float32)}, spec)
    assert m.steps() == [6]


def test_a_failure_never_observed_is_raised_by_the_next_save_once(tmp_path):
    m, spec, fut = _manager_with_a_failed_async_save(tmp_path)
    while not fut.is_done():
        time.sleep(0.01)
    with pytest.raises(AsyncCheckpointError):
        m.save(6, {"w": np.full((2, 2), 6, np.float32)}, spec)
    assert m.steps() == []
    m.save(7, {"w": np.full((2, 2), 7, np.float32)}, spec)
    assert m.steps() == [7]


def test_consolidate_reports_the_write_error_not_the_cleanups(tmp_path, monkeypatch):
    import sys

    from ferro_checkpoint import consolidate

    consolidate_mod = sys.modules["ferro_checkpoint.consolidate"]  # (the name is the function)

    for r in (0, 1):
        _save(tmp_path / "c", r, 1, checkpoint_id="step1")

    def refused(*args, **kwargs):
        raise CheckpointIOError("the write's own error")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(consolidate_mod, "write_safetensors", refused)
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(CheckpointIOError, match="the write's own error"):
        consolidate(tmp_path / "c", tmp_path / "full.safetensors")
