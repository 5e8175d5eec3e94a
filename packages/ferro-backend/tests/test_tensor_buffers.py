"""What has no buffer protocol but that ``np.asarray`` views without copying (a torch CPU
tensor, an object with ``__array_interface__`` or a sharing ``__array__``) is sent, and received
into, on every transport (API.md: "any input that np.asarray turns into a C-contiguous array
without copying ... is accepted as well"; found by a bug hunt: a TypeError from memoryview).
What numpy would copy (a list, an ``__array__`` making a fresh array) or cannot view (a tensor
that requires grad) is refused with a TypeError naming its type."""

import numpy as np
import pytest

from ferro_backend.checks import as_recv_view, as_send_view
from ferro_backend.testing import run_processes, run_ranks


class Shared:
    """A numpy-only stand-in for a tensor: no buffer protocol, ``__array__`` shares memory."""

    def __init__(self, arr):
        self.arr = arr

    def __array__(self, dtype=None, copy=None):
        return self.arr


class Interface:
    """Another: ``__array_interface__`` only, over an array it keeps alive."""

    def __init__(self, arr):
        self.arr = arr
        self.__array_interface__ = arr.__array_interface__


class Fresh:
    """``__array__`` returning a new array each time: receiving into it would be lost."""

    def __array__(self, dtype=None, copy=None):
        return np.zeros(4, np.float32)


def _make(kind, values):
    if kind == "torch":
        import torch

        return torch.tensor(values, dtype=torch.float32)
    arr = np.array(values, dtype=np.float32)
    return Shared(arr) if kind == "array" else Interface(arr)


def _values(x):
    return np.asarray(x).tolist()


def _exchange(b, kind):
    """Each rank sends the other its wrapper (send and isend), receives into one (recv and
    irecv): the bytes land in the wrapper's own memory."""
    other = 1 - b.rank
    mine = [float(b.rank + 1)] * 4
    b.send(_make(kind, mine), other, tag=1)
    req = b.isend(_make(kind, [m * 10 for m in mine]), other, tag=2)
    got, got2 = _make(kind, [0.0] * 4), _make(kind, [0.0] * 4)
    b.recv(got, other, tag=1, timeout=20)
    b.irecv(got2, other, tag=2).wait(20)
    req.wait(20)
    return _values(got), _values(got2)


@pytest.mark.parametrize("kind", ["array", "interface", "torch"])
@pytest.mark.parametrize("transport", ["threads", "tcp", "shm"])
def test_tensors_and_array_likes_are_sent_and_received_into(transport, kind):
    if kind == "torch":
        pytest.importorskip("torch")
    res = (run_ranks(lambda b: _exchange(b, kind), 2, timeout=30) if transport == "threads" else
           run_processes(_exchange, 2, kind, transport=transport, timeout=90))
    for me, (got, got2) in enumerate(res):
        other = 2.0 - me
        assert got == [other] * 4 and got2 == [other * 10] * 4, (transport, kind, me, res)


@pytest.mark.parametrize("bad, words", [
    ([1.0, 2.0], "would copy this list"),
    (Fresh(), "would copy this Fresh"),
    (5, "would copy this int"),
])
def test_what_numpy_would_copy_is_refused_naming_its_type(bad, words):
    for view in (as_send_view, as_recv_view):
        with pytest.raises(TypeError, match=words):
            view(bad)


def test_a_tensor_numpy_cannot_view_is_refused_naming_it():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="this Tensor is not a buffer"):
        as_send_view(torch.ones(2, requires_grad=True))
    with pytest.raises(ValueError, match="not C-contiguous"):  # (as an ndarray's)
        as_recv_view(torch.zeros(2, 3).t())


def test_the_view_of_a_tensor_is_its_memory():
    torch = pytest.importorskip("torch")
    t = torch.zeros(3, dtype=torch.float64)
    as_recv_view(t)[:8] = np.float64(2.5).tobytes()
    assert t.tolist() == [2.5, 0.0, 0.0]
    assert bytes(as_send_view(torch.arange(2, dtype=torch.int32))) == \
        np.arange(2, dtype=np.int32).tobytes()
