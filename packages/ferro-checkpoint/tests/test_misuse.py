"""What a third bug hunt found in the API: an uneven split saved and loaded on the same world,
shards of mixed dtypes under a metadata.json that records none, two saves of one id at once,
a header over safetensors' limit, names that are not Unicode, and argument errors that named
the wrong thing."""

import json
import multiprocessing as mp
import os
import threading

import numpy as np
import pytest

from ferro_checkpoint import (
    CheckpointManager,
    InvalidArgumentError,
    MissingShardError,
    SerializationError,
    ShardMetadata,
    TensorError,
    TensorShardSpec,
    load_distributed,
    open_checkpoint,
    reshard,
    save_distributed,
)
from ferro_checkpoint.layout import part_shard_path, remove_stale_tmp_shards

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("sizes", [(1, 3), (3, 3, 3, 1), (0, 4, 0)])
def test_the_saving_world_gets_each_ranks_own_uneven_shard_back(tmp_path, sizes):
    """It got the even split's rows instead (torch.chunk's 3, 3, 3, 1 came back as 3, 3, 2, 2),
    through load_distributed and the manager alike; another world still gets the even split."""
    n, world = sum(sizes), len(sizes)
    full = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    spec = ShardMetadata(world, {"w": TensorShardSpec((n, 2), 0, sizes)})
    starts = np.cumsum((0,) + sizes)
    for r in range(world):
        save_distributed({"w": full[starts[r]:starts[r + 1]]}, tmp_path / "d", r, world, spec)
    managers = [CheckpointManager(tmp_path / "m", r, world) for r in range(world)]
    for r, m in enumerate(managers):
        m.save(1, {"w": full[starts[r]:starts[r + 1]]}, spec)
    for r in range(world):
        own = full[starts[r]:starts[r + 1]]
        np.testing.assert_array_equal(load_distributed(tmp_path / "d", r, world)["w"], own)
        np.testing.assert_array_equal(managers[r].restore()[0]["w"], own)
    even = np.array_split(full, world + 1)
    for r in range(world + 1):
        np.testing.assert_array_equal(load_distributed(tmp_path / "d", r, world + 1)["w"],
                                      even[r])


def test_shards_of_mixed_dtypes_under_a_metadata_without_dtypes_are_refused(tmp_path):
    """A metadata.json that records no dtypes (an old one, or one beside plain safetensors
    shards) took the first shard's dtype for every shard: float64 rows loaded as garbage."""
    safetensors = pytest.importorskip("safetensors.numpy")
    safetensors.save_file({"w": np.array([1, 2], np.float32)}, str(tmp_path / "rank_0.safetensors"))
    safetensors.save_file({"w": np.array([3, 4], np.float64)}, str(tmp_path / "rank_1.safetensors"))
    (tmp_path / "metadata.json").write_text(json.dumps(
        {"num_ranks": 2, "tensor_specs": {"w": {"full_shape": [4], "shard_dim": 0,
                                                "shard_sizes": [2, 2]}}}))
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        with pytest.raises(TensorError, match=r"'w': its shards disagree on the dtype "
                                              r"\(rank 0: F32, rank 1: F64\)"):
            load_distributed(tmp_path, rank, world)


def _save_at_once(directory, value, go, out):
    go.wait(30)
    n = 1 << 19
    spec = ShardMetadata(1, {"w": TensorShardSpec((n,), 0, (n,))})
    try:
        save_distributed({"w": np.full(n, value)}, directory, 0, 1, spec, checkpoint_id="same")
        out.put("ok")
    except Exception as exc:
        out.put(type(exc).__name__)


def test_two_saves_of_one_id_at_once_never_write_into_one_file(tmp_path):
    """Each writer has a temp file of its own (they shared one, opened with O_TRUNC: the
    loser went on writing into the file the winner had committed, whose checksums then
    failed every load). Whatever the interleaving, what is committed loads as one save."""
    other = []
    t = threading.Thread(target=lambda: other.append(part_shard_path(tmp_path, 0, "x")))
    t.start()
    t.join(10)
    assert other and other[0] != part_shard_path(tmp_path, 0, "x")  # a thread's own too
    ctx = mp.get_context("fork")
    for _ in range(3):
        d = tmp_path / f"d{_}"
        go, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_save_at_once, args=(d, v, go, out)) for v in (1.0, 2.0)]
        for p in procs:
            p.start()
        go.set()
        for p in procs:
            p.join(60)
        said = [out.get(timeout=5) for _ in procs]
        assert "ok" in said, said
        got = np.unique(load_distributed(d, 0, 1)["w"])
        assert got.tolist() in ([1.0], [2.0]), got
    # a leftover of either form (0.3's shared name, this one's) is still cleaned up
    (tmp_path / ".rank_0.old.safetensors.part").write_bytes(b"left")
    (tmp_path / ".rank_0.old.safetensors.part.12-34").write_bytes(b"left")
    remove_stale_tmp_shards(tmp_path, 0, "new")
    assert not list(tmp_path.glob(".rank_0.*.part*"))


def test_a_header_over_the_readers_limit_is_refused_before_a_byte_is_written(tmp_path,
                                                                              monkeypatch):
    """It was written and fsynced whole (100 MiB and more), then refused at the commit as
    "truncated or not safetensors", the temp shard left behind."""
    from ferro_checkpoint import safetensors_io

    monkeypatch.setattr(safetensors_io, "MAX_HEADER", 4096)
    spec = ShardMetadata(1, {"w": TensorShardSpec((4,), 0, (4,))})
    with pytest.raises(SerializationError, match=r"header would be \d+ bytes, over the "
                                                 r"4096-byte limit .* 'ferro.extra'"):
        save_distributed({"w": np.zeros(4)}, tmp_path, 0, 1, spec, extra={"x": "y" * 5000})
    assert os.listdir(tmp_path) == []


def test_a_name_that_is_not_unicode_is_refused(tmp_path):
    spec = ShardMetadata(1, {"w\ud800": TensorShardSpec((2,), 0, (2,))})
    with pytest.raises(TensorError, match="not valid Unicode"):
        save_distributed({"w\ud800": np.zeros(2)}, tmp_path, 0, 1, spec)


def test_arguments_are_named_for_what_is_wrong(tmp_path):
    spec = ShardMetadata(2, {"w": TensorShardSpec((4,), 0, (2, 2))})
    for r in range(2):
        save_distributed({"w": np.full(2, r, np.float32)}, tmp_path, r, 2, spec)
    ck = open_checkpoint(tmp_path)
    with pytest.raises(InvalidArgumentError, match="reshard: old_world_size '2' is not an int"):
        reshard(tmp_path, "2", 1, 0)
    for call in (ck.shard, ck.extra):
        with pytest.raises(InvalidArgumentError, match="rank '0' is not an int"):
            call("0")
        with pytest.raises(InvalidArgumentError, match="rank True is not an int"):
            call(True)
        with pytest.raises(InvalidArgumentError, match="rank -1 is out of range"):
            call(-1)
    assert ck.extra(np.int64(1)) is None and ck.shard(np.int64(1)) is not None
    (tmp_path / "afile").write_text("x")
    with pytest.raises(MissingShardError, match="afile is not a directory"):
        load_distributed(tmp_path / "afile", 0, 1)
