"""SIGKILL a saving process at random moments: the last committed checkpoint always loads
exactly (or, when a commit landed just before the kill, the one after it)."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from ferro_checkpoint import MetadataError, load_distributed, save_distributed

SAVER = textwrap.dedent("""
    import sys
    import numpy as np
    from ferro_checkpoint import ShardMetadata, TensorShardSpec, save_distributed

    directory, start = sys.argv[1], int(sys.argv[2])
    W = 2
    spec = ShardMetadata(W, {"w": TensorShardSpec((256, 129), 0, (128, 128)),
                             "b": TensorShardSpec((1000,), 0, (500, 500)),
                             "i": TensorShardSpec((64, 8), 1, (4, 4))})

    def data(gen, rank):
        return {"w": np.full((128, 129), gen + 0.5 * rank, np.float32),
                "b": np.arange(500, dtype=np.float64) + gen * 1000 + rank,
                "i": np.full((64, 4), gen, np.int64)}

    print("READY", flush=True)
    gen = start
    while True:
        # both ranks of a 2-rank save, one after the other; a unique id per save (the
        # generation) is what ranks without a backend share; the last rank commits
        for r in range(W):
            save_distributed(data(gen, r), directory, r, W, spec, checkpoint_id=f"gen{gen}")
        print(f"COMMITTED {gen}", flush=True)
        gen += 1
""")


def expected(gen):
    return {"w": np.concatenate([np.full((128, 129), gen + 0.5 * r, np.float32) for r in (0, 1)]),
            "b": np.concatenate([np.arange(500.0) + gen * 1000 + r for r in (0, 1)]),
            "i": np.full((64, 8), gen, np.int64)}


def committed_generation(directory):
    try:
        got = load_distributed(directory, 0, 1)
    except MetadataError:
        return None
    gen = int(got["i"][0, 0])
    for k, v in expected(gen).items():
        assert got[k].tobytes() == v.tobytes(), f"generation {gen}: tensor {k} not exact"
    return gen


#: saver processes killed at random instants (FERRO_CRASH_KILLS=100 for a longer hunt)
KILLS = int(os.environ.get("FERRO_CRASH_KILLS", "12"))


@pytest.mark.timeout(240)
def test_sigkill_at_random_moments(tmp_path):
    rng = random.Random(1234)
    directory = tmp_path / "ckpt"
    last = None  # last generation known committed
    start = 1
    kills = 0
    for _ in range(KILLS):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(directory), str(start)],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "READY"
            time.sleep(rng.uniform(0.0, 0.25))
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        printed = [int(line.split()[1]) for line in out.splitlines() if line.startswith("COMM")]
        if printed:
            last = printed[-1]
        gen = committed_generation(directory)
        if last is None:
            assert gen in (None, start)
        else:
            # the kill may land after a commit but before its print
            assert gen in (last, last + 1), (gen, last)
        if gen is not None:
            last = gen
        start = (last or 0) + 1
    assert kills == KILLS
    assert last is not None and last >= 2  # saves really happened between kills


def test_open_recovers_a_save_committed_before_a_crash(tmp_path):
    """The state a crash right after the commit point leaves (temp shards and the commit
    record not yet renamed): opening finishes it, and touches nothing uncommitted."""
    from _util import save_all

    from ferro_checkpoint.layout import commit_path, recover, shard_path, tmp_shard_path

    old = {"w": np.arange(12.0)}
    save_all(old, tmp_path, 3, checkpoint_id="old")
    new = {"w": np.arange(12.0) * 10}
    staging = tmp_path / "staging"
    save_all(new, staging, 2, checkpoint_id="new")
    for r in range(2):
        (staging / f"rank_{r}.safetensors").rename(tmp_shard_path(tmp_path, r, "new"))
    (staging / "metadata.json").rename(commit_path(tmp_path, "new"))
    staging.rmdir()
    uncommitted = tmp_shard_path(tmp_path, 0, "other")
    uncommitted.write_bytes(b"an uncommitted save's shard")
    np.testing.assert_array_equal(load_distributed(tmp_path, 0, 1)["w"], new["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [uncommitted.name, "metadata.json", shard_path(tmp_path, 0).name,
         shard_path(tmp_path, 1).name])  # rank_2 of the old 3-rank world is deleted
    recover(tmp_path)  # idempotent: nothing left to do
    assert uncommitted.read_bytes() == b"an uncommitted save's shard"


@pytest.mark.parametrize("next_id", [None, "step6"])
def test_a_save_after_a_crash_past_the_commit_point_keeps_the_committed_save(tmp_path,
                                                                                 next_id):
    """A save committed but not rolled forward (a crash after its commit record), then a rank
    saving again before any open: with default ids the new save took the committed one's id
    and committed rank 0's new shard with rank 1's old one (it loaded, mixed); with its own id
    the committed save's temp shard was deleted as stale (no load worked)."""
    from _util import save_all, shards_of, spec_for

    from ferro_checkpoint import save as save_mod

    save_all({"w": np.full(4, 1.0)}, tmp_path, 2)  # g1
    real = save_mod.recover
    save_mod.recover = lambda d: None  # the crash: the commit record written, nothing renamed
    try:
        save_all({"w": np.full(4, 2.0)}, tmp_path, 2)  # g2, committed
    finally:
        save_mod.recover = real
    assert any(p.name.startswith(".commit.") for p in tmp_path.iterdir())
    spec = spec_for({"w": np.zeros(4)}, 2)
    save_distributed(shards_of({"w": np.full(4, 3.0)}, spec, 0), tmp_path, 0, 2, spec,
                     checkpoint_id=next_id)  # rank 0 alone: not committed
    got = np.concatenate([load_distributed(tmp_path, r, 2)["w"] for r in range(2)])
    np.testing.assert_array_equal(got, np.full(4, 2.0))


def test_a_stray_commit_record_is_not_rolled_forward_over_a_good_checkpoint(tmp_path):
    """A commit record whose shards are not here (copied in, or another save's leftover) was
    renamed over a good metadata.json by the next open: no load worked after it."""
    from _util import save_all

    save_all({"w": np.arange(4.0)}, tmp_path, 2)
    good = (tmp_path / "metadata.json").read_text()
    (tmp_path / ".commit.zz.json").write_text(good.replace('"g1"', '"zz"'))
    for _ in range(2):
        got = np.concatenate([load_distributed(tmp_path, r, 2)["w"] for r in range(2)])
        np.testing.assert_array_equal(got, np.arange(4.0))
    assert (tmp_path / "metadata.json").read_text() == good
