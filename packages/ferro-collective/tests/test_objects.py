"""broadcast_object and all_gather_object: round trips over simulated ranks (world 1..8), pickle
errors on every rank, unpickling errors on the rank that has them, mismatches and timeouts."""

import pickle
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rooted import collect

from ferro_backend import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidRankError,
    SimulatedBackend,
)
from ferro_backend.testing import run_ranks
from ferro_collective import all_gather_object, broadcast_object, scatter

objects = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20)
                       | st.binary(max_size=50) | st.floats(allow_nan=False),
                       lambda kids: st.lists(kids, max_size=4)
                       | st.dictionaries(st.text(max_size=5), kids, max_size=4), max_leaves=10)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 8), objs=st.lists(objects, min_size=8, max_size=8), data=st.data())
def test_broadcast_and_all_gather_objects_round_trip(n, objs, data):
    root = data.draw(st.integers(0, n - 1))

    def fn(b):
        return (broadcast_object(objs[b.rank] if b.rank == root else None, b, root=root),
                all_gather_object(objs[b.rank], b))

    for bc, gathered in run_ranks(fn, n, timeout=30):
        assert bc == objs[root]
        assert gathered == objs[:n]


def test_results_are_copies_and_the_root_keeps_its_object():
    payload = {"w": np.arange(5.0), "cfg": [1, 2]}

    def fn(b):
        got = broadcast_object(payload if b.rank == 0 else None, b)
        everyone = all_gather_object(payload, b)
        return got is payload, everyone[b.rank] is payload, got, everyone

    for r, (same, own_same, got, everyone) in enumerate(run_ranks(fn, 3)):
        assert same == (r == 0) and not own_same
        np.testing.assert_array_equal(got["w"], payload["w"])
        assert all(e["cfg"] == [1, 2] for e in everyone)


def test_unpicklable_object_is_a_type_error_on_every_rank():
    lock = threading.Lock()

    def bcast(b):
        return broadcast_object(lock if b.rank == 1 else None, b, root=1, timeout=10)

    errors = collect(bcast, 3)
    assert set(errors) == {0, 1, 2}
    assert all(isinstance(e, TypeError) for e in errors.values())
    assert "cannot pickle lock object" in str(errors[1])
    assert "broadcast_object: root 1 cannot pickle lock object" in str(errors[0])

    def gather_all(b):
        return all_gather_object((lambda: 0) if b.rank == 2 else b.rank, b, timeout=10)

    errors = collect(gather_all, 3)
    assert set(errors) == {0, 1, 2}
    assert all(isinstance(e, TypeError) for e in errors.values())
    assert "ranks [2] cannot pickle their objects: rank 2 cannot pickle function" in str(errors[0])
    assert str(errors[1]) == str(errors[0])
    assert str(errors[2]).startswith("all_gather_object: cannot pickle function object")


class _Local:  # picklable by reference; made unimportable below on the receiving side
    pass


def test_unpickling_error_names_the_sender(monkeypatch):
    data = pickle.dumps(_Local())
    bad = data.replace(b"_Local", b"_Lxxxx")  # a class that does not exist

    class Raw:
        def __reduce__(self):
            return (pickle.loads, (bad,))

    def fn(b):
        return broadcast_object(Raw() if b.rank == 0 else None, b, timeout=10)

    errors = collect(fn, 2)
    assert list(errors) == [1] and isinstance(errors[1], pickle.UnpicklingError)
    assert "rank 1 cannot unpickle rank 0's object" in str(errors[1])


def test_root_checked_and_mismatch_and_timeout():
    g = SimulatedBackend.create_group(2)
    with pytest.raises(InvalidRankError, match="root 2 is out of range for world_size 2"):
        broadcast_object(1, g[0], root=2)

    def fn(b):
        if b.rank == 0:
            return broadcast_object({"a": 1}, b, timeout=10)
        return scatter(None, b, timeout=10)

    errors = collect(fn, 2)
    for e in errors.values():
        assert isinstance(e, CollectiveMismatchError)
        assert "broadcast_object(root=0)" in str(e) and "scatter(root=0)" in str(e)

    rank0, _silent = SimulatedBackend.create_group(2)
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="all_gather_object .* 0.3s"):
        all_gather_object(1, rank0, timeout=0.3)
    assert time.monotonic() - t0 < 5  # gave up at its deadline (a loaded host's room)
