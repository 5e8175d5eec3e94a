"""A save whose ranks disagree on what they save (a tensor's dtype, its spec) is refused by the
committing rank, on every rank with a backend, and the previous checkpoint stays loadable;
names safetensors cannot hold, numpy-integer ranks and a file where a step's folder belongs get
typed errors that say what was wrong."""

import numpy as np
import pytest
from _util import save_all, shards_of, spec_for

from ferro_checkpoint import (
    CheckpointIOError,
    CheckpointManager,
    InvalidArgumentError,
    ShardMetadata,
    TensorError,
    TensorShardSpec,
    load_distributed,
    save_distributed,
)

FULL = {"w": np.arange(8, dtype=np.float32).reshape(4, 2)}


def _still_the_first(d):
    for world in (1, 2):
        got = np.concatenate([load_distributed(d, r, world)["w"] for r in range(world)])
        np.testing.assert_array_equal(got, FULL["w"])
    assert not list(d.glob("rank_*.tmp"))


@pytest.mark.parametrize("committer", [0, 1])
def test_ranks_saving_other_dtypes_commit_nothing(tmp_path, committer):
    save_all(FULL, tmp_path, 2)
    spec = spec_for(FULL, 2)
    other = 1 - committer  # saves first, as float64; the committer (last) saves float32
    save_distributed({"w": shards_of(FULL, spec, other)["w"].astype(np.float64)}, tmp_path,
                     other, 2, spec, checkpoint_id="g2")
    with pytest.raises(TensorError, match=rf"rank {other}'s shard .*'w' is F64\(2, 2\), "
                                          r"the committing rank's .* F32\(2, 2\); not committing"):
        save_distributed(shards_of(FULL, spec, committer), tmp_path, committer, 2, spec,
                         checkpoint_id="g2")
    _still_the_first(tmp_path)


def test_ranks_saving_other_specs_of_the_same_shapes_commit_nothing(tmp_path):
    save_all(FULL, tmp_path, 2)
    spec = spec_for(FULL, 2)
    # rank 0 says the tensor is (4, 2) cut by rows; rank 1 that it is (2, 4) cut by columns:
    # each rank's own piece is (2, 2) either way
    other = ShardMetadata(2, {"w": TensorShardSpec((2, 4), 1, (2, 2))})
    save_distributed(shards_of(FULL, spec, 0), tmp_path, 0, 2, spec, checkpoint_id="g2")
    with pytest.raises(TensorError, match="rank 0's shard .*its shard spec .*differs"):
        save_distributed(shards_of(FULL, spec, 1), tmp_path, 1, 2, other, checkpoint_id="g2")
    _still_the_first(tmp_path)


def test_with_a_backend_every_rank_raises_at_once(tmp_path):
    pytest.importorskip("ferro_backend")
    from ferro_backend.testing import run_ranks

    save_all(FULL, tmp_path, 2)
    spec = spec_for(FULL, 2)

    def fn(b):
        mine = shards_of(FULL, spec, b.rank)["w"]
        try:
            save_distributed({"w": mine.astype(np.float64) if b.rank else mine}, tmp_path,
                             b.rank, 2, spec, backend=b)
        except TensorError as exc:
            return str(exc)
        return "saved"

    said = run_ranks(fn, 2, timeout=30)  # (before: rank 1 waited for a barrier's deadline)
    assert all("rank 1's shard" in s and "not committing" in s for s in said), said
    assert said[1].endswith("(rank 0's commit)")
    _still_the_first(tmp_path)


def test_after_a_save_one_rank_refused_the_next_saves_commit(tmp_path):
    """Rank 1 refuses a save (a wrong shape) while rank 0 times out waiting: rank 0's unread id
    message then paired with rank 1's next save, so every later save wrote other ids on the
    two ranks and returned on both without committing. A save's messages carry its number."""
    pytest.importorskip("ferro_backend")
    from ferro_backend.testing import run_ranks

    spec = spec_for(FULL, 2)

    def fn(b):
        said = []
        for k in range(3):
            # save 0 fails (rank 0 waits out 2 s); saves 1 and 2 must commit: their deadline
            # is no part of the test, and a loaded host's fsync may stall past 2 s
            b.timeout = 2 if k == 0 else 30
            mine = shards_of(FULL, spec, b.rank)["w"] + k
            try:
                save_distributed({"w": mine[:1] if (k == 0 and b.rank) else mine}, tmp_path,
                                 b.rank, 2, spec, backend=b)
                said.append("saved")
            except Exception as exc:
                said.append(type(exc).__name__)
            b.barrier(timeout=20)
        return said

    said = run_ranks(fn, 2, timeout=60)
    assert said[0][1:] == said[1][1:] == ["saved", "saved"], said
    got = np.concatenate([load_distributed(tmp_path, r, 2)["w"] for r in range(2)])
    np.testing.assert_array_equal(got, FULL["w"] + 2)


def test_two_checkpointers_on_one_backend_keep_their_saves_apart(tmp_path):
    pytest.importorskip("ferro_backend")
    from ferro_backend.testing import run_ranks
    from ferro_checkpoint import AsyncCheckpointer

    spec = spec_for(FULL, 2)

    def fn(b):
        one = AsyncCheckpointer(tmp_path / "model", b.rank, 2, spec, backend=b)
        two = AsyncCheckpointer(tmp_path / "optim", b.rank, 2, spec, backend=b)
        for k in range(4):
            mine = shards_of(FULL, spec, b.rank)["w"]
            f1, f2 = one.save_async({"w": mine + k}), two.save_async({"w": mine - k})
            f1.wait(30)
            f2.wait(30)
            b.barrier(timeout=20)
            for d, want in (("model", FULL["w"] + k), ("optim", FULL["w"] - k)):
                got = np.concatenate([load_distributed(tmp_path / d, r, 2)["w"]
                                      for r in range(2)])
                np.testing.assert_array_equal(got, want)
            b.barrier(timeout=20)
        return True

    assert run_ranks(fn, 2, timeout=120) == [True, True]


@pytest.mark.parametrize("name", ["__metadata__", 3])
def test_names_safetensors_cannot_hold_are_refused_before_writing(tmp_path, name):
    spec = ShardMetadata(1, {name: TensorShardSpec((2,), 0, (2,))})
    with pytest.raises(TensorError, match=rf"names a tensor {name!r}"):
        save_distributed({name: np.zeros(2, np.float32)}, tmp_path, 0, 1, spec)
    assert not list(tmp_path.iterdir())


def test_numpy_integer_ranks_are_ranks(tmp_path):
    spec = spec_for(FULL, 2)
    for r in np.arange(2):
        save_distributed(shards_of(FULL, spec, int(r)), tmp_path, r, np.int64(2), spec,
                         checkpoint_id="g1")
    np.testing.assert_array_equal(load_distributed(tmp_path, np.int32(0), np.int64(1))["w"],
                                  FULL["w"])
    manager = CheckpointManager(tmp_path / "m", np.int64(0), np.int64(1))
    assert manager.rank == 0 and type(manager.rank) is int
    for rank, world, said in ((True, 2, "rank must be an int, not bool"),
                              (0, 2.0, "world_size must be an int, not float"),
                              (np.int64(2), 2, "rank 2 is out of range for world_size 2"),
                              (0, np.int8(0), "world_size 0 must be >= 1")):
        with pytest.raises(InvalidArgumentError, match=said):
            load_distributed(tmp_path, rank, world)


@pytest.mark.parametrize("world", [1, 2])
def test_a_file_where_a_step_folder_belongs_is_an_io_error(tmp_path, world):
    (tmp_path / "step_5").write_text("not a folder")
    spec = ShardMetadata(world, {"w": TensorShardSpec((2 * world,), 0, (2,) * world)})
    with pytest.raises(CheckpointIOError, match="step_5"):
        CheckpointManager(tmp_path, 0, world).save(5, {"w": np.zeros(2, np.float32)}, spec)
    assert (tmp_path / "step_5").read_text() == "not a folder"
