"""Found by a fifth bug hunt: a committed save that cannot be finished on a read-only disk,
concat/slice of arrays they cannot copy, and a pruned step that is a symbolic link."""

import errno
import os

import numpy as np
import pytest

from ferro_checkpoint import (
    CheckpointIOError,
    CheckpointManager,
    ShardMetadata,
    TensorError,
    TensorShardSpec,
    concat_along_dim,
    consolidate,
    load_distributed,
    open_checkpoint,
    save_distributed,
    slice_along_dim,
)

SPEC = ShardMetadata(1, {"w": TensorShardSpec((4,), 0, (4,))})


def _committed_not_renamed(directory, ckpt_id="step2"):
    """A save past its commit point whose renames did not happen (a crash)."""
    import ferro_checkpoint.save as save_mod

    save_distributed({"w": np.zeros(4)}, directory, 0, 1, SPEC, checkpoint_id="step1")
    real = save_mod.recover
    save_mod.recover = lambda d: None
    try:
        save_distributed({"w": np.ones(4)}, directory, 0, 1, SPEC, checkpoint_id=ckpt_id)
    finally:
        save_mod.recover = real
    assert (directory / f".commit.{ckpt_id}.json").exists()


@pytest.mark.parametrize("op", ["load", "open", "consolidate", "save", "steps", "restore"])
def test_a_committed_save_on_a_read_only_disk_is_a_checkpoint_io_error(tmp_path, monkeypatch,
                                                                      op):
    """recover's renames raised a bare OSError (EROFS) from every open and save."""
    step = tmp_path / "step_2"
    _committed_not_renamed(step)
    manager = CheckpointManager(tmp_path / "other", 0, 1)  # (built before the disk is read-only)
    manager.root = tmp_path

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "replace", read_only)
    calls = {"load": lambda: load_distributed(step, 0, 1), "open": lambda: open_checkpoint(step),
             "consolidate": lambda: consolidate(step, tmp_path / "one.safetensors"),
             "save": lambda: save_distributed({"w": np.ones(4)}, step, 0, 1, SPEC,
                                              checkpoint_id="step3"),
             "steps": manager.steps, "restore": lambda: manager.restore(2)}
    with pytest.raises(CheckpointIOError, match=r"cannot finish the save committed in .*step_2 "
                                                r".*Read-only file system.*write access"):
        calls[op]()


def test_concat_and_slice_refuse_what_they_cannot_copy_with_tensor_errors():
    out = np.zeros(4)
    out.flags.writeable = False
    with pytest.raises(TensorError, match="out .* is read-only"):
        concat_along_dim([np.zeros(2)] * 2, 0, out=out)
    objects = np.array([1, "a", None], dtype=object)
    with pytest.raises(TensorError, match="dtype object.*Python objects"):
        concat_along_dim([objects, objects], 0)
    with pytest.raises(TensorError, match="dtype object.*Python objects"):
        slice_along_dim(objects, 0, 0, 2)
    np.testing.assert_array_equal(slice_along_dim(np.arange(6).reshape(2, 3), 1, 1, 3),
                                  [[1, 2], [4, 5]])


def test_pruning_a_step_that_is_a_symbolic_link_deletes_its_files(tmp_path):
    """shutil.rmtree refuses links: the pruned step's data stayed, and its tombstone link for
    ever. Its checkpoint's files go, then the folder once empty, then the link."""
    root, disk = tmp_path / "root", tmp_path / "disk"
    root.mkdir()
    for step in (1, 2):
        save_distributed({"w": np.full(4, step)}, disk / f"step_{step}", 0, 1, SPEC,
                         checkpoint_id=f"step{step}")
        os.symlink(disk / f"step_{step}", root / f"step_{step}")
    (disk / "step_2" / "notes.txt").write_text("not the checkpoint's")
    m = CheckpointManager(root, 0, 1, keep_last=1)
    assert m.steps() == [1, 2]
    m.save(3, {"w": np.full(4, 3.0)}, SPEC)
    assert m.steps() == [3] and sorted(os.listdir(root)) == ["step_3"]
    assert not (disk / "step_1").exists()
    assert os.listdir(disk / "step_2") == ["notes.txt"]  # (not ours: kept)
    np.testing.assert_array_equal(m.restore()[0]["w"], np.full(4, 3.0))
