"""The scratch pool: the point-to-point algorithms reuse their working arrays from call to call,
keep no more than FERRO_SCRATCH_BYTES, and keep nothing a failed call may still write."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ferro_collective as fc
from ferro_backend import CollectiveTimeoutError, SimulatedBackend
from ferro_backend import settings as fsettings
from ferro_backend.testing import run_ranks
from ferro_collective.scratch import POOL, SMALLEST, ScratchPool


def test_a_given_array_is_the_next_take_of_its_size_and_dtype():
    pool = ScratchPool(1 << 20, smallest=0)
    a = pool.take(1000, np.float32)
    assert a.shape == (1000,) and a.dtype == np.float32
    pool.give(a)
    assert pool.held_bytes() == 4000
    assert pool.take(1000, np.float64) is not a  # another dtype: a new array
    assert pool.take(999, np.float32) is not a
    assert pool.take(1000, np.float32) is a
    assert pool.held_bytes() == 0
    assert pool.take(1000, np.float32) is not a  # handed out: not twice


def test_the_pool_keeps_at_most_its_bytes_the_longest_kept_going_first():
    pool = ScratchPool(10_000, smallest=0)
    first, second, third = (pool.take(1000, np.float32) for _ in range(3))
    pool.give(first)
    pool.give(second)
    pool.give(third)  # 12 000 bytes: the first given goes
    assert pool.held_bytes() == 8000
    got = {id(pool.take(1000, np.float32)) for _ in range(2)}
    assert got == {id(second), id(third)}
    pool.give(np.empty(20_000, np.uint8))  # larger than the pool: not kept
    assert pool.held_bytes() == 0
    assert ScratchPool(0, smallest=0).take(8, np.int64) is not None


def test_small_arrays_are_allocated_fresh_and_never_kept():
    """Under the pool's smallest (64 KiB by default) an array comes from the allocator's heap,
    cheaper than the pool's bookkeeping: taken fresh, given back to nobody."""
    pool = ScratchPool(1 << 30)
    small = pool.take(SMALLEST // 4 - 1, np.float32)
    pool.give(small)
    assert pool.held_bytes() == 0 and pool.take(SMALLEST // 4 - 1, np.float32) is not small
    large = pool.take(SMALLEST, np.uint8)
    pool.give(large, None)
    assert pool.held_bytes() == SMALLEST and pool.take(SMALLEST, np.uint8) is large


def test_the_default_bytes_come_from_the_setting():
    with fsettings.override(SCRATCH_BYTES=1024):
        pool = ScratchPool(smallest=0)
        pool.give(np.empty(2048, np.uint8))
        assert pool.held_bytes() == 0
        pool.give(np.empty(1024, np.uint8))
        assert pool.held_bytes() == 1024


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 4096), st.lists(st.tuples(st.booleans(), st.integers(1, 64),
                                                st.sampled_from(["f4", "f8", "i2", "u1"])),
                                      max_size=40))
def test_any_sequence_of_takes_and_gives_keeps_the_pool_within_its_bytes(keep, ops):
    pool = ScratchPool(keep, smallest=64)
    out: list[np.ndarray] = []
    for is_take, count, dtype in ops:
        if is_take or not out:
            arr = pool.take(count, dtype)
            assert arr.shape == (count,) and arr.dtype == np.dtype(dtype)
            assert all(arr is not o for o in out)  # never handed out twice
            out.append(arr)
        else:
            pool.give(out.pop(count % len(out)))
        assert 0 <= pool.held_bytes() <= keep


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["recursive_doubling", "star", "ring"])
def test_a_collective_reuses_its_working_arrays_and_gives_the_same_bits(algorithm):
    n = 60000 + ord(algorithm[0])  # a size no other test uses; the ring's thirds over 64 KiB

    def step(b):
        x = np.arange(n, dtype=np.float32) * (b.rank + 1) / 7
        return fc.allreduce(x, b, algorithm=algorithm)

    POOL.clear()
    first = run_ranks(step, 3)
    kept = POOL.held_bytes()
    assert kept > 0
    again = run_ranks(step, 3)
    assert POOL.held_bytes() == kept  # the same arrays, taken and given back
    for a, b in zip(first + again, first[:1] * 6):
        np.testing.assert_array_equal(a, b)


@pytest.mark.timeout(30)
def test_a_failed_call_gives_nothing_back():
    POOL.clear()
    rank0, _silent = SimulatedBackend.create_group(2, timeout=0.3)
    t0 = time.monotonic()
    fc.set_mismatch_check(False)  # no header exchange: the call borrows, then waits in vain
    try:
        with pytest.raises(CollectiveTimeoutError):
            fc.allreduce(np.ones(20000, np.float32), rank0, algorithm="recursive_doubling")
    finally:
        fc.set_mismatch_check(True)
    assert time.monotonic() - t0 < 5  # gave up at its 0.3 s deadline (a loaded host's room)
    assert POOL.held_bytes() == 0  # its incoming array may still receive: dropped
