"""FSDP's wire options: parameters gathered (``weights_wire``) and gradients reduced
(``grads_wire``) in a wire format, with error feedback for int8 / int4 gradients."""

import numpy as np
import pytest
from _helpers import make_data, make_mlp, run

from ferro_fsdp import FSDP, nn

DIMS = (12, 40, 30, 5)


def bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest even) and back, written plainly."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def backward(f, x, y):
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(f(x), y)
    f.backward(loss_fn.backward())
    f.sync_gradients()
    return [np.array(p.grad) for p in f.module.parameters()]


def test_parameters_gathered_in_bf16_compute_with_the_rounded_weights():
    """Every rank computes with the decoded full parameters (its own shard's too); the
    optimizer's shards stay exact."""
    x, y = make_data(8, DIMS, dtype=np.float32)

    def body(b):
        f = FSDP(make_mlp(DIMS, dtype=np.float32), b, "full_shard", weights_wire="bf16",
                 reshard_after_forward=False, background=b.rank == 0)
        shards = [np.array(p.data) for p in f.module.parameters()]
        out = f(x)
        return out, shards, [p.data.copy() for p in f.module.parameters()]

    ref = make_mlp(DIMS, dtype=np.float32)
    exact = ref(x)
    for p in ref.parameters():
        p.data = bf16(p.data)
    want = ref(x)
    for out, shards, after in run(body, 2):
        assert out.tobytes() == want.tobytes()  # the rounded weights, bit for bit
        assert not np.array_equal(out, exact)
        assert all(a.tobytes() == s.tobytes() for a, s in zip(after, shards))


@pytest.mark.parametrize("strategy,wire,background", [
    ("full_shard", "bf16", False), ("full_shard", "int8", True), ("no_shard", "fp16", True),
    ("hybrid_shard", "int8", False), ("shard_grad_op", "bf16", True)])
def test_gradients_reduced_on_the_wire_are_near_the_exact_ones(strategy, wire, background):
    """(in the training thread and in the background: the ``*_async`` forms' ``wire=``)"""
    x, y = make_data(16, DIMS, dtype=np.float32)
    kw = {"intra_node_size": 2} if strategy == "hybrid_shard" else {}
    kw["background"] = background

    def body(b):
        sl = slice(4 * b.rank, 4 * b.rank + 4)
        exact = backward(FSDP(make_mlp(DIMS, dtype=np.float32), b, strategy, **kw), x[sl], y[sl])
        got = backward(FSDP(make_mlp(DIMS, dtype=np.float32), b, strategy, grads_wire=wire, **kw),
                       x[sl], y[sl])
        return exact, got

    for exact, got in run(body, 4):
        for e, g in zip(exact, got):
            step = np.abs(e).max() * {"bf16": 2**-5, "fp16": 2**-8, "int8": 1 / 15}[wire]
            np.testing.assert_allclose(g, e, rtol=0, atol=step + 1e-7)


@pytest.mark.parametrize("strategy,world", [("full_shard", 2), ("no_shard", 2),
                                            ("hybrid_shard", 4)])
def test_int4_gradients_feed_their_error_back_so_the_sum_over_steps_stays_near(strategy,
                                                                              world):
    """The same batch every step, no update: the reduced int4 gradients summed over 12 steps
    differ from 12 exact ones by about one step's rounding (error feedback), not twelve:
    under NO_SHARD and HYBRID_SHARD too (their allreduces' second encoding, of the folded
    chunk, and the cross-replica allreduce are fed back)."""
    x, y = make_data(4 * world, DIMS, dtype=np.float32)
    steps = 12
    kw = {"intra_node_size": 2} if strategy == "hybrid_shard" else {}

    def body(b):
        sl = slice(4 * b.rank, 4 * b.rank + 4)
        exact = backward(FSDP(make_mlp(DIMS, dtype=np.float32), b, strategy, **kw),
                         x[sl], y[sl])
        f = FSDP(make_mlp(DIMS, dtype=np.float32), b, strategy, grads_wire="int4", **kw)
        first = backward(f, x[sl], y[sl])
        total = [g.copy() for g in first]
        for _ in range(steps - 1):
            for p in f.module.parameters():
                p.grad = None
            for t, g in zip(total, backward(f, x[sl], y[sl])):
                t += g
        return exact, first, total

    for exact, first, total in run(body, world):
        one = max(np.abs(g - e).max() for g, e in zip(first, exact))
        summed = max(np.abs(t - steps * e).max() for t, e in zip(total, exact))
        assert one > 0 and summed < 2.5 * one, (one, summed)  # (without feedback: ~12x)


def test_wire_options_are_checked():
    def body(b):
        with pytest.raises(ValueError, match="FSDP weights_wire: wire='int2' is not a wire"):
            FSDP(make_mlp(DIMS, dtype=np.float32), b, weights_wire="int2")
        model = make_mlp(DIMS, dtype=np.float32)
        for p in model.parameters():
            p.data = p.data.astype(np.complex64)
        with pytest.raises(TypeError, match="grads_wire='bf16': wire formats compress real"):
            FSDP(model, b, grads_wire="bf16")
        with pytest.raises(ValueError, match="weights_wire='int8' compresses the parameters' "
                                             "all-gather, and NO_SHARD gathers none"):
            FSDP(make_mlp(DIMS, dtype=np.float32), b, "no_shard", weights_wire="int8")
        return True

    assert run(body, 1) == [True]


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard", "hybrid_shard"])
def test_a_resumed_int8_run_goes_on_with_the_bits_of_an_unbroken_one(strategy):
    """The error feedback is in the sharded state dict: loaded, the next steps give the
    unbroken run's bits; left out, they do not (so the test can tell)."""
    from _helpers import make_opt, train_steps

    world = 4 if strategy == "hybrid_shard" else 2
    kw = {"intra_node_size": 2} if strategy == "hybrid_shard" else {}
    x, y = make_data(4 * world, DIMS, dtype=np.float32)

    def steps(f, opt, b, ks):
        sl = slice(4 * b.rank, 4 * b.rank + 4)
        train_steps(f, opt, nn.CrossEntropyLoss(), x[sl], y[sl], len(ks))
        return [np.array(p.data) for p in f.module.parameters()]

    def fresh(b):
        f = FSDP(make_mlp(DIMS, seed=7, dtype=np.float32), b, strategy, grads_wire="int8",
                 **kw)
        return f, make_opt("adam", f.parameters())

    def body(b):
        f, opt = fresh(b)
        steps(f, opt, b, range(3))
        tensors, specs = f.sharded_state_dict(opt)
        unbroken = steps(f, opt, b, range(3, 6))
        g, opt2 = fresh(b)
        g.load_sharded_state_dict(tensors, opt2)
        resumed = steps(g, opt2, b, range(3, 6))
        h, opt3 = fresh(b)
        h.load_sharded_state_dict({k: v for k, v in tensors.items()
                                   if not k.startswith("wire_error.")}, opt3)
        without = steps(h, opt3, b, range(3, 6))
        keys = {k: specs[k] for k in tensors if k.startswith("wire_error.")}
        return unbroken, resumed, without, keys

    for unbroken, resumed, without, keys in run(body, world):
        assert keys["wire_error.world"] == ((world,), 0, (1,) * world)
        assert len(keys) > 1 and all(full == (world * sizes[0],) for k, (full, _, sizes) in
                                     keys.items() if k != "wire_error.world")
        if strategy != "full_shard":  # the allreduces' own: both encodings'
            assert {k.rpartition("-")[2] for k in keys if "-" in k} == {"sent", "folded"}
        assert [a.tobytes() for a in resumed] == [a.tobytes() for a in unbroken]
        assert [a.tobytes() for a in without] != [a.tobytes() for a in unbroken]


def test_error_feedback_loads_from_full_tensors_and_starts_afresh_on_another_world():
    from types import SimpleNamespace

    from ferro_fsdp import wire_state

    def units():
        return [SimpleNamespace(name="", dtype=np.float32, errors=None, feeds_back=lambda k, n: True),
                SimpleNamespace(name="layers.0", dtype=np.float32, errors=None,
                                feeds_back=lambda k, n: True)]

    full = {"wire_error.world": np.array([2, 2]), "wire_error.layers.0.1": np.arange(6.0)}
    got = units()
    wire_state.load(got, full, 2, 1)  # the full tensors on every rank: this rank's half
    assert got[0].errors is None and got[1].errors[1].tolist() == [3.0, 4.0, 5.0]
    assert got[1].errors[1].dtype == np.float32
    got = units()
    with pytest.warns(RuntimeWarning, match="saved on 2 ranks, this job has 4: it starts afresh"):
        wire_state.load(got, {"wire_error.world": np.array([2]),
                              "wire_error.root.0": np.zeros(3)}, 4, 0)
    assert all(u.errors is None for u in got)
    got = units()  # a unit of another wrap policy: dropped (it raised, after a half load)
    with pytest.warns(RuntimeWarning, match=r"\['wire_error.nothere.0'\] is of another strategy"):
        wire_state.load(got, {"wire_error.world": np.array([1]),
                              "wire_error.nothere.0": np.zeros(3)}, 1, 0)
    assert all(u.errors is None for u in got)
    with pytest.raises(ValueError, match="'wire_error.root.x' names no error feedback residual"):
        wire_state.load(units(), {"wire_error.world": np.array([1]),
                                  "wire_error.root.x": np.zeros(3)}, 1, 0)
    with pytest.raises(ValueError, match="without 'wire_error.world'"):
        wire_state.load(units(), {"wire_error.root.0": np.zeros(3)}, 1, 0)


def test_a_job_resumed_without_grads_wire_drops_the_saved_error_feedback():
    """Its steps feed nothing back: the loaded residuals were carried, unchanged, into every
    checkpoint it saved, and a later int8 resume fed back a residual many steps old."""
    from _helpers import make_opt, train_steps

    x, y = make_data(8, DIMS, dtype=np.float32)

    def body(b):
        sl = slice(4 * b.rank, 4 * b.rank + 4)
        f = FSDP(make_mlp(DIMS, seed=7, dtype=np.float32), b, grads_wire="int8")
        opt = make_opt("adam", f.parameters())
        train_steps(f, opt, nn.CrossEntropyLoss(), x[sl], y[sl], 1)
        tensors, _ = f.sharded_state_dict(opt)
        g = FSDP(make_mlp(DIMS, seed=7, dtype=np.float32), b)
        opt2 = make_opt("adam", g.parameters())
        g.load_sharded_state_dict(tensors, opt2)
        train_steps(g, opt2, nn.CrossEntropyLoss(), x[sl], y[sl], 1)
        return ([k for k in tensors if k.startswith("wire_error.")],
                [k for k in g.sharded_state_dict(opt2)[0] if k.startswith("wire_error.")])

    for saved, resaved in run(body, 2):
        assert saved and resaved == []


@pytest.mark.parametrize("saved_kw, loaded_kw", [
    ({"strategy": "no_shard"}, {"strategy": "full_shard"}),   # allreduce series, no allreduce
    ({"strategy": "full_shard"}, {"strategy": "full_shard", "wrap": nn.Linear}),  # empty root
], ids=["no_shard-into-full_shard", "wrap-none-into-wrap-linear"])
def test_error_feedback_this_configuration_does_not_feed_back_is_dropped(saved_kw, loaded_kw):
    """A residual the loading configuration never uses nor updates (NO_SHARD's allreduce series
    under FULL_SHARD; wrap=None's root array on a wrapped model's empty root) is dropped with a
    warning: it was kept and re-saved unchanged by every later checkpoint, and resuming such
    a one on the saving configuration fed back a residual many steps old. The same
    configuration loads it without a warning."""
    from _helpers import make_opt, train_steps

    x, y = make_data(8, DIMS, dtype=np.float32)

    def fsdp(b, kw):
        kw = dict(kw)
        f = FSDP(make_mlp(DIMS, seed=7, dtype=np.float32), b, kw.pop("strategy"),
                 grads_wire="int8", **kw)
        return f, make_opt("adam", f.parameters())

    def body(b):
        sl = slice(4 * b.rank, 4 * b.rank + 4)
        f, opt = fsdp(b, saved_kw)
        train_steps(f, opt, nn.CrossEntropyLoss(), x[sl], y[sl], 2)
        saved, _ = f.sharded_state_dict(opt)
        h, opt3 = fsdp(b, saved_kw)
        h.load_sharded_state_dict(dict(saved), opt3)  # its own configuration: no warning
        g, opt2 = fsdp(b, loaded_kw)
        g.load_sharded_state_dict(dict(saved), opt2)  # warns
        train_steps(g, opt2, nn.CrossEntropyLoss(), x[sl], y[sl], 2)
        resaved, _ = g.sharded_state_dict(opt2)
        return {k: v for k, v in saved.items() if k.startswith("wire_error.")}, resaved

    # (the warnings are caught here: catch_warnings is not thread-safe, the ranks are threads)
    with pytest.warns(RuntimeWarning) as caught:
        results = run(body, 2)
    said = [str(w.message) for w in caught if "of another strategy or wrap policy" in
            str(w.message)]
    assert len(said) == 2  # one a rank: the other configuration's load only
    for saved, resaved in results:
        stale = [k for k, v in saved.items() if k != "wire_error.world" and k in resaved
                 and resaved[k].tobytes() == v.tobytes()]
        assert len(saved) > 1 and stale == []


def test_a_checkpoint_of_another_wrap_policy_resumes_and_a_refused_load_changes_nothing():
    """int8 error feedback saved with wrap=nn.Linear names units ('0', '2') a wrap=None model
    does not have: the load raised ValueError ("'wire_error.0.0' names no unit") after it had
    overwritten the parameters and optimizer state. Now those residuals are dropped with a
    warning and the load succeeds; a load that is refused (a malformed error feedback key, a
    missing parameter key) raises on every rank before it changes parameters, optimizer state
    or error feedback."""
    from _helpers import make_opt, train_steps

    x, y = make_data(8, DIMS, dtype=np.float32)

    def fsdp(b, seed, **kw):
        f = FSDP(make_mlp(DIMS, seed=seed, dtype=np.float32), b, grads_wire="int8", **kw)
        return f, make_opt("adam", f.parameters())

    def state(f, opt):
        tensors = f.sharded_state_dict(opt)[0]
        return {k: v.tobytes() for k, v in tensors.items()}

    def body(b):
        sl = slice(4 * b.rank, 4 * b.rank + 4)
        f, opt = fsdp(b, 7, wrap=nn.Linear)
        train_steps(f, opt, nn.CrossEntropyLoss(), x[sl], y[sl], 2)
        saved, _ = f.sharded_state_dict(opt)
        g, opt2 = fsdp(b, 3)
        train_steps(g, opt2, nn.CrossEntropyLoss(), x[sl], y[sl], 1)
        before = state(g, opt2)
        assert any(k.startswith("wire_error.root.") for k in before)
        refused = []
        name = next(iter(g.full_state_dict()))
        for bad in ({**saved, "wire_error.0.x": saved["wire_error.world"]},
                    {k: v for k, v in saved.items() if k != name}):
            with pytest.raises(ValueError) as e:
                g.load_sharded_state_dict(dict(bad), opt2)
            refused.append(str(e.value))
            assert state(g, opt2) == before  # parameters, optimizer state, feedback untouched
        g.load_sharded_state_dict(dict(saved), opt2)  # warns
        return refused, g.full_state_dict(), f.full_state_dict(), state(g, opt2)

    with pytest.warns(RuntimeWarning) as caught:  # (here: the ranks are threads)
        results = run(body, 2)
    assert len([w for w in caught if "of another strategy or wrap policy" in
                str(w.message)]) == 2  # the load that succeeds, on each rank
    for refused, got, want, after in results:
        assert "'wire_error.0.x' names no error feedback residual" in refused[0]
        assert "missing parameter keys" in refused[1]
        assert all(got[k].tobytes() == want[k].tobytes() for k in want)
        assert not any(k.startswith("wire_error.") and k != "wire_error.world" for k in after)
