"""ElasticState.sync hands every member the source's state with its structure intact: 0-d
arrays stay 0-d, namedtuples (an optimizer's AdamState) and other container subclasses come
back as their own type, and one that cannot be rebuilt is a TypeError naming it."""

import collections
import types

import numpy as np
import pytest

from ferro_backend.testing import run_ranks
from ferro_collective.elastic import ElasticState, _split

pytestmark = pytest.mark.timeout(120)

AdamState = collections.namedtuple("AdamState", "count mu nu")


class Pair(tuple):
    """A tuple subclass built from one iterable, as tuple is."""


class Fixed(tuple):
    """A tuple subclass whose constructor does not take the items."""

    def __new__(cls, a, b, c):
        return super().__new__(cls, (a, b, c))


def _synced(make):
    """What rank 1 restores when rank 0 (the source) holds ``make(0)``."""
    got = {}

    def body(b):
        job = types.SimpleNamespace(backend=b, source=0, history=[{"reason": "start"}])
        mine = make(b.rank)
        ElasticState(job, lambda: mine, lambda s: got.__setitem__(b.rank, s)).sync()

    run_ranks(body, 2, timeout=60)
    return got[1]


def test_zero_d_arrays_keep_their_shape():
    got = _synced(lambda r: {"count": np.array(7 if r == 0 else 0, np.int64),
                             "scale": np.float32(2.0) * np.ones((), np.float32),
                             "w": np.full((2, 3), r, np.float64)})
    assert got["count"].shape == () and int(got["count"]) == 7
    assert got["scale"].shape == () and got["scale"].dtype == np.float32
    np.testing.assert_array_equal(got["w"], np.zeros((2, 3)))


def test_namedtuples_and_subclasses_keep_their_type():
    def make(r):
        return {"opt": AdamState(np.array(r + 5), np.full(3, r, np.float32), (np.zeros(2),)),
                "pair": Pair((np.full(2, r), "tag")),
                "ordered": collections.OrderedDict([("b", np.array([r])), ("a", 1)]),
                "counts": collections.defaultdict(int, {"x": np.array([r + 1])})}

    got = _synced(make)
    assert type(got["opt"]) is AdamState
    assert int(got["opt"].count) == 5 and got["opt"].count.shape == ()
    np.testing.assert_array_equal(got["opt"].mu, np.zeros(3, np.float32))
    assert type(got["pair"]) is Pair and got["pair"][1] == "tag"
    assert type(got["ordered"]) is collections.OrderedDict
    assert list(got["ordered"]) == ["b", "a"]
    assert type(got["counts"]) is collections.defaultdict
    assert got["counts"].default_factory is int and int(got["counts"]["x"][0]) == 1


def test_a_subclass_that_cannot_be_rebuilt_is_named():
    with pytest.raises(TypeError, match="Fixed"):
        _split({"s": Fixed(np.zeros(1), 2, 3)}, [])
