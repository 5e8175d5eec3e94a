"""CheckpointManager: numbered steps with `extra`, keep_last, async saves, crash leftovers,
restore on another world size."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from _util import shards_of, spec_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ferro_checkpoint
from ferro_checkpoint import (
    AsyncCheckpointError,
    CheckpointManager,
    DistCheckpointError,
    InvalidArgumentError,
    MissingShardError,
    MissingStepError,
    TensorError,
)

FULL = {"w": np.arange(40, dtype=np.float32).reshape(10, 4), "b": np.arange(7, dtype=np.int64)}


def full_at(step):
    return {k: v + step for k, v in FULL.items()}


def save_step(managers, step, full, extra=None, **kwargs):
    """Every rank's manager saves its shard of ``full`` in turn (no backend)."""
    world = len(managers)
    spec = spec_for(full, world)
    return [m.save(step, shards_of(full, spec, m.rank), spec,
                   extra=extra(m.rank) if callable(extra) else extra, **kwargs)
            for m in managers]


def restored_full(root, world, step=None):
    """Restore on every rank of ``world`` and concatenate along dim 0."""
    parts = [CheckpointManager(root, r, world).restore(step) for r in range(world)]
    return ({k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]},
            [p[1] for p in parts])


def test_exported():
    assert "CheckpointManager" in ferro_checkpoint.__all__
    assert "MissingStepError" in ferro_checkpoint.__all__
    assert issubclass(MissingStepError, MissingShardError)


def test_round_trip_with_extra_and_rng_state(tmp_path):
    rng = np.random.default_rng(1234)
    rng.random(5)
    extra = {"rng": rng.bit_generator.state, "data_position": 4096, "lr": 3e-4}
    m = CheckpointManager(tmp_path, 0, 1)
    assert m.latest_step() is None and m.steps() == []
    fut = m.save(100, FULL, spec_for(FULL, 1), extra=extra)
    assert fut.is_done() and fut.checkpoint_id == "step100"
    tensors, got = m.restore()
    assert got == json.loads(json.dumps(extra))
    for k, v in FULL.items():
        assert tensors[k].dtype == v.dtype and np.array_equal(tensors[k], v)
    again = np.random.default_rng()
    again.bit_generator.state = got["rng"]
    assert np.array_equal(again.random(3), rng.random(3))
    assert CheckpointManager(tmp_path, 0, 1).restore(100)[1] == got  # a new process, same data
    assert m.save(101, FULL, spec_for(FULL, 1)).checkpoint_id == "step101"
    assert m.restore(101)[1] == {}  # extra=None restores as {}


def test_a_flipped_bit_in_extra_is_a_checksum_error(tmp_path):
    # the tensors' CRCs do not cover the header: restore() returned {"data_position": 323456}
    m = CheckpointManager(tmp_path, 0, 1)
    m.save(1, full_at(1), spec_for(FULL, 1), extra={"data_position": 123456})
    shard = tmp_path / "step_1" / "rank_0.safetensors"
    raw = shard.read_bytes()
    assert raw.count(b"123456") == 1
    shard.write_bytes(raw.replace(b"123456", b"323456"))
    with pytest.raises(ferro_checkpoint.ChecksumMismatchError, match="extra"):
        m.restore(1)


def test_per_rank_extra(tmp_path):
    managers = [CheckpointManager(tmp_path, r, 2) for r in range(2)]
    save_step(managers, 5, FULL, extra=lambda r: {"rank": r})
    assert [m.restore()[1] for m in managers] == [{"rank": 0}, {"rank": 1}]
    full, extras = restored_full(tmp_path, 3)  # another world: rank 0's extra everywhere
    assert extras == [{"rank": 0}] * 3
    assert np.array_equal(full["w"], FULL["w"])


def test_keep_last_prunes_oldest(tmp_path):
    m = CheckpointManager(tmp_path, 0, 1, keep_last=2)
    for step in range(1, 6):
        m.save(step, full_at(step), spec_for(FULL, 1), extra={"step": step})
        assert m.steps() == list(range(max(1, step - 1), step + 1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_5"]
    tensors, extra = m.restore(4)
    assert extra == {"step": 4} and np.array_equal(tensors["b"], full_at(4)["b"])
    with pytest.raises(MissingStepError, match=r"step 2 is not a committed step.*\[4, 5\]"):
        m.restore(2)


def test_keep_last_with_several_ranks_lags_at_most_one_save(tmp_path):
    managers = [CheckpointManager(tmp_path, r, 3, keep_last=2) for r in range(3)]
    for step in range(1, 7):
        save_step(managers, step, full_at(step))
        steps = managers[1].steps()
        assert steps[-2:] == [step - 1, step][-min(step, 2):] and len(steps) <= 3
    assert managers[0].steps() == [4, 5, 6]
    save_step(managers, 7, full_at(7))
    assert managers[2].steps() == [5, 6, 7]
    assert np.array_equal(restored_full(tmp_path, 1)[0]["w"], full_at(7)["w"])


def test_a_step_below_the_newest_committed_one_is_refused(tmp_path):
    # it was saved and pruned at once (one rank), or its directory deleted under the other
    # ranks' saves (several): every save of a rollback was lost without a word
    m = CheckpointManager(tmp_path, 0, 1, keep_last=1)
    m.save(300, full_at(300), spec_for(FULL, 1))
    with pytest.raises(InvalidArgumentError, match="step 210 is below the newest committed "
                                                   "step 300"):
        m.save(210, full_at(210), spec_for(FULL, 1))
    m.save(300, full_at(301), spec_for(FULL, 1))  # re-saving the newest: replaced
    assert m.steps() == [300]
    assert np.array_equal(m.restore()[0]["b"], full_at(301)["b"])


def test_a_manager_built_to_restore_leaves_another_jobs_save_in_flight(tmp_path):
    # a one-rank restorer removed the shard a two-rank job had written of a step its other
    # rank had not yet: that step never committed
    trainers = [CheckpointManager(tmp_path, r, 2) for r in range(2)]
    save_step(trainers, 1, full_at(1))
    spec = spec_for(full_at(2), 2)
    trainers[0].save(2, shards_of(full_at(2), spec, 0), spec)
    tensors, _ = CheckpointManager(tmp_path, 0, 1).restore()
    assert np.array_equal(tensors["b"], full_at(1)["b"])
    trainers[1].save(2, shards_of(full_at(2), spec, 1), spec)
    assert trainers[0].steps() == [1, 2]


def test_an_async_save_in_flight_at_exit_is_finished(tmp_path):
    # the writer was a daemon thread killed at exit: the last step silently missing
    script = textwrap.dedent(f"""
        import time
        import numpy as np
        import ferro_checkpoint.save as save_mod
        from ferro_checkpoint import CheckpointManager, ShardMetadata, TensorShardSpec
        slow = save_mod.write_safetensors
        def write(*args, **kwargs):
            time.sleep(1.0)
            return slow(*args, **kwargs)
        save_mod.write_safetensors = write
        spec = ShardMetadata(1, {{"w": TensorShardSpec((3,), 0, (3,))}})
        m = CheckpointManager({str(tmp_path)!r}, 0, 1)
        m.save(1, {{"w": np.ones(3)}}, spec, blocking=False)
        print("exiting", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "exiting" in done.stdout, done.stderr
    assert CheckpointManager(tmp_path, 0, 1).steps() == [1]


def test_steps_ascending_and_latest(tmp_path):
    m = CheckpointManager(tmp_path, 0, 1, keep_last=10)
    assert m.latest_step() is None
    for step in (10, 2, 7, 0):
        m.save(step, full_at(step), spec_for(FULL, 1))
    (tmp_path / "step_x").mkdir()  # not a step
    (tmp_path / "step_007").mkdir()  # not canonical: ignored
    (tmp_path / "notes.txt").write_text("ignored")
    assert m.steps() == [0, 2, 7, 10] and m.latest_step() == 10


def test_bad_arguments_are_typed(tmp_path):
    spec = spec_for(FULL, 1)
    for kwargs, match in [({"keep_last": 0}, "keep_last 0"), ({"keep_last": True}, "keep_last"),
                          ({"keep_last": 2.0}, "keep_last")]:
        with pytest.raises(InvalidArgumentError, match=match):
            CheckpointManager(tmp_path, 0, 1, **kwargs)
    with pytest.raises(InvalidArgumentError, match="rank 2"):
        CheckpointManager(tmp_path, 2, 2)
    m = CheckpointManager(tmp_path, 0, 1)
    for step in (-1, True, 1.5, "3"):
        with pytest.raises(InvalidArgumentError, match="step"):
            m.save(step, FULL, spec)
    with pytest.raises(InvalidArgumentError, match="step -2"):
        m.restore(-2)
    with pytest.raises(InvalidArgumentError, match="not JSON-serializable"):
        m.save(1, FULL, spec, extra={"a": object()})
    with pytest.raises(InvalidArgumentError, match="extra must be a dict"):
        m.save(1, FULL, spec, extra=[1, 2])
    with pytest.raises(InvalidArgumentError, match="num_ranks 2 != world_size 1"):
        m.save(1, FULL, spec_for(FULL, 2))
    with pytest.raises(TensorError, match="lacks"):
        m.save(1, {"w": FULL["w"]}, spec, blocking=False)  # checked before going async
    with pytest.raises(MissingStepError, match="no committed step"):
        m.restore()
    with pytest.raises(MissingStepError, match="step 3"):
        m.restore(3)
    assert m.steps() == [] and not any(tmp_path.iterdir())
    assert issubclass(MissingStepError, DistCheckpointError)


def test_async_save_then_restore_sees_a_snapshot(tmp_path):
    m = CheckpointManager(tmp_path, 0, 1)
    state = {k: v.copy() for k, v in FULL.items()}
    extra = {"pos": [1, 2]}
    fut = m.save(3, state, spec_for(FULL, 1), extra=extra, blocking=False)
    state["w"][:] = -1  # training goes on: the save holds a copy
    extra["pos"].append(3)
    fut.wait(30)
    assert fut.checkpoint_id == "step3"
    tensors, got = m.restore()
    assert got == {"pos": [1, 2]} and np.array_equal(tensors["w"], FULL["w"])


def test_back_to_back_async_saves_never_overlap(tmp_path, monkeypatch):
    import ferro_checkpoint.manager as mod

    real = mod.save_distributed
    gate = threading.Event()
    active, most = [0], [0]
    lock = threading.Lock()

    def slow(*args, **kwargs):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            gate.wait(10)
            return real(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(mod, "save_distributed", slow)
    m = CheckpointManager(tmp_path, 0, 1)
    spec = spec_for(FULL, 1)
    first = m.save(1, full_at(1), spec, blocking=False)
    m.wait_timeout_s = 0.2
    with pytest.raises(AsyncCheckpointError, match="not done after 0.2s"):
        m.save(2, full_at(2), spec, blocking=False)  # bounded wait; nothing started
    m.wait_timeout_s = 30
    futures = []
    second = threading.Thread(
        target=lambda: futures.append(m.save(2, full_at(2), spec, blocking=False)))
    second.start()
    time.sleep(0.3)
    assert second.is_alive() and not first.is_done()  # the second save waits for the first
    gate.set()
    second.join(30)
    assert not second.is_alive()
    futures[0].wait(30)
    first.wait(30)
    assert most[0] == 1 and m.steps() == [1, 2]
    assert np.array_equal(m.restore()[0]["b"], full_at(2)["b"])


def test_failed_async_save_is_raised_by_the_next_call(tmp_path, monkeypatch):
    import ferro_checkpoint.manager as mod

    def broken(*args, **kwargs):
        raise OSError("disk full")

    m = CheckpointManager(tmp_path, 0, 1)
    monkeypatch.setattr(mod, "save_distributed", broken)
    fut = m.save(1, FULL, spec_for(FULL, 1), blocking=False)
    deadline = time.monotonic() + 10
    while not fut.is_done() and time.monotonic() < deadline:
        time.sleep(0.01)
    monkeypatch.undo()
    with pytest.raises(AsyncCheckpointError, match="disk full"):
        m.restore()
    m.save(2, FULL, spec_for(FULL, 1))  # reported once; the manager goes on
    assert m.steps() == [2]


def test_half_written_step_is_not_listed_and_removed_by_next_save(tmp_path):
    m = CheckpointManager(tmp_path, 0, 1)
    m.save(1, full_at(1), spec_for(FULL, 1), extra={"step": 1})
    half = tmp_path / "step_2"
    half.mkdir()
    (half / "rank_0.safetensors").write_bytes(b"partial")
    (half / ".rank_0.step2.safetensors.tmp").write_bytes(b"partial")
    assert m.steps() == [1] and m.latest_step() == 1
    assert m.restore()[1] == {"step": 1}
    with pytest.raises(MissingStepError, match="step 2"):
        m.restore(2)
    m.save(3, full_at(3), spec_for(FULL, 1))
    assert not half.exists() and m.steps() == [1, 3]
    half.mkdir()  # a crashed save of the very step saved next (one rank: deleted first)
    (half / "rank_0.safetensors").write_bytes(b"partial")
    m.save(2, full_at(2), spec_for(FULL, 1))
    assert m.steps() == [1, 2, 3] and sorted(p.name for p in half.iterdir()) == [
        "metadata.json", "rank_0.safetensors"]


def test_half_written_step_of_several_ranks(tmp_path):
    managers = [CheckpointManager(tmp_path, r, 2) for r in range(2)]
    save_step(managers, 1, full_at(1))
    spec = spec_for(FULL, 2)
    managers[0].save(2, shards_of(full_at(2), spec, 0), spec)  # rank 1 "crashed"
    assert managers[1].steps() == [1]
    # restart: new managers remove their own rank's temp shards of the crashed save
    managers = [CheckpointManager(tmp_path, r, 2) for r in range(2)]
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "step_2").iterdir())
    save_step(managers, 3, full_at(3))
    save_step(managers, 4, full_at(4))  # rank 0 prunes below the newest committed step (3)
    assert not (tmp_path / "step_2").exists() and managers[0].steps() == [1, 3, 4]


def test_new_manager_finishes_a_step_committed_before_a_crash(tmp_path):
    """A crash right after the commit record: temp shard and record not yet renamed. A new
    manager (which removes its rank's temp shards) must finish that step, not break it."""
    from ferro_checkpoint.layout import commit_path, tmp_shard_path

    m = CheckpointManager(tmp_path, 0, 1)
    m.save(1, full_at(1), spec_for(FULL, 1), extra={"step": 1})
    step = tmp_path / "step_1"
    step.joinpath("rank_0.safetensors").rename(tmp_shard_path(step, 0, "step1"))
    step.joinpath("metadata.json").rename(commit_path(step, "step1"))
    stale = tmp_shard_path(step, 0, "crashed")
    stale.write_bytes(b"an uncommitted save's shard")
    m = CheckpointManager(tmp_path, 0, 1)
    assert not stale.exists() and m.steps() == [1]
    tensors, extra = m.restore()
    assert extra == {"step": 1} and np.array_equal(tensors["w"], full_at(1)["w"])


SAVER = textwrap.dedent("""
    import sys
    import numpy as np
    from ferro_checkpoint import CheckpointManager, ShardMetadata, TensorShardSpec

    root, start = sys.argv[1], int(sys.argv[2])
    spec = ShardMetadata(1, {"w": TensorShardSpec((512, 257), 0, (512,))})
    m = CheckpointManager(root, 0, 1, keep_last=2)
    print("READY", flush=True)
    step = start
    while True:
        m.save(step, {"w": np.full((512, 257), step, np.float64)}, spec,
               extra={"step": step}, blocking=step % 2 == 0)
        step += 1
""")


@pytest.mark.timeout(120)
def test_sigkill_mid_save_leaves_only_committed_steps(tmp_path):
    start = 1
    for delay in (0.05, 0.15, 0.3, 0.1, 0.2, 0.02, 0.25, 0.12, 0.07, 0.18):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path), str(start)],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "READY"
            time.sleep(delay)
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        m = CheckpointManager(tmp_path, 0, 1, keep_last=2)
        for step in m.steps():
            tensors, extra = m.restore(step)
            assert extra == {"step": step}
            assert np.array_equal(tensors["w"], np.full((512, 257), step, np.float64))
        start = (m.latest_step() or 0) + 1
    m.save(start, {"w": np.full((512, 257), start, np.float64)},
           spec_for({"w": np.zeros((512, 257))}, 1), extra={"step": start})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"step_{s}" for s in sorted(m.steps(), key=str)]  # no half steps left
    assert m.steps()[-1] == start and len(m.steps()) <= 2


@pytest.mark.parametrize("new_world", [1, 2, 3, 4, 5])
def test_restore_on_another_world_size(tmp_path, new_world):
    managers = [CheckpointManager(tmp_path, r, 4) for r in range(4)]
    save_step(managers, 9, FULL, extra=lambda r: {"saved_by": r})
    full, extras = restored_full(tmp_path, new_world)
    for k, v in FULL.items():
        assert full[k].dtype == v.dtype and np.array_equal(full[k], v)
    want = [{"saved_by": r} for r in range(4)] if new_world == 4 else [{"saved_by": 0}] * new_world
    assert extras == want


@st.composite
def sharded(draw):
    n = draw(st.integers(1, 3))
    full = {}
    for i in range(n):
        dt = draw(st.sampled_from([np.float32, np.float64, np.int32, np.uint8, np.bool_]))
        shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=7))
        full[f"t{i}"] = draw(hnp.arrays(dt, shape))
    return full


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(full=sharded(), n=st.integers(1, 5), m=st.integers(1, 5), step=st.integers(0, 10**6))
def test_save_n_restore_m(tmp_path_factory, full, n, m, step):
    root = tmp_path_factory.mktemp("mgr")
    save_step([CheckpointManager(root, r, n) for r in range(n)], step, full,
              extra=lambda r: {"r": r})
    new_spec = spec_for(full, m)
    for r in range(m):
        tensors, extra = CheckpointManager(root, r, m).restore()
        assert extra == {"r": r if m == n else 0}
        want = shards_of(full, new_spec, r)
        for k in full:
            assert tensors[k].dtype == full[k].dtype and tensors[k].shape == want[k].shape
            assert tensors[k].tobytes() == want[k].tobytes()


def test_collective_manager_with_a_backend(tmp_path):
    pytest.importorskip("ferro_backend")
    from ferro_backend.testing import run_ranks

    spec = spec_for(FULL, 2)

    def fn(b):
        m = CheckpointManager(tmp_path, b.rank, 2, keep_last=2, backend=b)
        for step in range(1, 5):
            fut = m.save(step, shards_of(full_at(step), spec, b.rank), spec,
                         extra={"rank": b.rank, "step": step}, blocking=step % 2 == 1)
        fut.wait(20)
        b.barrier(timeout=10)
        return m.steps(), m.restore()[1]

    results = run_ranks(fn, 2, timeout=60)
    assert [r[1] for r in results] == [{"rank": 0, "step": 4}, {"rank": 1, "step": 4}]
    assert all(r[0][-1] == 4 and set(r[0]) <= {2, 3, 4} for r in results)
    full, _ = restored_full(tmp_path, 3)
    assert np.array_equal(full["w"], full_at(4)["w"])


def test_readme_example_runs(tmp_path, monkeypatch):
    import pathlib
    import re
    import tempfile

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("## Checkpoint manager"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # mkdtemp() lands in tmp_path
    exec(compile(code, "README.md", "exec"), {})
    assert [p.name for p in tmp_path.iterdir()]
