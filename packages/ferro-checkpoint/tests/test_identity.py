"""Shards bound to their save: every shard carries its save's identity, and a shard copied in
from another save of the same model is refused by every reader (ShardMismatchError naming the
file and both identities); checkpoints written before identities existed still load."""

import json
import re
import shutil
import threading

import numpy as np
import pytest
from _util import save_all, shards_of, spec_for

from ferro_checkpoint import (
    AsyncCheckpointer,
    CheckpointManager,
    DistributedCheckpoint,
    IncompleteCheckpointError,
    MetadataError,
    ShardMismatchError,
    consolidate,
    flat_shard_metadata,
    load_distributed,
    open_checkpoint,
    reshard,
    save_distributed,
)
from ferro_checkpoint.safetensors_io import SafetensorsFile

FULL = {"w": np.arange(40, dtype=np.float32).reshape(10, 4), "b": np.arange(6, dtype=np.int64)}
OTHER = {k: v + 1 for k, v in FULL.items()}  # same names, shapes and dtypes, other values
HEX128 = re.compile(r"[0-9a-f]{32}")


def header(path) -> dict:
    return SafetensorsFile(path).metadata


def metadata(directory) -> dict:
    return json.loads((directory / "metadata.json").read_text())


def two_saves_one_shard_swapped(tmp_path, world=2, rank=1, **kwargs):
    """Two saves of the same model (default ids: both are 'g1') in a/ and b/; b's shard
    ``rank`` copied over a's. Returns (a, the copied file, a's shard id, b's shard id)."""
    a, b = tmp_path / "a", tmp_path / "b"
    save_all(FULL, a, world, **kwargs)
    save_all(OTHER, b, world, **kwargs)
    assert metadata(a)["checkpoint_id"] == metadata(b)["checkpoint_id"]  # the hard case
    shutil.copyfile(b / f"rank_{rank}.safetensors", a / f"rank_{rank}.safetensors")
    return (a, a / f"rank_{rank}.safetensors", metadata(a)["shard_ids"][rank],
            metadata(b)["shard_ids"][rank])


def mixed_error(info, path, mine, theirs) -> None:
    msg = str(info.value)
    assert str(path) in msg and mine in msg and theirs in msg, msg


def test_every_shard_header_carries_the_save_identity(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    save_all(FULL, tmp_path, 3)
    meta = metadata(tmp_path)
    ids = meta["shard_ids"]
    assert len(ids) == 3 and len(set(ids)) == 3 and all(HEX128.fullmatch(i) for i in ids)
    for r in range(3):
        h = header(tmp_path / f"rank_{r}.safetensors")
        assert h["ferro.shard_id"] == ids[r]
        assert h["ferro.checkpoint_id"] == meta["checkpoint_id"]
        assert {"ferro.checksum", "ferro.crc32c.w", "ferro.crc32c.b"} <= set(h)
        plain = safetensors_numpy.load_file(str(tmp_path / f"rank_{r}.safetensors"))
        assert plain["w"].tobytes() == shards_of(FULL, spec_for(FULL, 3), r)["w"].tobytes()


def test_two_saves_never_share_an_identity(tmp_path):
    for d in ("a", "b"):
        save_all(FULL, tmp_path / d, 2, checkpoint_id="same")  # same id, same bytes
    assert not set(metadata(tmp_path / "a")["shard_ids"]) & set(metadata(tmp_path / "b")
                                                                ["shard_ids"])
    save_all(FULL, tmp_path / "a", 2, checkpoint_id="same")  # re-save into the same directory
    assert metadata(tmp_path / "a")["shard_ids"] != metadata(tmp_path / "b")["shard_ids"]


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 0), (2, 1), (3, 2)])
def test_load_distributed_refuses_a_shard_of_another_save(tmp_path, world, rank):
    a, path, mine, theirs = two_saves_one_shard_swapped(tmp_path, world, rank)
    with pytest.raises(ShardMismatchError, match="shards of different saves are mixed") as info:
        load_distributed(a, rank, world)
    mixed_error(info, path, mine, theirs)
    assert isinstance(info.value, IncompleteCheckpointError)  # what callers caught before
    with pytest.raises(ShardMismatchError):  # resharded (reading every shard), verify off
        load_distributed(a, 0, 1 if world > 1 else 2, verify=False)


def test_reshard_refuses_a_shard_of_another_save(tmp_path):
    a, path, mine, theirs = two_saves_one_shard_swapped(tmp_path, 2, 1)
    with pytest.raises(ShardMismatchError) as info:
        reshard(a, 2, 1, 0)
    mixed_error(info, path, mine, theirs)
    np.testing.assert_array_equal(reshard(a, 2, 4, 0)["w"], FULL["w"][:3])  # rank 0's rows only


def test_consolidate_refuses_before_writing_anything(tmp_path):
    a, path, mine, theirs = two_saves_one_shard_swapped(tmp_path, 3, 2)
    out = tmp_path / "full.safetensors"
    with pytest.raises(ShardMismatchError) as info:
        consolidate(a, out)
    mixed_error(info, path, mine, theirs)
    assert not out.exists() and not list(tmp_path.glob(".full*"))


def test_extra_and_shard_accessors_refuse_it(tmp_path):
    a, path, mine, theirs = two_saves_one_shard_swapped(tmp_path, 2, 1, extra={"k": 1})
    ckpt = DistributedCheckpoint.open(a)
    assert ckpt.extra(0) == {"k": 1}
    for read in (lambda: ckpt.extra(1), lambda: ckpt.shard(1), lambda: ckpt.load(1, 2)):
        with pytest.raises(ShardMismatchError) as info:
            read()
        mixed_error(info, path, mine, theirs)


def test_a_shard_of_another_rank_of_the_same_save_is_refused(tmp_path):
    save_all(FULL, tmp_path, 2)
    shutil.copyfile(tmp_path / "rank_0.safetensors", tmp_path / "rank_1.safetensors")
    with pytest.raises(ShardMismatchError, match="rank_1.safetensors"):
        load_distributed(tmp_path, 0, 1)


@pytest.mark.parametrize("blocking", [True, False])
def test_manager_restore_refuses_a_step_shard_of_another_run(tmp_path, blocking):
    roots = tmp_path / "run1", tmp_path / "run2"
    spec = spec_for(FULL, 2)
    for root, full in zip(roots, (FULL, OTHER)):
        managers = [CheckpointManager(root, r, 2) for r in range(2)]
        for m in managers:  # both runs save step 7 as 'step7'
            m.save(7, shards_of(full, spec, m.rank), spec, extra={"run": str(root)},
                   blocking=blocking).wait(30)
    copied = roots[0] / "step_7" / "rank_0.safetensors"
    shutil.copyfile(roots[1] / "step_7" / "rank_0.safetensors", copied)
    mine, theirs = (metadata(r / "step_7")["shard_ids"][0] for r in roots)
    for world in (2, 1):  # rank 0 of 2 reads the copied file, so does a reshard to 1 rank
        with pytest.raises(ShardMismatchError) as info:
            CheckpointManager(roots[0], 0, world).restore()
        mixed_error(info, copied, mine, theirs)
    # a rank that never reads the copied file gets its own shard, which is of this step
    tensors, _ = CheckpointManager(roots[0], 1, 2).restore(7)
    np.testing.assert_array_equal(tensors["w"], shards_of(FULL, spec, 1)["w"])
    tensors, extra = CheckpointManager(roots[1], 0, 1).restore(7)
    np.testing.assert_array_equal(tensors["w"], OTHER["w"])
    assert extra == {"run": str(roots[1])}


def test_async_saves_are_bound_to_their_save(tmp_path):
    spec = spec_for(FULL, 2)
    for d, full in (("a", FULL), ("b", OTHER)):
        for r in range(2):
            ck = AsyncCheckpointer(tmp_path / d, r, 2, spec)
            ck.save_async(shards_of(full, spec, r)).wait(30)
    path = tmp_path / "a" / "rank_1.safetensors"
    shutil.copyfile(tmp_path / "b" / "rank_1.safetensors", path)
    with pytest.raises(ShardMismatchError, match=re.escape(str(path))):
        load_distributed(tmp_path / "a", 0, 1)


def test_collective_saves_are_bound_to_their_save(tmp_path):
    pytest.importorskip("ferro_backend")
    from ferro_backend.testing import run_ranks

    spec = spec_for(FULL, 2)
    for d, full in (("a", FULL), ("b", OTHER)):
        def fn(b, d=d, full=full):
            ck = AsyncCheckpointer(tmp_path / d, b.rank, 2, spec, backend=b)
            fut = ck.save_async(shards_of(full, spec, b.rank))
            fut.wait(20)
            return fut.checkpoint_id

        assert len(set(run_ranks(fn, 2, timeout=30))) == 1
    path = tmp_path / "a" / "rank_0.safetensors"
    shutil.copyfile(tmp_path / "b" / "rank_0.safetensors", path)
    with pytest.raises(ShardMismatchError) as info:
        load_distributed(tmp_path / "a", 0, 2)
    mixed_error(info, path, metadata(tmp_path / "a")["checkpoint_id"],
                metadata(tmp_path / "b")["checkpoint_id"])


def test_ranks_saving_at_once_commit_one_identity(tmp_path):
    """Without a backend both ranks may find all shards present and commit together: they
    read the same headers, so metadata.json always names the shards in place."""
    spec = spec_for(FULL, 2)
    errors: list[BaseException] = []
    for i in range(12):
        gen = {k: v + i for k, v in FULL.items()}

        def rank(r, gen=gen, i=i):
            try:
                save_distributed(shards_of(gen, spec, r), tmp_path, r, 2, spec,
                                 checkpoint_id=f"s{i}")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and not any(t.is_alive() for t in threads)
        np.testing.assert_array_equal(load_distributed(tmp_path, 0, 1)["w"], gen["w"])
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "metadata.json", "rank_0.safetensors", "rank_1.safetensors"]


def test_a_failed_write_leaves_no_temp_shard_and_a_crash_leftover_is_removed(tmp_path,
                                                                          monkeypatch):
    import ferro_checkpoint.save as save_mod

    spec = spec_for(FULL, 2)
    real = save_mod.write_safetensors

    def dies_midway(path, entries, produce, meta):
        path.write_bytes(b"half a shard")
        raise OSError("disk full")

    monkeypatch.setattr(save_mod, "write_safetensors", dies_midway)
    with pytest.raises(OSError, match="disk full"):
        save_distributed(shards_of(FULL, spec, 0), tmp_path, 0, 2, spec)
    assert list(tmp_path.iterdir()) == []  # no .tmp another rank could take as written
    monkeypatch.setattr(save_mod, "write_safetensors", real)
    (tmp_path / ".rank_1.old.safetensors.part").write_bytes(b"left by a SIGKILL")
    save_all(FULL, tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "metadata.json", "rank_0.safetensors", "rank_1.safetensors"]


@pytest.mark.parametrize("bad", ["{}", "[1]", '["a", 2]', "[]"])
def test_malformed_shard_ids_are_a_metadata_error(tmp_path, bad):
    save_all(FULL, tmp_path, 2)
    meta = metadata(tmp_path)
    meta["shard_ids"] = json.loads(bad)
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    if bad == "[]":  # an empty list is the legacy form: the headers' ids are not checked
        np.testing.assert_array_equal(load_distributed(tmp_path, 0, 1)["w"], FULL["w"])
        return
    with pytest.raises(MetadataError, match="shard_ids"):
        open_checkpoint(tmp_path)


def test_a_save_is_a_span_on_ferro_backends_timeline_when_it_traces(tmp_path, monkeypatch):
    """ferro-checkpoint imports nothing of ferro-backend: it reports its saves to
    ``ferro_backend.timeline`` only when that module is loaded and tracing (a stand-in here)."""
    import contextlib
    import sys
    import types

    spans = []
    fake = types.ModuleType("ferro_backend.timeline")
    fake.active = lambda: True

    @contextlib.contextmanager
    def span(name, cat, **args):
        spans.append((name, cat, args))
        yield

    fake.span = span
    monkeypatch.setitem(sys.modules, "ferro_backend.timeline", fake)
    spec = flat_shard_metadata({"w": np.zeros(4)}, 1)
    save_distributed({"w": np.ones(4)}, tmp_path / "c", 0, 1, spec)
    assert spans == [("checkpoint.save", "checkpoint", {"directory": str(tmp_path / "c")})]
    fake.active = lambda: False
    save_distributed({"w": np.ones(4)}, tmp_path / "d", 0, 1, spec)
    assert len(spans) == 1


def test_a_rank_a_save_ahead_of_its_peer_never_mixes_two_saves(tmp_path):
    """Without a backend, rank 0's next save read the same committed generation while rank 1
    still wrote the previous one, reused its id and overwrote its own uncommitted shard: rank
    1's late shard then committed rank 0's save 2 with its own save 1 ([2, 2, 1, 1]), and no
    later save ever committed. Each checkpointer now numbers its saves."""
    from ferro_checkpoint import AsyncCheckpointer, ShardMetadata, TensorShardSpec

    spec = ShardMetadata(2, {"w": TensorShardSpec((4,), 0, (2, 2))})
    ck = [AsyncCheckpointer(tmp_path, r, 2, spec) for r in range(2)]

    def state(k):
        return {"w": np.full(2, float(k), np.float32)}

    ck[0].save_async(state(1)).wait(30)
    ck[0].save_async(state(2)).wait(30)
    ck[1].save_async(state(1)).wait(30)  # late: rank 0 has moved on (its save 1 is dropped)
    ck[1].save_async(state(2)).wait(30)
    assert load_distributed(tmp_path, 0, 1)["w"].tolist() == [2.0] * 4
    ck[0].save_async(state(3)).wait(30)
    ck[1].save_async(state(3)).wait(30)
    assert load_distributed(tmp_path, 0, 1)["w"].tolist() == [3.0] * 4
    again = AsyncCheckpointer(tmp_path, 0, 1, ShardMetadata(1, {"w": TensorShardSpec((4,), 0,
                                                                                      (4,))}))
    assert again.save_async({"w": np.zeros(4, np.float32)}).wait(30) is None
    assert load_distributed(tmp_path, 0, 1)["w"].tolist() == [0.0] * 4
