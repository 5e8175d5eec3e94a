"""The header's dtype codes (:func:`ferro_collective.header.dtype_code`): dtypes that numpy's
``dtype.str`` cannot tell apart (the 1-byte ml_dtypes types are all ``<V1``, structured dtypes
of one size ``|V<n>``, datetimes of long units cut at 8 bytes) or cannot parse (float8_e5m2's
``<f1``) are a mismatch on every rank, named in its message; a broadcast's non-root that passes
None gets the root's dtype, or, where the header cannot rebuild it, every rank raises and the
next call agrees."""

import dtype_code_fns
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferro_backend import CollectiveMismatchError
from ferro_backend.testing import run_processes, run_ranks
from ferro_collective import all_gather, allreduce, broadcast, scatter
from ferro_collective.header import describe, dtype_code, dtype_from_code, dtype_name, encode

ML = [np.dtype(getattr(ml_dtypes, name)) for name in (
    "bfloat16", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float6_e2m3fn",
    "float6_e3m2fn", "float4_e2m1fn", "int2", "int4", "uint2", "uint4")
    if hasattr(ml_dtypes, name)]
PLAIN = [np.dtype(c) for c in "?bBhHiIlLqQefdgFDG"] + \
    [np.dtype(c).newbyteorder(">") for c in "hHiIefdFD"]
TIMES = [np.dtype(f"{k}8[{m}{u}]") for k in "mM" for m in ("", "10", "1000")
         for u in ("ns", "us", "D")]
STRUCTS = [np.dtype([("a", "<i4"), ("b", "<f4")]), np.dtype([("c", "<i4"), ("d", "<f4")]),
           np.dtype([("a", "<f4"), ("b", "<i4")]), np.dtype([("a", "<f8")]),
           np.dtype({"names": ["a"], "formats": ["<i4"], "offsets": [4], "itemsize": 8}),
           np.dtype("V8"), np.dtype("S8"), np.dtype("<U2")]
DTYPES = ML + PLAIN + TIMES + STRUCTS
TWO = st.tuples(st.sampled_from(DTYPES), st.sampled_from(DTYPES))


def _same(a: np.dtype, b: np.dtype) -> bool:
    """One dtype (numpy's M8[1000ns] == M8[us], but not the other way round)."""
    return a == b and b == a and a.str == b.str


@given(TWO)
def test_two_dtypes_have_one_code_only_when_they_are_equal(pair):
    a, b = pair
    ca, cb = dtype_code(a), dtype_code(b)
    assert (ca == cb) == _same(a, b), (a, b, ca, cb)
    assert len(ca) <= 8 and b"\0" not in ca
    back = dtype_from_code(ca)
    assert back == a if not ca.startswith(b"#") else back is None


@given(st.sampled_from(DTYPES))
def test_a_code_names_its_dtype_readably(dtype):
    name = dtype_name(dtype_code(dtype))
    readable = dtype.name if dtype.byteorder in "=|" else dtype.str  # (">f4": not float32)
    assert name == readable or name.startswith("#")
    assert f"all_gather({name}[3])" in describe(encode("all_gather", dtype, (3,)))


@given(st.binary(min_size=8, max_size=8), st.integers(0, 255))
def test_describe_never_raises(field, code):
    header = bytearray(encode("all_gather", np.dtype(np.float32), (4,)))
    header[2], header[8:16] = code, field
    assert isinstance(describe(bytes(header)), str)
    assert dtype_name(field) is not None
    dtype_from_code(field)


def _both(fn, world=2):
    """Every rank's result or error, then whether the next call agreed on every rank."""
    def wrap(b):
        try:
            got = fn(b)
        except Exception as exc:
            got = exc
        return got, allreduce(np.ones(2), b, timeout=10).tolist()

    out = run_ranks(wrap, world, timeout=60)
    assert all(nxt == [world, world] for _, nxt in out)
    return [got for got, _ in out]


@settings(max_examples=25, deadline=None)
@given(TWO.filter(lambda p: not _same(*p) and p[0].itemsize == p[1].itemsize))
def test_ranks_passing_different_dtypes_of_one_size_raise_on_every_rank(pair):
    def fn(b):
        x = np.zeros(3, pair[b.rank])
        return all_gather(x, b, timeout=10)

    errors = _both(fn)
    assert all(isinstance(e, CollectiveMismatchError) for e in errors), errors
    assert str(errors[0]) == str(errors[1])
    for dtype in pair:
        assert dtype_name(dtype_code(dtype)) in str(errors[0])


@pytest.mark.parametrize("call", [all_gather, broadcast])
def test_ranks_differing_in_byte_order_alone_are_described_apart(call):
    errors = _both(lambda b: call(np.arange(4.0).astype(">f4" if b.rank else "<f4"), b,
                                  timeout=10))
    assert all(isinstance(e, CollectiveMismatchError) for e in errors), errors
    text = str(errors[0])
    assert f"ranks [0] called {call.__name__}(float32[4]" in text, text
    assert f"ranks [1] called {call.__name__}(>f4[4]" in text, text


@pytest.mark.parametrize("dtype", ML + PLAIN + [d for d in TIMES if "1000" not in str(d)],
                         ids=str)
def test_broadcast_to_none_gets_the_roots_dtype(dtype):
    want = (np.arange(4) % 2).astype(dtype)
    got = _both(lambda b: broadcast(want if b.rank == 0 else None, b, 0, timeout=10), 3)
    for g in got:
        assert not isinstance(g, Exception), g
        assert g.dtype == dtype and g.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", [STRUCTS[0], np.dtype(">M8[1000ns]")], ids=str)
def test_broadcast_to_none_of_a_dtype_the_header_cannot_rebuild_raises_on_every_rank(dtype):
    got = _both(lambda b: broadcast(np.zeros(2, dtype) if b.rank == 0 else None, b, 0,
                                    timeout=10), 3)
    assert all(isinstance(e, CollectiveMismatchError) for e in got), got
    assert "passed None" in str(got[1])


@pytest.mark.parametrize("dtype", [np.dtype(ml_dtypes.float8_e5m2), np.dtype("M8[10ns]")],
                         ids=str)
def test_a_shape_mismatch_of_a_dtype_numpy_cannot_parse_raises_at_once(dtype):
    got = _both(lambda b: all_gather(np.zeros(2 + b.rank, dtype), b, timeout=10))
    assert all(isinstance(e, CollectiveMismatchError) for e in got), got
    assert f"{dtype.name}[2]" in str(got[0]) and f"{dtype.name}[3]" in str(got[0])


def test_scatter_of_a_structured_dtype_is_a_type_error():
    got = _both(lambda b: scatter(np.zeros(4, STRUCTS[0]) if b.rank == 0 else None, b, 0,
                                  timeout=10))
    assert isinstance(got[0], TypeError) and "structured" in str(got[0])
    assert isinstance(got[1], CollectiveMismatchError) and "TypeError" in str(got[1])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_over_real_processes(transport):
    assert run_processes(dtype_code_fns.suite, 2, transport=transport, timeout=120) == [[]] * 2


def test_the_engine_doors_messages_name_the_same_extension_dtypes():
    from pathlib import Path

    import ferro_backend
    from ferro_collective.header import EXTENSION_DTYPES

    source = Path(ferro_backend.__file__).parent / "engine" / "_header.h"
    if not source.exists():
        pytest.skip("the engine's _header.h is not installed here")
    text = source.read_text()
    for code, name in EXTENSION_DTYPES[1:]:  # (bfloat16's "<V2" is among the door's dtypes)
        assert f'{{"{code}", "{name}"}}' in text
    assert f"FERRO_EXT_DTYPE_COUNT {len(EXTENSION_DTYPES) - 1}" in text
