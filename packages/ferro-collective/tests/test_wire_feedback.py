"""Error feedback of the compressed allreduce (``feedback=``, ferro_collective.wire.Feedback):
over a series of calls, what each call's two encodings rounded away (each rank's input, each
folded chunk) comes back in the next call's, so the sum of the results equals the exact sum
less the last residuals, on flat and multi-node jobs, blocking and in the background."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rooted import collect

import ferro_collective as fc
from ferro_backend.hierarchy import attach_hierarchy
from ferro_backend.testing import run_ranks
from ferro_collective import ReduceOp
from ferro_collective.wire import Feedback

pytestmark = pytest.mark.timeout(120)
WIRES = ["bf16", "fp16", "int8", "int4"]


def series(b, wire, op, size, calls, feedback, background=False, seed=0):
    """``calls`` allreduces of this rank's fixed input: (their results' float64 sum, the
    input); ``background``: every other call as ``allreduce_async``."""
    rng = np.random.default_rng(seed * 31 + b.rank)
    g = (rng.standard_normal(size) * (1 + b.rank)).astype(np.float32)
    total = np.zeros(size)
    for t in range(calls):
        if background and t % 2:
            total += fc.allreduce_async(g, b, op, wire=wire, feedback=feedback).wait(60)
        else:
            total += fc.allreduce(g, b, op, wire=wire, feedback=feedback)
    return total, g


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 4), size=st.integers(1, 1300), wire=st.sampled_from(WIRES),
       op=st.sampled_from([ReduceOp.SUM, ReduceOp.MEAN]), background=st.booleans())
def test_the_results_sum_to_the_exact_sum_less_the_last_residuals(n, size, wire, op,
                                                                   background):
    calls = 12
    fbs = [Feedback() for _ in range(n)]
    got = run_ranks(lambda b: series(b, wire, op, size, calls, fbs[b.rank], background), n)
    exact = sum(g.astype(np.float64) for _, g in got)
    scale = 1.0 if op is ReduceOp.SUM else 1.0 / n
    # the residuals: every rank's of its input, and the folded chunks', rank r's being chunk r
    sent = sum(fb.sent.astype(np.float64) for fb in fbs) * scale
    folded = np.concatenate([fb.folded for fb in fbs])[:size]
    for total, _ in got:
        assert total.tobytes() == got[0][0].tobytes()  # the same bits everywhere
        np.testing.assert_allclose(total + sent + folded, calls * exact * scale,
                                   rtol=0, atol=1e-4 * calls * (np.abs(exact).max() + 1))


def test_without_it_the_error_grows_with_the_calls_and_with_it_stays_one_calls():
    def error(feedback, calls):
        got = run_ranks(lambda b: series(b, "int4", ReduceOp.SUM, 1000, calls,
                                         Feedback() if feedback else None), 2)
        exact = sum(g.astype(np.float64) for _, g in got)
        return np.abs(got[0][0] - calls * exact).max()

    one = error(False, 1)
    assert error(False, 60) > 20 * one            # no feedback: the errors add up
    assert error(True, 60) < 2 * one              # fed back: one call's, not 60


def test_on_two_nodes_the_cross_node_stage_is_fed_back():
    def run(b, feedback):
        attach_hierarchy(b, ("a", "a", "b", "b"))
        return series(b, "int8", ReduceOp.MEAN, 1000, 40, feedback, background=True)

    fbs = [Feedback() for _ in range(4)]
    fed = run_ranks(lambda b: run(b, fbs[b.rank]), 4)
    plain = run_ranks(lambda b: run(b, None), 4)
    exact = sum(g.astype(np.float64) for _, g in fed) / 4
    assert all(t.tobytes() == fed[0][0].tobytes() for t, _ in fed)
    assert fbs[0].sent.size == 500  # this local rank's slice of the node's sum
    err_fed = np.abs(fed[0][0] - 40 * exact).max()
    err_plain = np.abs(plain[0][0] - 40 * exact).max()
    assert err_fed < err_plain / 10, (err_fed, err_plain)


def test_a_resumed_series_goes_on_with_the_same_bits():
    """Residuals handed to a new Feedback (a resumed run's saved ones) give the bits an
    unbroken series gives."""
    def run(b, split):
        g = np.linspace(-1, 1, 700, dtype=np.float32) * (b.rank + 1)
        fb, results = Feedback(), []
        for t in range(6):
            if t == split:
                fb = Feedback(fb.sent.copy(), fb.folded.copy())
            results.append(fc.allreduce(g, b, wire="int8", feedback=fb))
        return np.concatenate(results)

    unbroken = run_ranks(lambda b: run(b, None), 3)
    resumed = run_ranks(lambda b: run(b, 3), 3)
    assert [r.tobytes() for r in resumed] == [r.tobytes() for r in unbroken]


def test_a_size_change_starts_afresh_and_an_exact_call_leaves_it():
    def run(b):
        fb = Feedback()
        fc.allreduce(np.linspace(0, 1, 600), b, wire="int4", feedback=fb)
        first = fb.sent.copy()
        fc.allreduce(np.ones(3), b, feedback=fb)  # exact: nothing rounded away
        assert np.array_equal(fb.sent, first)
        fc.allreduce(np.ones(10), b, wire="int4", feedback=fb)
        return fb.sent.size, fb.folded.size

    assert run_ranks(run, 2) == [(10, 256), (10, 256)]


def test_bad_feedback_is_refused_on_every_rank():
    errors = collect(lambda b: fc.allreduce(np.ones(4), b, ReduceOp.MAX, wire="int8",
                                            feedback=Feedback(), timeout=10), 2)
    assert all(isinstance(e, ValueError) and "error feedback is for SUM and MEAN" in str(e)
               for e in errors.values()), errors
    errors = collect(lambda b: fc.allreduce(np.ones(4), b, wire="int8",
                                            feedback=np.zeros(4) if b.rank else None,
                                            timeout=10), 2)
    assert isinstance(errors[1], TypeError) and "Feedback, not ndarray" in str(errors[1])
    assert isinstance(errors[0], fc.CollectiveMismatchError), errors
