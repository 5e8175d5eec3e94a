"""pack/unpack: the fused-message kernel against numpy, with hypothesis shapes and dtypes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ferro_backend import SizeMismatchError, pack, packed_nbytes, unpack

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8,
          np.bool_]

arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6)))


@settings(max_examples=150, deadline=None)
@given(st.lists(arrays, min_size=0, max_size=8))
def test_pack_unpack_round_trip(arrs):
    buf = pack(arrs)
    assert buf.dtype == np.uint8 and buf.nbytes == packed_nbytes(arrs)
    # the wire format is little-endian bytes back to back
    expected = b"".join(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()
                        for a in arrs)
    assert buf.tobytes() == expected
    outs = [np.empty_like(a) for a in arrs]
    unpack(buf, outs)
    for a, o in zip(arrs, outs):
        np.testing.assert_array_equal(o, a)


@settings(max_examples=60, deadline=None)
@given(st.lists(arrays, min_size=1, max_size=5))
def test_big_endian_host_path_swaps_words(arrs):
    """The byte-swapping path (taken on big-endian hosts) against numpy's byteswap."""
    arrs = [a.astype(a.dtype.newbyteorder(">")) for a in arrs]
    buf = pack(arrs, native_is_wire=False)
    # these arrays are big-endian data on a 'big-endian host': swapped words give little-endian
    expected = b"".join(a.byteswap().tobytes() for a in arrs)
    assert buf.tobytes() == expected
    outs = [np.empty_like(a) for a in arrs]
    unpack(buf, outs, native_is_wire=False)
    for a, o in zip(arrs, outs):
        assert o.tobytes() == a.tobytes()


def test_non_native_input_on_little_endian_host_is_swapped_to_wire_order():
    a = np.arange(5, dtype=">i4")
    assert pack([a]).tobytes() == np.arange(5, dtype="<i4").tobytes()


def test_unpack_checks_total_size_and_destinations():
    buf = pack([np.ones(3, np.float32)])
    with pytest.raises(SizeMismatchError, match="16 bytes, the buffer has 12"):
        unpack(buf, [np.empty(4, np.float32)])
    ro = np.empty(3, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        unpack(buf, [ro])
    with pytest.raises(ValueError, match="C-contiguous"):
        unpack(buf, [np.empty((3, 2), np.float32)[:, 0]])
    with pytest.raises(TypeError, match="dtype object"):
        pack([np.array([None])])


def test_pack_into_given_out_checks_size():
    with pytest.raises(SizeMismatchError, match="expected a 1-d uint8 array of 8 bytes"):
        pack([np.ones(2, np.float32)], out=np.empty(7, np.uint8))
    out = np.empty(8, np.uint8)
    assert pack([np.ones(2, np.float32)], out=out) is out


def test_read_only_inputs_are_fine():
    a = np.frombuffer(np.arange(4, dtype=np.float64).tobytes(), dtype=np.float64)
    assert not a.flags.writeable
    out = np.empty(4)
    unpack(pack([a]), [out])
    np.testing.assert_array_equal(out, a)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 5000), src_off=st.integers(0, 31), dst_off=st.integers(0, 31),
       seed=st.integers(0, 2**32 - 1))
def test_stream_copy_equals_numpy_at_every_length_and_alignment(n, src_off, dst_off, seed):
    """Non-temporal copy (a head up to 16-byte alignment, 64-byte blocks, a tail) against
    numpy's copy, with the bytes around the destination untouched."""
    from ferro_backend import _wire

    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, n + src_off, dtype=np.uint8)[src_off:]
    buf = rng.integers(0, 256, n + dst_off + 8, dtype=np.uint8)
    before = buf.copy()
    dst = buf[dst_off:dst_off + n]
    _wire.stream_copy(src, dst)
    np.testing.assert_array_equal(dst, src)
    np.testing.assert_array_equal(buf[:dst_off], before[:dst_off])
    np.testing.assert_array_equal(buf[dst_off + n:], before[dst_off + n:])


def test_stream_copy_refuses_unequal_lengths_and_is_compiled():
    from ferro_backend import _wire

    with pytest.raises(ValueError, match="5 bytes into a buffer of 4"):
        _wire.stream_copy(np.zeros(5, np.uint8), np.zeros(4, np.uint8))
    assert _wire.__file__.endswith(".so") and isinstance(_wire.STREAM_STORES, bool)
