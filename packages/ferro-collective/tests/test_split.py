"""The engine's pipelined steps: the split allreduce and reduce_scatter
(ferro_backend/engine/_split.h: every rank folds one part, in chunks) and the streamed
all_gather (_stream.h: blocks beyond a slot through a ring of chunks). Real processes on the
same-host engine: the star algorithm's bits for drawn world sizes, dtypes, ops and item counts
(parts and chunks of unequal sizes), whichever path each rank takes, and a late peer's call
resumed after the stall report."""

import os
from unittest import mock

import pytest
import split_fns
from hypothesis import given, settings
from hypothesis import strategies as st

from ferro_backend.testing import run_processes

pytestmark = pytest.mark.timeout(180)

_KINDS = {"float32": ["SUM", "MEAN", "MAX", "MIN", "PRODUCT"],
          "float64": ["SUM", "MEAN", "MIN"],
          "int32": ["SUM", "MAX", "BXOR"],
          "uint8": ["SUM", "BOR"],
          "int64": ["PRODUCT", "BAND"]}


@st.composite
def _cases(draw):
    cases = []
    for _ in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(sorted(_KINDS)))
        # from a few items per rank to several chunks per part (a slot of 64 KiB holds 8192
        # float64s); odd counts split into parts of unequal size
        count = draw(st.one_of(st.integers(5, 64), st.integers(1000, 8000)))
        cases.append((dtype, count, draw(st.sampled_from(_KINDS[dtype]))))
    return cases


@settings(max_examples=4, deadline=None, derandomize=True)
@given(world=st.integers(2, 5), cases=_cases())
def test_split_allreduce_equals_star_for_drawn_worlds_dtypes_ops_and_counts(world, cases):
    # split from 16 bytes on, in 64 KiB slots: the smallest calls split too, and a part has
    # up to 8 chunks (4 KiB each)
    env = {"FERRO_SHM_SPLIT_BYTES": "16", "FERRO_SHM_SLOT_BYTES": "65536"}
    with mock.patch.dict(os.environ, env):  # the ranks take the caller's environment
        results = run_processes(split_fns.equals_star, world, cases, transport="shm",
                                timeout=150)
    assert results == [[]] * world


@pytest.mark.parametrize("count", [100_000, 600_000])  # within a slot; beyond (rings)
def test_a_split_allreduce_waits_past_the_stall_report_for_a_late_peer(count, tmp_path):
    # rank 1 calls once rank 0 has logged its stall report (a file; [True] per report seen)
    assert run_processes(split_fns.late_in_split, 2, count, str(tmp_path), transport="shm",
                         timeout=90) == [[True, True], [True] * 4]


@pytest.mark.parametrize("world", [2, 3])
def test_streamed_all_gather_equals_star(world):
    # 4 KiB slots: 1 KiB chunks in a ring of 8, blocks of up to 120 KB wrap it many times;
    # odd sizes end in a short chunk
    with mock.patch.dict(os.environ, {"FERRO_SHM_SLOT_BYTES": "4096"}):
        results = run_processes(split_fns.gathers_equal_star, world, [2049, 7777, 60_001],
                                transport="shm", timeout=150)
    assert results == [[]] * world


def test_a_streamed_all_gather_waits_past_the_stall_report_for_a_late_peer(tmp_path):
    # rank 1 calls once rank 0 has logged its stall report (a file; its first True)
    assert run_processes(split_fns.late_in_stream, 2, 1_000_000, str(tmp_path),
                         transport="shm", timeout=90) == [[True], [True, True]]


@pytest.mark.parametrize("world", [2, 3])
def test_a_streamed_all_gather_then_a_one_step_call_keeps_every_chunk(world):
    # a one-step call writes its slot before it waits for anyone: the streamed call must not
    # end on a rank before its peers have read the chunks in that slot
    with mock.patch.dict(os.environ, {"FERRO_SHM_SLOT_BYTES": "4096"}):
        results = run_processes(split_fns.stream_then_one_step, world, 300, transport="shm",
                                timeout=150)
    assert results == [[]] * world


@settings(max_examples=4, deadline=None, derandomize=True)
@given(world=st.integers(2, 5), cases=_cases())
def test_split_beyond_a_slot_equals_star_for_drawn_worlds_dtypes_ops_and_counts(world, cases):
    # 4 KiB slots: every drawn allreduce of 1000-8000 items is beyond a slot, so its input
    # sub-rings (a few hundred bytes per rank) and result ring wrap many times; the small
    # counts stay within a slot (the one-call split)
    env = {"FERRO_SHM_SPLIT_BYTES": "16", "FERRO_SHM_SLOT_BYTES": "4096"}
    with mock.patch.dict(os.environ, env):
        results = run_processes(split_fns.equals_star, world, cases, transport="shm",
                                timeout=150)
    assert results == [[]] * world


@settings(max_examples=4, deadline=None, derandomize=True)
@given(world=st.integers(2, 5), cases=_cases())
def test_split_reduce_scatter_beyond_a_slot_equals_star(world, cases):
    import numpy as np

    # items per rank: world * items beyond a 4 KiB slot
    cases = [(dtype, max(count, 4096 // (world * np.dtype(dtype).itemsize) + 1), op)
             for dtype, count, op in cases]
    with mock.patch.dict(os.environ, {"FERRO_SHM_SLOT_BYTES": "4096"}):
        results = run_processes(split_fns.scatters_equal_star, world, cases, transport="shm",
                                timeout=150)
    assert results == [[]] * world


@pytest.mark.parametrize("world", [2, 3])
def test_a_reduce_scatter_from_256_kib_within_a_slot_runs_split(world):
    # the default 1 MiB slots: 256 KiB - 1 MiB inputs, a part's last chunk short
    # across dtypes; each rank writes only the others' parts into its slot (3 ranks on 2
    # cores: from 4 x 170 KiB, the oversubscribed split threshold, the last two cases)
    cases = [("float32", 65_536 // world + 7, "SUM"), ("float64", 60_000 // world, "MEAN"),
             ("int32", 200_000 // world, "MAX"), ("uint8", 700_000 // world, "BOR")]
    results = run_processes(split_fns.scatters_equal_star, world, cases, True, transport="shm",
                            timeout=150)
    assert results == [[]] * world


@pytest.mark.parametrize("small_bytes,slow_factor", [(0, 0.0), (1 << 30, 12.0), (0, 1e9)])
def test_every_way_into_the_segment_gives_the_bits_of_the_star(small_bytes, slow_factor):
    # streaming stores for every call, for the large ones only while plain copies are slow
    # (factor 0: always, with a plain re-try every 64 calls), or plain stores only (factor 1e9)
    cases = [("float32", 70_000, "SUM"), ("float64", 9_000, "MEAN"), ("int32", 300_000, "MAX")]
    results = run_processes(split_fns.equals_star_streaming, 2, cases, small_bytes, slow_factor,
                            transport="shm", timeout=120)
    assert results == [[], []]


@pytest.mark.parametrize("world", [2, 3])
def test_a_broadcast_over_half_a_slot_up_to_8_mib_moves_in_half_slots(world):
    # the default 1 MiB slots: at and under half a slot one step; over it, up to 8 MiB, steps
    # of at most half a slot (600,000 bytes: two of 300,000; 3 MiB + 8 float64s: 7 steps, the
    # last short); beyond 8 MiB, whole slots
    cases = [("float32", 131_072, 0), ("uint8", 600_000, world - 1), ("float32", 262_144, 1),
             ("float64", 393_224, 0), ("int16", 4 << 20, 1), ("uint8", 9 << 20, 0)]
    results = run_processes(split_fns.broadcasts_in_half_slots, world, cases, transport="shm",
                            timeout=150)
    assert results == [[]] * world
