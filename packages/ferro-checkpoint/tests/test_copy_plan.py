"""How loads read: zero-copy (``mmap=True``, verified up front or on first lookup), into the
caller's arrays (``out=``), on several threads, new arrays in one allocation; and checkpoints
written by ferro-checkpoint 0.1 (format 1, ``data/format1``) loading and verifying on every path.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _util import save_all, shards_of, spec_for

from ferro_checkpoint import (
    CheckpointManager,
    ChecksumMismatchError,
    InvalidArgumentError,
    LazyTensors,
    TensorError,
    consolidate,
    copy_plan,
    load_distributed,
    read_options,
    reshard,
    safetensors_io,
)

FORMAT1 = Path(__file__).parent / "data" / "format1"  # saved by 0.1: crc32 per tensor
FORMAT1_FULL = {"w": np.arange(40, dtype=np.float32).reshape(10, 4),
                "b": np.arange(6, dtype=np.int64),
                "h": (np.arange(12, dtype=np.float16) / 4).reshape(3, 4)}
FORMAT1_DIMS = {"h": 1}
FULL = {"w": np.arange(96, dtype=np.float32).reshape(24, 4), "b": np.arange(6, dtype=np.int64),
        "h": np.arange(30, dtype=np.float16).reshape(5, 6), "e": np.zeros((0, 3), np.int8)}
MODES = [{}, {"mmap": True}, {"mmap": True, "verify": "lazy"}, {"verify": False},
         {"mmap": True, "verify": False}]


def expect(got, full, world, rank, dims=None):
    for k, want in shards_of(full, spec_for(full, world, dims), rank).items():
        assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
        assert got[k].tobytes() == want.tobytes(), k


@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("world", [1, 2, 3])
def test_format1_checkpoints_load_on_every_path(tmp_path, mode, world):
    d = tmp_path / "ckpt"
    shutil.copytree(FORMAT1, d)
    assert json.loads((d / "metadata.json").read_text())["format_version"] == 1
    for r in range(world):
        expect(load_distributed(d, r, world, **mode), FORMAT1_FULL, world, r, FORMAT1_DIMS)
    consolidate(d, tmp_path / "full.safetensors")


def test_format1_checksums_are_still_verified(tmp_path):
    d = tmp_path / "step_7"
    shutil.copytree(FORMAT1, d)
    path = d / "rank_1.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10  # the last byte of tensor "w"
    path.write_bytes(bytes(data))
    error = r"rank_1.safetensors: tensor 'w' is corrupt \(crc32 [0-9a-f]{8}, expected"
    for kwargs in ({}, {"mmap": True}):
        with pytest.raises(ChecksumMismatchError, match=error):
            load_distributed(d, 1, 2, **kwargs)
        with pytest.raises(ChecksumMismatchError, match=error):
            reshard(d, 2, 1, 0, **kwargs)
    lazy = load_distributed(d, 1, 2, mmap=True, verify="lazy")
    np.testing.assert_array_equal(lazy["b"], FORMAT1_FULL["b"][3:])
    with pytest.raises(ChecksumMismatchError, match=error):
        lazy["w"]
    expect(load_distributed(d, 0, 2), FORMAT1_FULL, 2, 0, FORMAT1_DIMS)  # its own shard is fine
    tensors, extra = CheckpointManager(tmp_path, 0, 2).restore(7)
    assert extra == {"rank": 0, "note": "written by ferro-checkpoint 0.1 (format 1)"}
    with pytest.raises(ChecksumMismatchError, match=error):
        CheckpointManager(tmp_path, 0, 1).restore(7)


def test_mmap_arrays_are_read_only_views_of_the_file(tmp_path):
    save_all(FULL, tmp_path, 2)
    got = load_distributed(tmp_path, 1, 2, mmap=True)
    expect(got, FULL, 2, 1)
    w = got["w"]
    assert not w.flags.writeable and not w.flags.owndata and w.flags.aligned
    with pytest.raises(ValueError, match="read-only"):
        w[0, 0] = 1
    path = tmp_path / "rank_1.safetensors"  # change the file in place: the array shows it
    f = safetensors_io.SafetensorsFile(path)
    pos = f.data_start + f.entries["w"][2]
    del f
    with open(path, "r+b") as fh:
        fh.seek(pos)
        fh.write(np.float32(-7).tobytes())
    assert w[0, 0] == -7
    shutil.rmtree(tmp_path)  # the mapping keeps the file: the arrays stay valid
    assert got["b"].tolist() == FULL["b"][3:].tolist()


def test_lazy_tensors_verify_each_tensor_once_on_lookup(tmp_path, monkeypatch):
    save_all(FULL, tmp_path, 1)
    lazy = load_distributed(tmp_path, 0, 1, mmap=True, verify="lazy")
    assert isinstance(lazy, LazyTensors) and len(lazy) == 4 and sorted(lazy) == sorted(FULL)
    assert "3 not yet verified" in repr(lazy)  # the empty tensor has nothing to check
    calls = []
    real = copy_plan.execute
    monkeypatch.setattr(copy_plan, "execute", lambda jobs, t: (calls.append(jobs), real(jobs, t)))
    for _ in range(2):
        np.testing.assert_array_equal(lazy["w"], FULL["w"])
    assert len(calls) == 1 and "2 not yet verified" in repr(lazy)
    assert {k: v.shape for k, v in lazy.items()} == {k: v.shape for k, v in FULL.items()}


def test_mmap_reshard_maps_what_lies_in_one_file_and_copies_the_rest(tmp_path):
    save_all(FULL, tmp_path, 2, {"h": 1})
    got = reshard(tmp_path, 2, 4, 1, mmap=True)  # w rows 6..11 (rank 0's file), h columns
    expect(got, FULL, 4, 1, {"h": 1})
    assert not got["w"].flags.owndata and got["w"].base is not None
    assert all(not a.flags.writeable for a in got.values())
    whole = reshard(tmp_path, 2, 1, 0, mmap=True)  # w spans both files: a (read-only) copy
    expect(whole, FULL, 1, 0, {"h": 1})
    assert not whole["w"].flags.writeable


def test_loads_into_the_callers_arrays(tmp_path):
    save_all(FULL, tmp_path, 2)
    out = {"w": np.full((12, 4), -1, np.float32), "e": np.zeros((0, 3), np.int8)}
    got = load_distributed(tmp_path, 1, 2, out=out)
    assert got["w"] is out["w"] and got["e"] is out["e"]
    expect(got, FULL, 2, 1)
    out = {"w": np.zeros((6, 4), np.float32)}
    assert reshard(tmp_path, 2, 4, 3, out=out)["w"] is out["w"]
    np.testing.assert_array_equal(out["w"], FULL["w"][18:])
    spec = spec_for(FULL, 1)
    manager = CheckpointManager(tmp_path / "m", 0, 1)
    manager.save(5, FULL, spec)
    out = {"b": np.zeros(6, np.int64)}
    tensors, _ = manager.restore(out=out, threads=2)
    assert tensors["b"] is out["b"] and out["b"].tolist() == FULL["b"].tolist()


@pytest.mark.parametrize("bad, error", [
    ({"w": np.zeros((12, 4), np.float64)}, r"out\['w'\] is float64\(12, 4\)"),
    ({"w": np.zeros((13, 4), np.float32)}, r"out\['w'\] is float32\(13, 4\)"),
    ({"w": np.zeros((4, 12), np.float32).T}, r"C-contiguous False"),
    ({"w": np.zeros((12, 4), np.float32)[::1].view()}, None),
    ({"w": [[0.0] * 4] * 12}, r"out\['w'\] is list"),
    ({"x": np.zeros(3)}, r"out names tensors \['x'\]"),
])
def test_out_arrays_that_do_not_fit_are_refused(tmp_path, bad, error):
    save_all(FULL, tmp_path, 2)
    if error is None:  # a writable C-contiguous view is fine
        load_distributed(tmp_path, 0, 2, out=bad)
        return
    with pytest.raises(TensorError, match=error):
        load_distributed(tmp_path, 0, 2, out=bad)


def test_read_only_out_and_bad_keywords_are_refused(tmp_path):
    save_all(FULL, tmp_path, 1)
    ro = np.zeros((24, 4), np.float32)
    ro.flags.writeable = False
    with pytest.raises(TensorError, match="writable False"):
        load_distributed(tmp_path, 0, 1, out={"w": ro})
    with pytest.raises(InvalidArgumentError, match="not with mmap=True"):
        load_distributed(tmp_path, 0, 1, out={}, mmap=True)
    with pytest.raises(InvalidArgumentError, match="mapping"):
        load_distributed(tmp_path, 0, 1, out=[np.zeros(3)])
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InvalidArgumentError, match="threads"):
            load_distributed(tmp_path, 0, 1, threads=bad)
    with pytest.raises(InvalidArgumentError, match="mmap"):
        reshard(tmp_path, 1, 2, 0, mmap="yes")
    with pytest.raises(InvalidArgumentError, match="threads"):
        CheckpointManager(tmp_path / "m", 0, 1).restore(threads=0)


def test_new_arrays_are_aligned_views_of_one_allocation(tmp_path):
    save_all(FULL, tmp_path, 1)
    got = load_distributed(tmp_path, 0, 1)
    assert all(a.flags.writeable and a.flags.c_contiguous for a in got.values())
    assert all(a.ctypes.data % 64 == 0 for a in got.values() if a.size)
    assert len({id(a.base) for a in got.values() if a.size}) == 1


def test_saves_put_wider_dtypes_first_so_mapped_tensors_are_aligned(tmp_path):
    save_all({"a8": np.zeros(3, np.int8), "b16": np.zeros(3, np.float16),
              "c64": np.zeros(3, np.float64), "d32": np.zeros(3, np.float32)}, tmp_path, 1)
    f = safetensors_io.SafetensorsFile(tmp_path / "rank_0.safetensors")
    order = sorted(f.entries, key=lambda n: f.entries[n][2])
    assert order == ["c64", "d32", "b16", "a8"] and f.data_start % 8 == 0
    assert all(a.flags.aligned for a in load_distributed(tmp_path, 0, 1, mmap=True).values())


@pytest.mark.parametrize("verify", [True, False])
def test_threads_read_in_pieces_the_same_bytes(tmp_path, monkeypatch, verify):
    monkeypatch.setattr(safetensors_io, "CHUNK", 16)
    big = {"w": np.arange(4000, dtype=np.float32).reshape(500, 8),
           "v": np.arange(3000, dtype=np.int16).reshape(30, 100)}
    save_all(big, tmp_path, 3, {"v": 1})
    monkeypatch.setattr(copy_plan, "THREAD_MIN", 0)
    monkeypatch.setattr(copy_plan, "PIECE_MIN", 0)
    for world in (1, 2, 3):
        for r in range(world):
            expect(load_distributed(tmp_path, r, world, threads=3, verify=verify), big, world, r,
                   {"v": 1})


def test_default_threads_share_the_cpus_with_the_local_ranks(monkeypatch):
    monkeypatch.setattr(read_options.os, "sched_getaffinity", lambda pid: set(range(16)),
                        raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert read_options.default_threads() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert read_options.default_threads() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert read_options.default_threads() == read_options.MAX_THREADS
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    assert read_options.default_threads() == read_options.MAX_THREADS


def test_large_new_arrays_share_the_files_offset_modulo_4096(tmp_path):
    """So the kernel's loads never wait on its streamed stores (4K aliasing): a tensor of 1 MiB
    or more starts at its bytes' offset in the mapped file modulo 4096 (small ones at 64)."""
    full = {"a": np.arange(3, dtype=np.float32), "big": np.arange(1 << 18, dtype=np.float32),
            "big2": np.arange(3 << 17, dtype=np.float64)}
    save_all(full, tmp_path, 1)
    got = load_distributed(tmp_path, 0, 1, threads=1)
    mapped = load_distributed(tmp_path, 0, 1, mmap=True)
    for name in ("big", "big2"):
        assert got[name].ctypes.data % 4096 == mapped[name].ctypes.data % 4096
        assert got[name].ctypes.data % got[name].dtype.itemsize == 0
        np.testing.assert_array_equal(got[name], full[name])
    assert got["a"].ctypes.data % 64 == 0
