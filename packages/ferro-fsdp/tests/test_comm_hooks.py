"""DDP communication hooks (ferro_fsdp.comm_hooks): the default reduction as a hook, fp16 and
bf16 compression, PowerSGD (exact before its start, the same bits on every rank, error feedback
that loses nothing over the steps, a state that resumes exactly), and their errors."""

import numpy as np
import pytest
from _helpers import make_data, make_mlp, run

import ferro_collective as fc
from ferro_collective import ReduceOp
from ferro_fsdp import DDP, nn
from ferro_fsdp.comm_hooks import (
    PowerSGDState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    powerSGD_hook,
)

DIMS = (12, 40, 30, 5)


def step_grads(d, b, x, y):
    """One backward of ``d`` on this rank's quarter of the batch; the gradients (copies)."""
    loss_fn = nn.CrossEntropyLoss()
    sl = slice(4 * b.rank, 4 * b.rank + 4)
    loss_fn(d(x[sl]), y[sl])
    d.backward(loss_fn.backward())
    return [p.grad.copy() for p in d.module.parameters()]


def powersgd_trained(b, x, y, steps: int, **kw) -> PowerSGDState:
    """A PowerSGD state (``start_powerSGD_iter=1``, ``kw``) after ``steps`` DDP steps of the MLP
    on this rank's quarter of ``x, y``."""
    state = PowerSGDState(b, start_powerSGD_iter=1, **kw)
    d = DDP(make_mlp(DIMS, dtype=np.float32), b)  # one bucket
    d.register_comm_hook(state, powerSGD_hook)
    for _ in range(steps):
        for p in d.module.parameters():
            p.grad = None
        step_grads(d, b, x, y)
    return state


def local_grads(b, x, y):
    """This rank's own gradients (no DDP), flattened in the DDP bucket's order."""
    m = make_mlp(DIMS, dtype=np.float32)
    loss_fn = nn.CrossEntropyLoss()
    sl = slice(4 * b.rank, 4 * b.rank + 4)
    loss_fn(m(x[sl]), y[sl])
    m.backward(loss_fn.backward())
    return [p.grad for p in m.parameters()]


@pytest.mark.parametrize("background", [False, True], ids=["in_thread", "background"])
@pytest.mark.parametrize("hook, wire", [(allreduce_hook, None), (fp16_compress_hook, "fp16"),
                                        (bf16_compress_hook, "bf16")])
def test_the_simple_hooks_give_the_wire_allreduce_of_the_bucket(hook, wire, background):
    x, y = make_data(16, DIMS, dtype=np.float32)

    def body(b):
        d = DDP(make_mlp(DIMS, dtype=np.float32), b, background=background)
        d.register_comm_hook(None, hook)
        got = step_grads(d, b, x, y)
        # the reference: this rank's bucket (reverse parameter order), reduced with the wire
        mine = local_grads(b, x, y)
        order = list(reversed(range(len(mine))))
        flat = np.concatenate([mine[i].reshape(-1) for i in order])
        want = fc.allreduce(flat, b, ReduceOp.MEAN, wire=wire)
        return got, want, order

    results = run(body, 3)
    for got, want, order in results:
        offset = 0
        for i in order:
            np.testing.assert_array_equal(got[i].reshape(-1), want[offset:offset + got[i].size])
            offset += got[i].size
        for a, b_ in zip(got, results[0][0]):
            assert a.tobytes() == b_.tobytes()


@pytest.mark.parametrize("background", [False, True], ids=["in_thread", "background"])
def test_the_simple_hooks_follow_the_ddps_background_and_overlap_the_backward(background):
    """In the background the bucket's allreduce is still running when the hook returns (rank 1
    is late: it starts its step only once rank 0's first hook has returned) and the backward
    goes on; in the training thread it is done."""
    import threading

    x, y = make_data(16, DIMS, dtype=np.float32)
    late = threading.Event()  # rank 0's first hook has returned

    def body(b):
        seen = []

        def watching(state, bucket):
            work = bf16_compress_hook(state, bucket)
            seen.append((bucket.background(), work.is_completed()))
            if b.rank == 0:
                late.set()
            return work

        d = DDP(make_mlp(DIMS, dtype=np.float32), b, background=background, bucket_cap_mb=1e-3)
        d.register_comm_hook(None, watching)
        if b.rank == 1:
            # in the background rank 1 waits for rank 0's first hook (not a fixed 0.3 s, which a
            # stalled rank 0 outlasted); in the training thread that hook waits for rank 1, so
            # rank 1 is late by 0.3 s only
            late.wait(30 if background else 0.3)
        return seen, step_grads(d, b, x, y)

    results = run(body, 2)
    seen, grads = results[0]
    assert len(seen) > 1 and all(bg == background for bg, _ in seen), seen
    assert seen[0][1] == (not background), seen  # rank 0's first bucket waits on rank 1
    for a, b_ in zip(grads, results[1][1]):
        assert a.tobytes() == b_.tobytes()


def test_powersgd_is_exact_before_its_start_then_compresses_the_matrices():
    x, y = make_data(16, DIMS, dtype=np.float32)

    def body(b):
        state = PowerSGDState(b, matrix_approximation_rank=1, start_powerSGD_iter=1)
        d = DDP(make_mlp(DIMS, dtype=np.float32), b)
        d.register_comm_hook(state, powerSGD_hook)
        first = step_grads(d, b, x, y)
        for p in d.module.parameters():
            p.grad = None
        second = step_grads(d, b, x, y)
        exact = DDP(make_mlp(DIMS, dtype=np.float32), b)
        return first, second, step_grads(exact, b, x, y), state.iter

    results = run(body, 2)
    for first, second, exact, steps in results:
        assert steps == 2
        for a, e in zip(first, exact):  # step 1: before start_powerSGD_iter
            np.testing.assert_array_equal(a, e)
        for a, e in zip(second, exact):
            if a.ndim == 1:  # vectors stay exact (error feedback added first: the same here)
                np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)
            else:  # rank 1: the matrix is approximated, not equal
                assert np.linalg.matrix_rank(a.astype(np.float64), tol=1e-5) == 1
                assert not np.allclose(a, e)
        for a, b_ in zip(second, results[0][1]):
            assert a.tobytes() == b_.tobytes()  # the same bits on every rank


def test_a_matrix_at_exactly_the_minimum_rate_is_averaged_exactly_as_torchs():
    # torch compresses only when (n + m) r min_compression_rate < n m: a 4x4 matrix at rank 1
    # and rate 2 (16 == 16) stays exact (ferro approximated it)
    from ferro_fsdp import Module, Parameter

    class Square(Module):
        def __init__(self, rank):
            super().__init__()
            self.w = Parameter(np.zeros((4, 4)))
            self.rank = rank

        def forward(self, x):
            return x

        def backward(self, g):
            self.w.accumulate_grad(np.random.default_rng(self.rank).standard_normal((4, 4)))
            return g

    def body(b):
        m = Square(b.rank)
        d = DDP(m, b)
        d.register_comm_hook(PowerSGDState(b, matrix_approximation_rank=1, start_powerSGD_iter=0,
                                           min_compression_rate=2), powerSGD_hook)
        d(np.zeros(1))
        d.backward(np.zeros(1))
        return m.w.grad

    want = np.mean([np.random.default_rng(r).standard_normal((4, 4)) for r in range(2)], axis=0)
    for got in run(body, 2):
        np.testing.assert_allclose(got, want, rtol=1e-14)


def test_error_feedback_loses_nothing_over_the_steps():
    # the same gradients every step: the steps' applied means plus the ranks' mean error left
    # equal T times the exact mean, and the error stays bounded
    g = [np.random.default_rng(r).standard_normal((30, 20)).astype(np.float64) for r in range(3)]
    steps = 40

    def body(b):
        from ferro_fsdp.comm_hooks import GradBucket

        state = PowerSGDState(b, start_powerSGD_iter=0, min_compression_rate=1)
        total = np.zeros(600)
        norms = []
        for _ in range(steps):
            flat = g[b.rank].reshape(-1).copy()
            bucket = GradBucket(0, flat, [type("P", (), {"data": g[b.rank]})()], True, b)
            total += powerSGD_hook(state, bucket).wait()
            norms.append(np.linalg.norm(state.error_dict[0]))
        return total, state.error_dict[0].copy(), norms

    results = run(body, 3)
    mean_g = np.mean([x.reshape(-1) for x in g], axis=0)
    mean_err = np.mean([err for _, err, _ in results], axis=0)
    np.testing.assert_allclose(results[0][0] + mean_err, steps * mean_g, rtol=1e-9, atol=1e-9)
    for total, _, norms in results:
        assert total.tobytes() == results[0][0].tobytes()
        assert max(norms[steps // 2:]) < 3 * max(norms[:steps // 2])  # bounded, not growing


def test_a_resumed_powersgd_state_continues_exactly():
    x, y = make_data(16, DIMS, dtype=np.float32)

    def steps(d, b, k):
        out = []
        for _ in range(k):
            for p in d.module.parameters():
                p.grad = None
            out.append(step_grads(d, b, x, y))
        return out

    def body(b):
        state = PowerSGDState(b, start_powerSGD_iter=1)
        d = DDP(make_mlp(DIMS, dtype=np.float32), b)
        d.register_comm_hook(state, powerSGD_hook)
        steps(d, b, 3)
        saved = state.state_dict()
        later = steps(d, b, 2)
        resumed = PowerSGDState(b, start_powerSGD_iter=1)
        resumed.load_state_dict(saved)
        d2 = DDP(make_mlp(DIMS, dtype=np.float32), b)
        d2.register_comm_hook(resumed, powerSGD_hook)
        again = steps(d2, b, 2)
        return later, again, saved

    for later, again, saved in run(body, 2):
        assert saved["iter"] == 3 and "error/0" in saved and "q/0" in saved
        for s1, s2 in zip(later, again):
            for a, b_ in zip(s1, s2):
                assert a.tobytes() == b_.tobytes()


def test_a_state_restored_under_another_bucket_plan_starts_its_errors_afresh():
    """A resumed run whose buckets are cut otherwise (another ``bucket_cap_mb``): each saved
    error that no longer fits its bucket starts afresh, with a warning naming the bucket (it
    failed in numpy's broadcasting before), and the step is the fresh state's."""
    x, y = make_data(16, DIMS, dtype=np.float32)

    def body(b):
        state = powersgd_trained(b, x, y, 2)
        grads = []
        for saved in (state.state_dict(), None):
            s2 = PowerSGDState(b, start_powerSGD_iter=1)
            if saved is not None:
                s2.load_state_dict(saved)
                s2.q_memory_dict = {}  # (Qs of another size start afresh by themselves)
            d2 = DDP(make_mlp(DIMS, dtype=np.float32), b, bucket_cap_mb=0.001)
            d2.register_comm_hook(s2, powerSGD_hook)
            s2.iter = 5
            grads.append(step_grads(d2, b, x, y))
            assert len(d2.buckets) > 1
        return grads

    with pytest.warns(RuntimeWarning, match=r"powerSGD_hook: the error feedback of bucket 0 "
                                            r"has \d+ values, the bucket \d+ .* it starts afresh"):
        got = run(body, 2)
    for restored, fresh in got:
        assert [g.tobytes() for g in restored] == [g.tobytes() for g in fresh]


def test_the_sharded_state_is_each_ranks_row_and_a_new_world_starts_it_afresh():
    """``sharded_state_dict``: every array a row of a tensor of world-size rows (each rank's
    own error feedback); loaded as the same world restores it: the state whole; as another
    world restores it (rows not a rank's own): the step count kept on every rank, errors and
    Qs afresh, on every rank alike."""
    x, y = make_data(16, DIMS, dtype=np.float32)

    def body(b):
        state = powersgd_trained(b, x, y, 3)
        rows, specs = state.sharded_state_dict()
        same = PowerSGDState(b, start_powerSGD_iter=1)
        whole = same.load_sharded_state_dict({**rows, "model.w": np.zeros(2)})
        # another world's restore: rank 0 got both rows, rank 1 none
        other = PowerSGDState(b, start_powerSGD_iter=1)
        reshaped = {k: (np.concatenate([v, v]) if b.rank == 0 else v[:0]) for k, v in rows.items()}
        lost = other.load_sharded_state_dict(reshaped)
        return (state, rows, specs, same, whole, other, lost, sorted(reshaped))

    out = run(body, 2)
    for state, rows, specs, same, whole, other, lost, left in out:
        assert set(rows) == set(specs) and "powersgd.iter" in rows and "powersgd.error.0" in rows
        assert all(v.shape[0] == 1 and specs[k] == ((2, *v.shape[1:]), 0, [1, 1])
                   for k, v in rows.items())
        assert whole and same.iter == state.iter == 3 and left == []
        for k, v in state.error_dict.items():
            assert same.error_dict[k].tobytes() == v.tobytes()
        for k, v in state.q_memory_dict.items():
            assert same.q_memory_dict[k].tobytes() == v.tobytes()
        assert not lost and other.iter == 3 and not other.error_dict and not other.q_memory_dict
    errors = [o[0].error_dict[0] for o in out]
    assert errors[0].tobytes() != errors[1].tobytes()  # (the ranks' own: they differ)


def test_the_sharded_state_refuses_another_rank_or_seed_as_load_state_dict_does():
    """``sharded_state_dict`` saves the approximation rank and seed, and
    ``load_sharded_state_dict`` refuses a state saved with others (as ``load_state_dict``):
    it took a rank-1 state into a rank-2 one without a word, and where the Qs' total size
    happened to fit (rank 1's Qs of a 40x16 and a 3x16 matrix, 32 values, where rank 2
    compresses the first alone: its 16x2 Q) reused them as another warm-start Q. Refused on every rank
    (also where another world's restore gave a rank no row), before it takes anything; a
    checkpoint without them (written before they were saved) loads as before."""
    x, y = make_data(16, DIMS, dtype=np.float32)

    def body(b):
        state = powersgd_trained(b, x, y, 2, matrix_approximation_rank=1)
        rows, specs = state.sharded_state_dict()
        refused = []
        regrouped = {k: (np.concatenate([v, v]) if b.rank == 0 else v[:0])
                     for k, v in rows.items()}  # another world's restore
        for kw, tensors in (({"matrix_approximation_rank": 2}, rows),
                            ({"random_seed": 3}, rows),
                            ({"matrix_approximation_rank": 2}, regrouped)):
            other = PowerSGDState(b, start_powerSGD_iter=1, **kw)
            given = dict(tensors)
            with pytest.raises(ValueError) as e:
                other.load_sharded_state_dict(given)
            refused.append(str(e.value))
            assert given.keys() == tensors.keys()  # nothing taken
            assert other.iter == 0 and not other.error_dict and not other.q_memory_dict
        old = PowerSGDState(b, matrix_approximation_rank=2, start_powerSGD_iter=1)
        accepted = old.load_sharded_state_dict(
            {k: v for k, v in rows.items() if k not in ("powersgd.rank", "powersgd.random_seed")})
        return rows, specs, refused, accepted, old.iter

    for rows, specs, refused, accepted, it in run(body, 2):
        assert rows["powersgd.rank"].tolist() == [[1]]
        assert rows["powersgd.random_seed"].tolist() == [[0]]
        assert specs["powersgd.rank"] == ((2, 1), 0, [1, 1])
        assert refused == ["PowerSGDState.load_sharded_state_dict: saved with rank 1, this "
                           "state has 2",
                           "PowerSGDState.load_sharded_state_dict: saved with random_seed 0, "
                           "this state has 3",
                           "PowerSGDState.load_sharded_state_dict: saved with rank 1, this "
                           "state has 2"]
        assert accepted and it == 2


@pytest.mark.parametrize("sharded", [False, True], ids=["state_dict", "sharded"])
def test_errors_and_qs_this_state_does_not_use_are_not_restored(sharded):
    """Restored into a state with ``use_error_feedback=False`` the errors (``warm_start=False``:
    the Qs) were kept, never used nor updated, and re-saved unchanged by every later save; a
    resume of such a one with error feedback on added an error many steps old. Now they are
    dropped; what the state uses is restored as before."""
    x, y = make_data(16, DIMS, dtype=np.float32)

    def body(b):
        state = powersgd_trained(b, x, y, 2)
        got = []
        for kw in ({"use_error_feedback": False}, {"warm_start": False}, {}):
            other = PowerSGDState(b, start_powerSGD_iter=1, **kw)
            if sharded:
                assert other.load_sharded_state_dict(dict(state.sharded_state_dict()[0]))
            else:
                other.load_state_dict(state.state_dict())
            d2 = DDP(make_mlp(DIMS, dtype=np.float32), b)
            d2.register_comm_hook(other, powerSGD_hook)
            for p in d2.module.parameters():
                p.grad = None
            step_grads(d2, b, x, y)  # a step later
            got.append(sorted(other.sharded_state_dict()[0]) if sharded
                       else sorted(other.state_dict()))
        return got

    error, q = ("powersgd.error.0", "powersgd.q.0") if sharded else ("error/0", "q/0")
    for no_feedback, cold, same in run(body, 2):
        assert error not in no_feedback and q in no_feedback
        assert q not in cold and error in cold
        assert error in same and q in same


def test_errors_are_named():
    def body(b):
        d = DDP(make_mlp(DIMS), b)
        with pytest.raises(TypeError, match="expected a callable"):
            d.register_comm_hook(None, "allreduce")
        d.register_comm_hook(None, allreduce_hook)
        with pytest.raises(RuntimeError, match="registered already"):
            d.register_comm_hook(None, allreduce_hook)
        with pytest.raises(ValueError, match="matrix_approximation_rank 0"):
            PowerSGDState(b, matrix_approximation_rank=0)
        saved = PowerSGDState(b, matrix_approximation_rank=2).state_dict()
        with pytest.raises(ValueError, match="saved with rank 2, this state has 1"):
            PowerSGDState(b).load_state_dict(saved)

        def short(state, bucket):  # a hook whose result is the wrong size
            return fc.allreduce_async(bucket.buffer()[:3], b)

        d2 = DDP(make_mlp(DIMS), b)
        d2.register_comm_hook(None, short)
        x, y = make_data(16, DIMS)
        with pytest.raises(ValueError, match="returned 3 values for a bucket of"):
            step_grads(d2, b, x, y)
        return True

    assert run(body, 2) == [True, True]


def test_float16_columns_past_fp16s_range_are_orthogonalized_not_zeroed():
    """A float16 P whose columns' squared norms pass 65504 (the largest float16): summed in
    float16 they read inf and the columns came out zero; summed in float32 they come out
    orthonormal, as the float32 Gram-Schmidt's result rounded to float16."""
    from ferro_fsdp.powersgd import _orthogonalize

    rng = np.random.default_rng(0)
    p = (rng.standard_normal((64, 3)) * 300).astype(np.float16)
    assert float(np.sum(p[:, 0].astype(np.float32) ** 2)) > 65504
    want = p.astype(np.float32)
    _orthogonalize(want, 0.0)
    with np.errstate(over="raise"):
        _orthogonalize(p, 0.0)
    got = p.astype(np.float32)
    np.testing.assert_allclose(got, want, atol=2e-3)
    np.testing.assert_allclose(got.T @ got, np.eye(3), atol=1e-2)


def test_powersgd_on_float16_parameters_with_large_gradients_keeps_them():
    """DDP of a float16 MLP fed large inputs, PowerSGD rank 2 with error feedback: every step's
    approximated matrix gradients are finite and not zero (the third step's were all zero)."""
    x, y = make_data(16, DIMS, dtype=np.float16)
    x = x * np.float16(300)

    def body(b):
        state = PowerSGDState(b, matrix_approximation_rank=2, start_powerSGD_iter=1)
        d = DDP(make_mlp(DIMS, dtype=np.float16), b)
        d.register_comm_hook(state, powerSGD_hook)
        steps = []
        for _ in range(4):
            steps.append(step_grads(d, b, x, y))
            for p in d.module.parameters():
                p.grad = None
        return steps

    results = run(body, 2)
    for steps in results:
        for grads in steps:
            for g in grads:
                assert np.isfinite(g).all()
                if g.ndim >= 2:
                    assert np.abs(g.astype(np.float32)).max() > 0
    assert [[g.tobytes() for g in s] for s in results[0]] == \
        [[g.tobytes() for g in s] for s in results[1]]  # the same bits on every rank
