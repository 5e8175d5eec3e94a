"""Numpy arrays of a dtype the buffer protocol cannot describe (bfloat16 and the float8 kinds of
ml_dtypes, datetime64, timedelta64: ``memoryview(arr)`` raises numpy's ValueError "cannot include
dtype 'E' in a buffer") are sent, and received into, as their bytes, bit-exact, on every
transport, as collectives take them (found by a bug hunt: send/recv/isend/irecv raised that
ValueError). Object arrays are still refused with a TypeError."""

from functools import partial

import numpy as np
import pytest

from ferro_backend.checks import as_recv_view, as_send_view
from ferro_backend.testing import run_processes, run_ranks

ml_dtypes = pytest.importorskip("ml_dtypes")

DTYPES = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "datetime64[s]", "timedelta64[ns]",
          "structured"]


def _dtype(name):
    if name == "structured":
        return np.dtype([("a", np.int16), ("b", ml_dtypes.bfloat16)])
    return np.dtype(getattr(ml_dtypes, name, name))


def _array(name, seed):
    raw = np.random.default_rng(seed).integers(0, 256, 6 * _dtype(name).itemsize, np.uint8)
    return raw.view(_dtype(name)).reshape(2, 3)  # arbitrary bits, NaNs and NaTs included


def _exchange(b, name):
    """Each rank sends the other two arrays (send, isend) and receives two (recv, irecv) into
    arrays of the dtype; the bytes received, as bytes."""
    other = 1 - b.rank
    b.send(_array(name, b.rank), other, tag=1)
    req = b.isend(_array(name, b.rank + 10), other, tag=2)
    got, got2 = np.zeros((2, 3), _dtype(name)), np.zeros((2, 3), _dtype(name))
    b.recv(got, other, tag=1, timeout=20)
    b.irecv(got2, other, tag=2).wait(20)
    req.wait(20)
    return got.tobytes(), got2.tobytes()


@pytest.mark.parametrize("transport", ["threads", "tcp", "shm"])
def test_dtypes_without_a_buffer_format_move_as_their_bytes(transport):
    for name in DTYPES:
        res = (run_ranks(partial(_exchange, name=name), 2, timeout=30) if transport == "threads"
               else run_processes(_exchange, 2, name, transport=transport, timeout=90))
        for me, (got, got2) in enumerate(res):
            other = 1 - me
            assert got == _array(name, other).tobytes(), (transport, name, me)
            assert got2 == _array(name, other + 10).tobytes(), (transport, name, me)


@pytest.mark.parametrize("name", DTYPES)
def test_the_views_of_such_arrays_are_their_memory(name):
    x = _array(name, 3)
    assert bytes(as_send_view(x)) == x.tobytes()
    out = np.zeros((2, 3), _dtype(name))
    as_recv_view(out)[:] = x.tobytes()
    assert out.tobytes() == x.tobytes()
    with pytest.raises(ValueError, match="not C-contiguous"):
        as_send_view(x.T)
    with pytest.raises(ValueError, match="not C-contiguous"):
        as_recv_view(out.T)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        as_recv_view(out)


def test_object_arrays_are_still_refused():
    objs = np.array([1, "a"], dtype=object)
    with_objects = np.zeros(2, [("a", object), ("b", np.int64)])
    for view in (as_send_view, as_recv_view):
        for bad in (objs, with_objects):
            with pytest.raises(TypeError, match="Python objects"):
                view(bad)
