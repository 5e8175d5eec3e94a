"""The flat layout: split rule, padding, gather/scatter rearrangement (checked against numpy)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferro_fsdp import FlatLayout, split_sizes, split_starts


def test_split_rule_is_ferro_checkpoints():
    assert split_sizes(10, 4) == (3, 3, 2, 2)
    assert split_starts(10, 4) == (0, 3, 6, 8)
    assert split_sizes(2, 4) == (1, 1, 0, 0)
    assert split_sizes(8, 4) == (2, 2, 2, 2)


def test_padding_shows_as_trailing_zeros_of_short_chunks():
    lay = FlatLayout([(10,), (2, 2)], np.float64, 4)
    assert lay.chunks == (3, 1)
    assert lay.shard_numel == 4 and lay.padded_numel == 16 and lay.numel == 14
    full = np.arange(1.0, 11.0)
    assert [lay.shard_of(0, full, r).tolist() for r in range(4)] == [
        [1, 2, 3], [4, 5, 6], [7, 8, 0], [9, 10, 0]]
    assert lay.region(0, 2) == (6, 2)
    assert "padding=2" in repr(lay)
    with pytest.raises(ValueError, match="elements"):
        lay.shard_of(0, np.ones(9), 0)
    with pytest.raises(ValueError):
        FlatLayout([(1,)], np.float64, 0)


shapes_st = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
                     min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(shapes=shapes_st, world=st.integers(1, 6),
       dtype=st.sampled_from([np.float32, np.float64]))
def test_gather_and_scatter_round_trip(shapes, world, dtype):
    lay = FlatLayout(shapes, dtype, world)
    rng = np.random.default_rng(0)
    fulls = [rng.standard_normal(s).astype(dtype) for s in shapes]
    # every rank's flat shard, all-gathered = concatenated in rank order
    shards = [lay.pack_shards([lay.shard_of(i, f, r) for i, f in enumerate(fulls)])
              for r in range(world)]
    gathered = np.concatenate(shards)
    assert gathered.size == lay.padded_numel
    for got, want in zip(lay.gathered_to_full(gathered), fulls):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    # the reduce-scatter input: rank r's slice of it is rank r's flat shard
    send = lay.full_to_scatter(fulls)
    for r in range(world):
        np.testing.assert_array_equal(send[r * lay.shard_numel:(r + 1) * lay.shard_numel], shards[r])
    # shard views and unpack
    views = lay.shard_views(shards[0])
    outs = [np.empty(c, dtype) for c in lay.chunks]
    lay.unpack_shards(shards[0], outs)
    for v, o in zip(views, outs):
        np.testing.assert_array_equal(v, o)


def test_none_gradients_are_zeros_and_outs_are_filled_in_place():
    lay = FlatLayout([(3,), (2,)], np.float64, 2)
    send = lay.full_to_scatter([None, np.array([5.0, 6.0])])
    np.testing.assert_array_equal(send, [0, 0, 5, 0, 0, 6])
    outs = [np.zeros(3), np.zeros(2)]
    lay.gathered_to_full(np.array([1, 2, 5, 3, 0, 6], dtype=np.float64), outs)
    np.testing.assert_array_equal(outs[0], [1, 2, 3])
    np.testing.assert_array_equal(outs[1], [5, 6])
    with pytest.raises(ValueError, match="contiguous"):
        lay2 = FlatLayout([(2, 3)], np.float64, 1)
        lay2.gathered_to_full(np.zeros(6), [np.zeros((3, 2)).T])
    with pytest.raises(ValueError, match="was .data replaced"):
        lay.pack_shards([np.zeros(3), np.zeros(1)])
