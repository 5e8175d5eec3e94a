"""The ``_copy_crc`` kernel against references: CRC-32C against RFC 3720's vectors and a
bytewise Python implementation, in both of its implementations (the CPU's instruction and the
tables); ``copy_window`` against numpy slicing; ``write_chunks`` against the file it wrote."""

import errno
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferro_checkpoint import _copy_crc

_TABLE = []
for _b in range(256):
    _c = _b
    for _ in range(8):
        _c = (_c >> 1) ^ (0x82F63B78 if _c & 1 else 0)
    _TABLE.append(_c)


def crc32c_ref(data: bytes, crc: int = 0) -> int:
    """CRC-32C, one byte at a time (a table built bit by bit)."""
    crc ^= 0xFFFFFFFF
    for b in bytes(data):
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


@pytest.fixture(params=["hardware", "software"])
def impl(request):
    """Run a test on the CPU's CRC instruction (where there is one) and on the tables."""
    _copy_crc.use_hardware(request.param == "hardware")
    yield _copy_crc.implementation()
    _copy_crc.use_hardware(True)


def test_implementation_is_named():
    assert _copy_crc.use_hardware(True) == (_copy_crc.implementation() != "software")
    assert _copy_crc.implementation() in ("sse4.2", "armv8-crc", "software")


@pytest.mark.parametrize("data, want", [
    (b"", 0), (b"123456789", 0xE3069283), (bytes(32), 0x8A9136AA), (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E), (bytes(range(31, -1, -1)), 0x113FDB5C)])
def test_rfc3720_vectors(impl, data, want):
    assert _copy_crc.crc32c(np.frombuffer(data, np.uint8)) == want
    assert crc32c_ref(data) == want


@pytest.mark.parametrize("n", [1, 7, 8, 255, 767, 768, 769, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 773,
                               2 * 3 * 8192 + 3 * 256 + 13])
def test_every_length_class_against_the_reference(impl, n):
    """Short tails, the short and long three-stream blocks, and what is left after them."""
    data = np.random.default_rng(n).integers(0, 256, n + 5, dtype=np.uint8)
    for off in (0, 3):  # aligned and not
        view = data[off:off + n]
        assert _copy_crc.crc32c(view) == crc32c_ref(view.tobytes())
        assert _copy_crc.crc32c(view, 0x12345678) == crc32c_ref(view.tobytes(), 0x12345678)


def test_instruction_and_tables_agree_on_large_buffers():
    data = np.random.default_rng(7).integers(0, 256, (5 << 20) + 77, dtype=np.uint8)
    _copy_crc.use_hardware(True)
    a = _copy_crc.crc32c(data[1:])
    _copy_crc.use_hardware(False)
    b = _copy_crc.crc32c(data[1:])
    _copy_crc.use_hardware(True)
    assert a == b
    split = 3 * 8192 * 5 + 11  # continuing from a checksum gives the checksum of the whole
    assert _copy_crc.crc32c(data[split:], _copy_crc.crc32c(data[1:split])) == a


def test_read_only_inputs_are_accepted(impl):
    data = np.frombuffer(b"123456789" * 1000, np.uint8)
    assert not data.flags.writeable
    assert _copy_crc.crc32c(data) == crc32c_ref(data.tobytes())
    crcs = np.empty(3, np.uint32)
    _copy_crc.crc32c_chunks(data, crcs, 4000)
    assert [int(c) for c in crcs] == [crc32c_ref(data[i:i + 4000].tobytes())
                                      for i in (0, 4000, 8000)]


@st.composite
def windows(draw):
    """Runs, a destination and a window: the arguments of copy_window, and its reference."""
    outer = draw(st.integers(0, 5))
    run = draw(st.integers(0, 40))
    src_off = draw(st.integers(0, 20))
    src_row = src_off + run + draw(st.integers(0, 20))
    dst_off = draw(st.integers(0, 10))
    dst_row = dst_off + run + draw(st.integers(0, 10))
    n = max(0, (outer - 1) * src_row + src_off + run) + draw(st.integers(0, 30))
    chunk = draw(st.integers(1, 64))
    verify = draw(st.booleans()) and n > 0
    lo = draw(st.integers(0, (n - 1) // chunk)) * chunk if verify else draw(st.integers(0, n))
    hi = draw(st.integers(lo + 1 if verify else lo, n))
    stream = draw(st.booleans())
    src = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), np.uint8)
    return src, outer, src_row, dst_row, src_off, dst_off, run, lo, hi, chunk, verify, stream


@settings(max_examples=300, deadline=None)
@given(case=windows(), hardware=st.booleans())
def test_copy_window_against_numpy(case, hardware):
    src, outer, src_row, dst_row, src_off, dst_off, run, lo, hi, chunk, verify, stream = case
    dst_len = max(0, (outer - 1) * dst_row + dst_off + run)
    want = np.full(dst_len, 0xAB, np.uint8)
    for o in range(outer):  # the part of each run inside the window
        s, e = max(o * src_row + src_off, lo), min(o * src_row + src_off + run, hi)
        if s < e:
            d = o * dst_row + dst_off + s - (o * src_row + src_off)
            want[d:d + e - s] = src[s:e]
    got = np.full(dst_len, 0xAB, np.uint8)
    crcs = np.empty(-(-(hi - lo) // chunk) if verify else 0, np.uint32)
    _copy_crc.use_hardware(hardware)
    try:
        _copy_crc.copy_window(src, got, lo, hi, outer, src_row, dst_row, src_off, dst_off, run,
                              crcs, chunk, stream)
    finally:
        _copy_crc.use_hardware(True)
    np.testing.assert_array_equal(got, want)
    assert [int(c) for c in crcs] == [crc32c_ref(src[i:min(i + chunk, hi)].tobytes())
                                      for i in range(lo, hi, chunk)][:crcs.size]


@pytest.mark.parametrize("stream", [False, True])
def test_copy_window_large_unaligned(impl, stream):
    """Megabytes through the long blocks (streamed stores too) into an unaligned destination."""
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, (3 << 20) + 5, dtype=np.uint8)
    dst = np.zeros(src.size + 3, np.uint8)
    chunk = 1 << 20
    crcs = np.empty(4, np.uint32)
    _copy_crc.copy_window(src, dst[3:], 0, src.size, 1, src.size, src.size, 0, 0, src.size, crcs,
                          chunk, stream)
    np.testing.assert_array_equal(dst[3:], src)
    for i in range(4):
        assert crcs[i] == _copy_crc.crc32c(src[i * chunk:(i + 1) * chunk])


def test_copy_window_checksums_only_without_a_destination(impl):
    src = np.arange(100, dtype=np.uint8)
    crcs = np.empty(4, np.uint32)
    _copy_crc.copy_window(src, np.empty(0, np.uint8), 0, 100, 1, 100, 100, 0, 0, 100, crcs, 32)
    assert [int(c) for c in crcs] == [crc32c_ref(src[i:i + 32].tobytes()) for i in range(0, 100, 32)]


@pytest.mark.parametrize("n, chunk", [(0, 8), (1, 8), (100, 8), (100, 100), (3 << 20, 1 << 20)])
def test_write_chunks_writes_everything_and_checksums_each_chunk(tmp_path, impl, n, chunk):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    crcs = np.empty(max(1, -(-n // chunk)), np.uint32)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert _copy_crc.write_chunks(fd, data, crcs, chunk) == 0
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == data.tobytes()
    assert [int(c) for c in crcs] == [crc32c_ref(data[i:i + chunk].tobytes())
                                      for i in range(0, max(n, 1), chunk)]


def test_write_chunks_reports_the_errno(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert _copy_crc.write_chunks(fd, np.ones(10, np.uint8), np.empty(0, np.uint32),
                                      4) == errno.EBADF
    finally:
        os.close(fd)


@pytest.mark.parametrize("d", [0, 8, 16, 64, 1000, 1024, 2048, 4088])
@pytest.mark.parametrize("checksum", [True, False])
def test_streamed_copies_whatever_the_destination_offset(d, checksum):
    """A destination a little above the source modulo 4096 is copied backward (4K aliasing):
    the same bytes and checksums at every offset, odd lengths and both ends unaligned."""
    rng = np.random.default_rng(d)
    base_src = rng.integers(0, 256, 300_000, dtype=np.uint8)
    base_dst = np.zeros(300_000 + 8192, np.uint8)
    src = base_src[3:3 + 200_001]
    shift = (d - (base_dst.ctypes.data - src.ctypes.data)) % 4096
    dst = base_dst[shift:shift + src.size]
    assert (dst.ctypes.data - src.ctypes.data) % 4096 == d
    chunk = 65_536
    crcs = np.empty(-(-src.size // chunk) if checksum else 0, np.uint32)
    _copy_crc.copy_window(src, dst, 0, src.size, 1, src.size, src.size, 0, 0, src.size, crcs,
                          chunk, True)
    np.testing.assert_array_equal(dst, src)
    assert base_dst[:shift].sum() == 0 and base_dst[shift + src.size:].sum() == 0
    assert [int(c) for c in crcs] == [_copy_crc.crc32c(src[i:i + chunk])
                                      for i in range(0, src.size, chunk)][:crcs.size]
