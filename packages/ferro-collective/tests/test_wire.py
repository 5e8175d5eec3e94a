"""Compressed collectives (ferro_collective.wire): the formats against numpy's own casts and a
blockwise reference, and allreduce / reduce_scatter / all_gather with ``wire=`` against a
reference written without chunks or all-to-all: every rank the same bits, world sizes 1-4, on
threads (simulated) and real processes (TCP, the same-host engine)."""

import contextlib

import numpy as np
import pytest
import wire_fns
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rooted import collect

import ferro_collective as fc
from ferro_backend.testing import run_processes, run_ranks
from ferro_collective import ReduceOp
from ferro_collective.wire import BLOCK, decode, encode, encoded_bytes

ml_dtypes = pytest.importorskip("ml_dtypes")
pytestmark = pytest.mark.timeout(120)
WIRES = ["bf16", "fp16", "int8", "int4"]


def roundtrip(x, wire):
    x = np.asarray(x, np.float32).reshape(-1)
    buf = encode(x, wire)
    assert buf.dtype == np.uint8 and buf.size == encoded_bytes(x.size, wire)
    return decode(buf, wire, x.size)


def int8_reference(x, top=127):
    """Blockwise ints written plainly: per block, scale max|x|/top, rint(x/scale)."""
    out = np.empty_like(x)
    for s in range(0, x.size, BLOCK):
        b = x[s:s + BLOCK]
        if not np.isfinite(b).all():
            out[s:s + BLOCK] = np.nan
            continue
        scale = np.float32(np.abs(b).max() / np.float32(top))
        out[s:s + BLOCK] = 0 if scale == 0 else np.clip(np.rint(b / scale), -top, top) * scale
    return out


floats = st.floats(-1e4, 1e4, width=32, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(st.lists(floats, min_size=0, max_size=700))
def test_the_formats_match_numpy_and_a_blockwise_reference(values):
    x = np.array(values, np.float32)
    np.testing.assert_array_equal(roundtrip(x, "bf16"),
                                  x.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(roundtrip(x, "fp16"), x.astype(np.float16).astype(np.float32))
    for wire, top in (("int8", 127), ("int4", 7)):
        got = roundtrip(x, wire)
        np.testing.assert_allclose(got, int8_reference(x, top), rtol=1e-6, atol=1e-30)
        for s in range(0, x.size, BLOCK):  # the error is at most half a step of its block
            b = x[s:s + BLOCK]
            assert np.abs(got[s:s + BLOCK] - b).max() <= np.abs(b).max() / (2 * top) * 1.0001 \
                + 1e-30


def test_the_half_codec_gives_numpys_bits_with_or_without_f16c():
    """The compiled fp16 codec over a spread of every float32 bit pattern (one in 257, so
    every exponent and the round-to-even ties): F16C and plain C agree bit for bit; both equal
    numpy's cast except for NaNs (a quiet NaN with the payload's top bits, stated); decoding
    every half is exact and the same both ways."""
    from ferro_collective import _wire

    bits = np.arange(0, 2**32, 257, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([bits, np.array([0x33000000, 0x33000001, 0x387fe000, 0x387ff000,
                                           0x477fefff, 0x477ff000, 0x477fe000, 0x7f800001,
                                           0xffc00000, 0x7fa00000], np.uint32)])
    x = bits.view(np.float32)
    fast, plain = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16)
    _wire.encode_fp16(x, fast)
    _wire.encode_fp16(x, plain, plain=True)
    np.testing.assert_array_equal(fast, plain)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(fast[~nan], want[~nan])
    q = ((bits[nan] >> 16) & 0x8000) | 0x7E00 | ((bits[nan] & 0x7FFFFF) >> 13)
    np.testing.assert_array_equal(fast[nan], q.astype(np.uint16))
    halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    for op in (_wire.COPY, _wire.SUM, _wire.MAX, _wire.MIN, _wire.PRODUCT):
        acc = [np.linspace(-3, 3, halves.size, dtype=np.float32) for _ in range(2)]
        _wire.decode_fp16_into(halves, acc[0], op)
        _wire.decode_fp16_into(halves, acc[1], op, plain=True)
        np.testing.assert_array_equal(acc[0].view(np.uint32), acc[1].view(np.uint32))
        ref = np.linspace(-3, 3, halves.size, dtype=np.float32)
        v = halves.view(np.float16).astype(np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            ref = {_wire.COPY: v, _wire.SUM: ref + v, _wire.MAX: np.maximum(ref, v),
                   _wire.MIN: np.minimum(ref, v), _wire.PRODUCT: ref * v}[op]
        np.testing.assert_array_equal(acc[0], ref)  # (NaN where numpy has NaN)
    assert isinstance(_wire.HAVE_F16C, bool)


def test_non_finite_values_are_stated_per_format():
    x = np.zeros(3 * BLOCK, np.float32)
    x[:] = 1.5
    x[BLOCK + 7] = np.nan
    x[2 * BLOCK + 3] = np.inf
    for wire in ("int8", "int4"):  # a block holding a NaN or an inf is NaN; the others not
        got = roundtrip(x, wire)
        assert np.isnan(got[BLOCK:]).all() and np.all(got[:BLOCK] == 1.5)
    for wire in ("bf16", "fp16"):  # NaN and inf go through as themselves
        got = roundtrip(x, wire)
        assert np.isnan(got[BLOCK + 7]) and got[2 * BLOCK + 3] == np.inf
    with np.errstate(over="ignore"):
        assert roundtrip(np.array([1e5, -1e5], np.float32), "fp16").tolist() == [np.inf, -np.inf]
    assert roundtrip(np.array([1e38], np.float32), "bf16")[0] == np.float32(
        np.array(1e38, np.float32).astype(ml_dtypes.bfloat16))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(width=32), min_size=1, max_size=600), st.integers(0, 2**32 - 1),
       st.sampled_from(["SUM", "MAX", "MIN", "PRODUCT"]),
       st.sampled_from(["bf16", "int8", "int4"]))
def test_the_kernels_fold_as_numpy_does(values, seed, op, wire):
    # decode-and-fold (the compiled kernel) against numpy's ufunc on the decoded values; NaN
    # and inf included (MAX/MIN: a NaN wins, as numpy.maximum/minimum)
    from ferro_collective import _wire

    x = np.array(values, np.float32)
    acc = np.random.default_rng(seed).standard_normal(x.size).astype(np.float32)
    acc[::7] = np.nan
    want = {"SUM": np.add, "MAX": np.maximum, "MIN": np.minimum,
            "PRODUCT": np.multiply}[op](acc, decode(encode(x, wire), wire, x.size))
    buf = encode(x, wire)
    with np.errstate(all="ignore"):
        blocks = -(-x.size // BLOCK)
        if wire == "bf16":
            _wire.decode_bf16_into(buf.view(np.uint16), acc, getattr(_wire, op))
        elif wire == "int8":
            _wire.decode_int8_into(buf[:blocks * 4].view(np.float32),
                                   buf[blocks * 4:].view(np.int8), acc, getattr(_wire, op))
        else:
            _wire.decode_int4_into(buf[:blocks * 4].view(np.float32), buf[blocks * 4:], acc,
                                   getattr(_wire, op))
    np.testing.assert_array_equal(acc, want)


def test_a_short_output_is_refused_not_overrun():
    from ferro_collective import _wire

    with pytest.raises(ValueError, match="encode_bf16: out: 3 values, need 4"):
        _wire.encode_bf16(np.ones(4, np.float32), np.empty(3, np.uint16))
    with pytest.raises(ValueError, match="encode_int8: q: 255 values, need 256"):
        _wire.encode_int8(np.ones(10, np.float32), np.empty(1, np.float32),
                          np.empty(255, np.int8))


def expected_allreduce(xs, wire, op):
    """What every rank must get: each rank's input through the wire, folded in rank order in
    float32, the fold through the wire again (int8 blocks counted from the start)."""
    fold = {ReduceOp.SUM: np.add, ReduceOp.MEAN: np.add, ReduceOp.MAX: np.maximum,
            ReduceOp.MIN: np.minimum}[op]
    acc = roundtrip(xs[0], wire).copy()
    for x in xs[1:]:
        acc = fold(acc, roundtrip(x, wire))
    if op is ReduceOp.MEAN:
        acc = acc / np.float32(len(xs))
    return roundtrip(acc, wire)


def inputs(n, size, dtype, seed=0):
    g = np.random.default_rng(seed)
    return [(g.standard_normal(size) * 10.0 ** g.integers(-3, 3)).astype(dtype) for _ in range(n)]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 4), size=st.integers(1, 1300), wire=st.sampled_from(WIRES),
       op=st.sampled_from([ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX, ReduceOp.MIN]),
       dtype=st.sampled_from([np.float32, np.float64, np.float16]))
def test_allreduce_on_the_wire_equals_the_reference_on_every_rank(n, size, wire, op, dtype):
    xs = inputs(n, size, dtype)
    got = run_ranks(lambda b: fc.allreduce(xs[b.rank].reshape(size, 1), b, op, wire=wire), n)
    want = expected_allreduce(xs, wire, op).astype(dtype).reshape(size, 1)
    for g in got:
        assert g.dtype == dtype and g.shape == (size, 1)
        assert g.tobytes() == got[0].tobytes()  # the same bits everywhere
        np.testing.assert_array_equal(g, want)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 4), rows=st.integers(1, 300), wire=st.sampled_from(WIRES))
def test_reduce_scatter_and_all_gather_on_the_wire(n, rows, wire):
    xs = inputs(n, n * rows * 2, np.float32, seed=rows)
    got = run_ranks(lambda b: fc.reduce_scatter(xs[b.rank].reshape(n * rows, 2), b,
                                                wire=wire), n)
    for r, g in enumerate(got):
        part = [x.reshape(n * rows, 2)[r * rows:(r + 1) * rows].reshape(-1) for x in xs]
        acc = roundtrip(part[0], wire).copy()
        for p in part[1:]:
            acc += roundtrip(p, wire)
        np.testing.assert_array_equal(g, acc.reshape(rows, 2))
    got = run_ranks(lambda b: fc.all_gather(xs[b.rank][:rows], b, wire=wire), n)
    want = np.concatenate([roundtrip(x[:rows], wire) for x in xs])
    for g in got:
        np.testing.assert_array_equal(g, want)


def test_out_and_a_zero_size_input():
    out = [np.empty(5, np.float32) for _ in range(2)]
    got = run_ranks(lambda b: fc.allreduce(np.ones(5, np.float32), b, wire="int8",
                                           out=out[b.rank]), 2)
    assert got[0] is out[0] and got[1] is out[1] and out[0].tolist() == [2.0] * 5
    got = run_ranks(lambda b: fc.allreduce(np.zeros((0, 3)), b, wire="bf16"), 2)
    assert got[0].shape == (0, 3)


def test_bad_arguments_are_named():
    def call(fn):
        return run_ranks(fn, 1)[0]

    with pytest.raises(ValueError, match="wire='int2' is not a wire format"):
        call(lambda b: fc.allreduce(np.ones(3), b, wire="int2"))
    with pytest.raises(TypeError, match="wire formats compress float dtypes, not int64"):
        call(lambda b: fc.allreduce(np.ones(3, np.int64), b, wire="bf16"))
    with pytest.raises(TypeError, match="ReduceOp.BAND is not defined with a wire format"):
        call(lambda b: fc.allreduce(np.ones(3), b, ReduceOp.BAND, wire="bf16"))
    with pytest.raises(ValueError, match="algorithm='ring' and wire='fp16' together"):
        call(lambda b: fc.allreduce(np.ones(3), b, algorithm="ring", wire="fp16"))
    with pytest.raises(fc.SizeMismatchError, match=r"out is float64\[4\], the result is float64\[3\]"):
        call(lambda b: fc.allreduce(np.ones(3), b, wire="fp16", out=np.empty(4)))
    with pytest.raises(fc.SizeMismatchError, match=r"out is float32\[3\], the result is float64"):
        call(lambda b: fc.allreduce(np.ones(3), b, wire="fp16", out=np.empty(3, np.float32)))
    with pytest.raises(TypeError, match="out must be a numpy array, got list"):
        call(lambda b: fc.allreduce(np.ones(3), b, wire="fp16", out=[0.0] * 3))
    with pytest.raises(ValueError, match="not divisible by the world size 2"):
        run_ranks(lambda b: fc.reduce_scatter(np.ones(3), b, wire="bf16"), 2)


def test_an_op_by_name_is_taken_with_a_wire_as_without():
    def body(b):
        x = np.arange(4, dtype=np.float32) + b.rank
        got = []
        for name, op in [("max", ReduceOp.MAX), ("Mean", ReduceOp.MEAN), ("sum", ReduceOp.SUM),
                         ("min", ReduceOp.MIN)]:
            want = fc.allreduce(x, b, op, wire="bf16").tolist()
            got.append(fc.allreduce(x, b, name, wire="bf16").tolist() == want)
            got.append(fc.allreduce_async(x, b, name, wire="int8").wait().tolist()
                       == fc.allreduce(x, b, op, wire="int8").tolist())
            got.append(fc.reduce_scatter(x, b, name, wire="fp16").tolist()
                       == fc.reduce_scatter(x, b, op, wire="fp16").tolist())
            got.append(fc.reduce_scatter_async(x, b, name, wire="bf16").wait().tolist()
                       == fc.reduce_scatter(x, b, op, wire="bf16").tolist())
        return got

    assert run_ranks(body, 2, timeout=60) == [[True] * 16] * 2
    errors = collect(lambda b: fc.allreduce(np.ones(3, np.float32), b,
                                            "median" if b.rank else "max", wire="bf16",
                                            timeout=10), 2)
    assert isinstance(errors[1], ValueError) and "unknown reduce op 'median'" in str(errors[1])
    assert isinstance(errors[0], fc.CollectiveMismatchError), errors[0]
    assert "rank 1 refused the call" in str(errors[0])


def test_ranks_that_disagree_on_the_wire_get_the_mismatch_error():
    errors = collect(lambda b: fc.allreduce(np.ones(600, np.float32), b, timeout=10,
                                            wire="bf16" if b.rank else "int8"), 2)
    assert len(errors) == 2, errors
    assert all(isinstance(e, fc.CollectiveMismatchError) for e in errors.values()), errors


def test_a_failed_background_call_keeps_the_order_of_the_calls_after_it():
    """``allreduce_async(..., wire=)`` whose first collective fails on every rank (the ranks
    disagree on the wire): every rank raises the mismatch at ``wait``, its later collectives
    ran all the same (on zeros), so the next calls meet; a bad ``out=`` on one rank is
    refused there when the call is made, and its peer's ``wait`` raises the mismatch naming
    it (no rank returns a result from a call another rank refused)."""
    def body(b):
        failed = fc.allreduce_async(np.ones(600, np.float32), b, timeout=10,
                                    wire="bf16" if b.rank else "int8")
        with pytest.raises(fc.CollectiveMismatchError):
            failed.wait(30)
        after = fc.allreduce(np.full(3, b.rank + 1.0), b, timeout=10)
        def bad():
            return fc.all_gather_async(np.ones(4, np.float32), b, wire="fp16", timeout=10,
                                       out=np.empty(3 if b.rank else 8, np.float32))

        if b.rank:
            with pytest.raises(fc.SizeMismatchError, match=r"all_gather: out is float32\[3\]"):
                bad()
        else:
            with pytest.raises(fc.CollectiveMismatchError, match=r"rank 1 refused the call "
                               r"\(SizeMismatchError: out is float32\[3\]"):
                bad().wait(30)
        return after.tolist(), fc.allreduce(np.ones(2), b, timeout=10).tolist()

    assert run_ranks(body, 2) == [([3.0] * 3, [2.0] * 2)] * 2


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_real_processes_get_the_reference(transport):
    assert run_processes(wire_fns.suite, 3, transport=transport, timeout=90) == [[]] * 3


def test_on_two_nodes_only_the_cross_node_stage_is_on_the_wire():
    from ferro_backend.engine import AVAILABLE

    if not AVAILABLE:
        pytest.skip("the node stages need the engine (Linux)")
    assert run_processes(wire_fns.hierarchical, 4, ("a", "a", "b", "b")) == [[]] * 4
    # the nodes' ranks interleaved: the reduce_scatter's blocks regrouped by local index
    assert run_processes(wire_fns.hierarchical, 4, ("a", "b", "a", "b")) == [[]] * 4


@pytest.mark.parametrize("workers", ["1", "4"])
def test_a_multi_node_allreduce_in_pieces_overlaps_its_cross_stages(workers, monkeypatch):
    """The node stages of every piece first, the cross-node stages at once: the same bits as
    one piece, with one async worker too (every job waits only for jobs queued before it)."""
    from ferro_backend.engine import AVAILABLE

    if not AVAILABLE:
        pytest.skip("the node stages need the engine (Linux)")
    monkeypatch.setenv("FERRO_ASYNC_WORKERS", workers)
    assert run_processes(wire_fns.hierarchical_pieces, 4, ("a", "b", "a", "b")) == [[]] * 4


def traced_events(tmp_path, calls) -> list[dict]:
    """``calls(b)`` on 2 simulated ranks with rank 0 traced: rank 0's complete events."""
    import json

    from ferro_backend import SimulatedBackend, trace
    from ferro_backend.testing import run_threads

    path = tmp_path / "t.json"

    def body(b):
        if b.rank == 0:
            with trace(path, backend=b):
                calls(b)
        else:
            calls(b)

    run_threads(body, SimulatedBackend.create_group(2), timeout=60)
    return [e for e in json.loads(path.read_text())["traceEvents"]
            if e["ph"] == "X" and e["args"].get("rank") == 0]


def traced_on_rank_0(tmp_path, calls) -> list[tuple[str, dict]]:
    """Rank 0's compressed calls' events (name, args) (:func:`traced_events`)."""
    return [(e["name"], e["args"]) for e in traced_events(tmp_path, calls) if "[" in e["name"]]


def test_the_timeline_records_the_bytes_before_and_after_compression(tmp_path):
    x = np.ones(1000, np.float32)
    events = dict(traced_on_rank_0(tmp_path, lambda b: (fc.allreduce(x, b, wire="int8"),
                                                        fc.all_gather(x, b, wire="bf16"))))
    assert events["allreduce[int8]"]["bytes"] == 4000
    # 2 chunks of 500 values, each padded to 2 blocks of 256 with a scale each
    assert events["allreduce[int8]"]["wire_bytes"] == 2 * (512 + 2 * 4)
    assert events["all_gather[bf16]"]["wire_bytes"] == 2000


def test_wire_bytes_are_the_bytes_encoded_and_async_calls_show_their_collectives(tmp_path):
    """int8/int4 chunks are padded to whole blocks (wire_bytes said the unpadded size: 780
    for 600 int8 values on 2 ranks, which encode 1040); an async compressed call is a
    collective.async event above its collectives (they were missing)."""
    def calls(b):
        fc.allreduce(np.ones(600, np.float32), b, wire="int8")
        fc.allreduce(np.ones(10, np.float32), b, wire="int4")
        fc.reduce_scatter(np.ones(1200, np.float32), b, wire="int8")
        fc.allreduce_async(np.ones(600, np.float32), b, wire="int8").wait(timeout=30)

    events = traced_events(tmp_path, calls)
    wired = [(e["name"], e["cat"], e["args"]["wire_bytes"]) for e in events if "[" in e["name"]]
    assert wired == [("allreduce[int8]", "collective", 2 * (512 + 2 * 4)),
                     ("allreduce[int4]", "collective", 2 * (128 + 4)),
                     ("reduce_scatter[int8]", "collective", 2 * (768 + 3 * 4)),
                     ("allreduce[int8]", "collective.async", 2 * (512 + 2 * 4))]
    parent = next(e for e in events if e["cat"] == "collective.async" and "[" in e["name"])
    inside = sorted(e["name"] for e in events if "[" not in e["name"]
                    and parent["ts"] <= e["ts"] <= parent["ts"] + parent["dur"]
                    and e["cat"].startswith("collective"))
    assert inside == ["all_gather", "all_to_all_single"], inside


def test_a_compressed_call_that_failed_says_so_on_the_timeline(tmp_path):
    """A compressed call that raised (here: the ranks disagree on its size) is an event with
    ``error=<type>``, in one piece and in pieces, blocking and async (it looked like a
    success)."""
    from test_wire_pieces import small_pieces

    from ferro_backend import CollectiveMismatchError

    def calls(b):
        for wire, n, pieces in (("int8", 600, False), ("bf16", 1000, True)):
            x = np.ones(n + 100 * b.rank, np.float32)
            for background in (False, True):
                with small_pieces() if pieces else contextlib.nullcontext():
                    with pytest.raises(CollectiveMismatchError):
                        if background:
                            fc.allreduce_async(x, b, wire=wire, timeout=20).wait(20)
                        else:
                            fc.allreduce(x, b, wire=wire, timeout=20)

    events = traced_events(tmp_path, calls)
    failed = [(e["name"], e["cat"], e["args"].get("error")) for e in events if "[" in e["name"]]
    assert failed == [("allreduce[int8]", "collective", "CollectiveMismatchError"),
                      ("allreduce[int8]", "collective.async", "CollectiveMismatchError"),
                      ("allreduce[bf16]", "collective", "CollectiveMismatchError"),
                      ("allreduce[bf16]", "collective.async", "CollectiveMismatchError")]
