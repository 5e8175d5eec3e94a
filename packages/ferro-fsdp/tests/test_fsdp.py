"""FSDP beyond the seed: padding, one message per unit, memory, prefetch, accumulation, errors."""

import threading

import numpy as np
import pytest
from _helpers import (
    FS,
    HS,
    NS,
    SGO,
    SeedModule,
    make_data,
    make_mlp,
    make_opt,
    reference_training,
    run,
    wrap,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import ferro_fsdp.fsdp as fsdp_mod
import ferro_fsdp.grad_sync as grad_sync_mod
import ferro_fsdp.units as units_mod
from ferro_backend import InvalidWorldSizeError, SimulatedBackend
from ferro_fsdp import FSDP, FSDPStateError, Module, Parameter, ShardingStrategy, nn, optim


def one_rank():
    return SimulatedBackend.create_group(1)[0]


def step(w, opt, x, y, loss_fn=None):
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    loss = loss_fn(w(x), y)
    w.backward(loss_fn.backward())
    w.sync_gradients()
    opt.step()
    opt.zero_grad()
    w.broadcast_updated_params()
    return loss


def test_any_parameter_size_is_padded():
    def body(b):
        f = FSDP(SeedModule(np.arange(1.0, 11.0)), b)
        out = f(np.array([1.0], np.float32))
        return f.module.weight.data.tolist(), out[0]

    res = run(body, 4)
    assert [r[0] for r in res] == [[1, 2, 3], [4, 5, 6], [7, 8, 0], [9, 10, 0]]
    assert all(r[1] == 55.0 for r in res)


def test_update_shards_takes_padded_chunks():
    def body(b):
        f = FSDP(SeedModule([1.0, 2.0, 3.0]), b)
        assert f.layout.shard_numel == 2
        f.update_shards([10.0, 20.0] if b.rank == 0 else [30.0, 0.0])
        return f.full_state_dict()["weight"].tolist()

    assert run(body, 2) == [[10.0, 20.0, 30.0]] * 2


class Counter:
    def __init__(self, monkeypatch, names):
        self.calls = {}
        self.lock = threading.Lock()
        for name in names:  # the collectives FSDP's modules call, wherever they are imported
            for mod in (fsdp_mod, grad_sync_mod, units_mod):
                for variant in (name, name + "_async"):
                    if hasattr(mod, variant):
                        monkeypatch.setattr(mod, variant, self.wrap(name, getattr(mod, variant)))

    def wrap(self, name, real):
        def counted(tensor, group, *args, **kwargs):
            with self.lock:
                self.calls[name] = self.calls.get(name, 0) + 1
            return real(tensor, group, *args, **kwargs)

        return counted


@pytest.mark.parametrize("strategy,world,intra,expected", [
    (FS, 4, None, {"all_gather": 2, "reduce_scatter": 1}),
    (HS, 4, 2, {"all_gather": 2, "reduce_scatter": 1, "allreduce": 1}),
    (SGO, 4, None, {"all_gather": 1, "reduce_scatter": 1}),
    (NS, 4, None, {"allreduce": 1}),
])
def test_one_message_per_unit(monkeypatch, strategy, world, intra, expected):
    counter = Counter(monkeypatch, ["all_gather", "reduce_scatter", "allreduce"])
    x, y = make_data(8)

    def body(b):
        f = FSDP(make_mlp(), b, strategy, intra_node_size=intra)
        assert len(f.module.parameters()) == 4
        step(f, optim.SGD(f.module.parameters(), lr=0.1), x[:2], y[:2])

    run(body, world)
    # per rank and step: forward gather + backward re-gather, one gradient sync
    assert {k: v // world for k, v in counter.calls.items()} == expected
    assert all(v % world == 0 for v in counter.calls.values())


def held_bytes(arrays):
    roots = {}
    for a in arrays:
        if a is None:
            continue
        while isinstance(a.base, np.ndarray):
            a = a.base
        roots[id(a)] = a.nbytes
    return sum(roots.values())


@pytest.mark.parametrize("world", [2, 4])
def test_full_shard_holds_one_over_world_between_steps(world):
    dims = (32, 64, 64, 10)
    full_bytes = make_mlp(dims).num_parameters() * 8
    x, y = make_data(8 * world, dims)

    def body(b):
        f = FSDP(make_mlp(dims), b)
        opt = optim.Adam(f.module.parameters())
        sl = slice(8 * b.rank, 8 * (b.rank + 1))
        out = []
        for _ in range(3):
            step(f, opt, x[sl], y[sl])
            params = f.module.parameters()
            data = held_bytes([p.data for p in params] + [fp.data for fp in f.full_params])
            grads = held_bytes([p.grad for p in params])
            state = held_bytes([s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")])
            out.append((data, f.local_param_bytes(), grads, state))
        # inside a step: after forward the gathered parameters are freed again
        f(x[sl])
        after_forward = f.local_param_bytes()
        f.backward(np.zeros((8, dims[-1])))
        after_backward = f.local_param_bytes()
        f.sync_gradients()
        return out, after_forward, after_backward

    for out, after_forward, after_backward in run(body, world):
        for data, local, grads, state in out:
            assert local == data
            assert data / (full_bytes / world) == pytest.approx(1.0, abs=0.05)
            assert grads <= 1.05 * full_bytes / world
            assert state / (2 * full_bytes / world) == pytest.approx(1.0, abs=0.05)
        assert after_forward <= 1.05 * full_bytes / world
        assert after_backward <= 1.05 * full_bytes / world


def test_reshard_after_forward_false_keeps_full_params_until_backward(monkeypatch):
    counter = Counter(monkeypatch, ["all_gather"])

    def body(b):
        f = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), b, reshard_after_forward=False)
        f(np.array([1.0], np.float32))
        kept = f.full_params[0].data.tolist()
        f.backward(np.array([1.0], np.float32))
        freed = f.full_params[0].data.size
        f.sync_gradients()
        return kept, freed, f.module.weight.grad.tolist()

    for kept, freed, grad in run(body, 2):
        assert kept == [1.0, 2.0, 3.0, 4.0] and freed == 0 and grad == [1.0, 1.0]
    assert counter.calls["all_gather"] == 2  # forward only: backward reused the kept params


def test_freed_full_params_after_forward():
    f = FSDP(SeedModule([1.0, 2.0]), one_rank())
    f(np.array([1.0], np.float32))
    assert f.full_params[0].data.size == 0 and not f.full_params[0].data.flags.writeable
    f.full_params[0].grad = np.ones(2, np.float32)
    f.sync_gradients()
    assert f.full_params == []


@pytest.mark.parametrize("strategy", [FS, SGO, NS])
def test_gradient_accumulation_over_two_backwards(strategy):
    x, y = make_data(8)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")

    def body(b):
        f = FSDP(make_mlp(), b, strategy)
        for half in (slice(0, 4), slice(4, 8)):
            loss_fn(f(x[half]), y[half])
            f.backward(loss_fn.backward())
        f.sync_gradients()
        acc = [p.grad.copy() for p in f.module.parameters()]
        f.module.zero_grad()  # (a sync adds to the gradient a sync left)
        loss_fn(f(x), y)
        f.backward(loss_fn.backward())
        f.sync_gradients()
        return acc, [p.grad for p in f.module.parameters()]

    for acc, whole in run(body, 2):
        for a, w in zip(acc, whole):
            np.testing.assert_allclose(a, w, rtol=1e-12, atol=1e-14)


@settings(max_examples=10, deadline=None)
@given(case=st.sampled_from([(FS, 2, None), (FS, 3, None), (SGO, 3, None), (NS, 2, None),
                             (HS, 4, 2)]), wrap_linear=st.booleans(), micro=st.integers(2, 3))
def test_sync_gradients_adds_to_the_gradient_an_earlier_sync_left(case, wrap_linear, micro):
    # each sync overwrote .grad: micro-steps each synced, no zero_grad between, stepped on the
    # last one's gradient only (DDP and torch sum them); the last sync's .grad views the
    # buffer the next reduction writes into, so it must be copied out first
    strategy, world, intra = case
    x, y = make_data(4 * micro * world)

    def body(b, zero):
        f = FSDP(make_mlp(seed=3), b, strategy, intra_node_size=intra,
                 wrap=nn.Linear if wrap_linear else None)
        loss_fn = nn.CrossEntropyLoss(reduction="sum")
        synced = []
        for k in range(micro):
            lo = 4 * (k * world + b.rank)
            loss_fn(f(x[lo:lo + 4]), y[lo:lo + 4])
            f.backward(loss_fn.backward())
            f.sync_gradients()
            synced.append([p.grad.copy() for p in f.module.parameters()])
            if zero:
                f.module.zero_grad()
        return synced

    each = run(lambda b: body(b, True), world)
    acc = run(lambda b: body(b, False), world)
    for mine, total in zip(each, acc):
        for k in range(micro):
            for j in range(len(mine[0])):
                want = mine[0][j]
                for step in mine[1:k + 1]:
                    want = want + step[j]
                np.testing.assert_array_equal(total[k][j], want)


def test_synced_micro_steps_give_the_bits_of_one_process():
    # every rank the same batch: the MEAN is each rank's own gradient, bit for bit
    x, y = make_data(8)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    model = make_mlp(seed=3)
    for half in (slice(0, 4), slice(4, 8)):
        loss_fn(model(x[half]), y[half])
        model.backward(loss_fn.backward())
    ref = [p.grad for p in model.parameters()]

    def body(b, strategy):
        f = FSDP(make_mlp(seed=3), b, strategy)
        for half in (slice(0, 4), slice(4, 8)):
            loss_fn(f(x[half]), y[half])
            f.backward(loss_fn.backward())
            f.sync_gradients()
        return [(f.layout.region(i, f._shard_rank), p.grad.copy())
                for i, p in enumerate(f.module.parameters())]

    for strategy in (FS, SGO, NS):
        for got in run(lambda b, s=strategy: body(b, s), 2):
            for (start, length), g, r in zip((t[0] for t in got), (t[1] for t in got), ref):
                if strategy is FS:
                    g = g[:length]
                    r = r.reshape(-1)[start:start + length]
                elif strategy is SGO:
                    r = r.reshape(-1)[start:start + length]
                    g = g.reshape(-1)[start:start + length]
                np.testing.assert_array_equal(g, r)


def test_hybrid_prefetch_and_world_one_prefetch():
    def body(b):
        f = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0, 5.0]), b, "hybrid_shard", intra_node_size=2)
        f.prefetch_forward_params()
        assert f.has_pending_prefetch
        with pytest.raises(FSDPStateError, match="called twice"):
            f.prefetch_forward_params()
        out = f(np.array([1.0], np.float32))[0]
        assert not f.has_pending_prefetch
        return out

    assert run(body, 4) == [15.0] * 4
    f = FSDP(SeedModule([1.0, 2.0]), one_rank())
    f.prefetch_forward_params()
    assert f(np.array([2.0], np.float32))[0] == 6.0


def test_sync_module_states_broadcasts_rank_0():
    def body(b):
        f = FSDP(make_mlp(seed=b.rank), b, sync_module_states=True)
        return f.full_state_dict()

    res = run(body, 3)
    ref = make_mlp(seed=0).state_dict()
    for sd in res:
        for name in ref:
            np.testing.assert_array_equal(sd[name], ref[name])


def test_frozen_parameter_gets_no_gradient():
    class Net(Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2, dtype=np.float64, rng=0)
            self.fc.bias.requires_grad = False

        def forward(self, x):
            return self.fc(x)

        def backward(self, g):
            return self.fc.backward(g)

    def body(b):
        f = FSDP(Net(), b)
        bias = f.module.fc.bias.data.copy()
        opt = optim.SGD(f.module.parameters(), lr=0.1)
        step(f, opt, np.ones((2, 3)), np.zeros((2, 2)), nn.MSELoss())
        assert f.module.fc.bias.grad is None
        np.testing.assert_array_equal(f.module.fc.bias.data, bias)
        assert f.module.fc.weight.grad is None  # zero_grad after the step

    run(body, 2)


def test_float32_training_is_close_to_float64():
    x, y = make_data(8)

    def body(b):
        f = FSDP(make_mlp(dtype=np.float32), b)
        opt = make_opt("sgd", f.module.parameters())
        sl = slice(4 * b.rank, 4 * b.rank + 4)
        for _ in range(5):
            step(f, opt, x[sl].astype(np.float32), y[sl])
        return f.full_state_dict()

    ref, _ = reference_training("sgd", 5, x, y)
    for sd in run(body, 2):
        for name in sd:
            assert sd[name].dtype == np.float32
            np.testing.assert_allclose(sd[name], ref[name], rtol=1e-4, atol=1e-5)


def test_forward_error_restores_the_shards():
    class Boom(SeedModule):
        def forward(self, x):
            raise RuntimeError("boom")

    f = FSDP(Boom([1.0, 2.0]), one_rank())
    with pytest.raises(RuntimeError, match="boom"):
        f(np.ones(1, np.float32))
    assert f.module.weight.data.size == 2 and f.full_params[0].data.size == 0


def test_state_errors():
    f = FSDP(SeedModule([1.0, 2.0]), one_rank())
    with pytest.raises(FSDPStateError, match="no forward"):
        f.sync_gradients()
    with pytest.raises(FSDPStateError, match="no forward"):
        f.backward(np.ones(1))
    with pytest.raises(FSDPStateError, match="nothing to gather"):
        FSDP(SeedModule([1.0]), one_rank(), NS).prefetch_forward_params()
    f(np.ones(1, np.float32))
    f.full_params[0].grad = np.ones(3, np.float32)
    with pytest.raises(ValueError, match="shape"):
        f.sync_gradients()
    assert issubclass(FSDPStateError, RuntimeError)


def test_construction_errors():
    group = SimulatedBackend.create_group(4)
    with pytest.raises(InvalidWorldSizeError, match="intra_node_size None"):
        FSDP(SeedModule([1.0]), group[0], HS)
    with pytest.raises(InvalidWorldSizeError, match="intra_node_size 0"):
        FSDP(SeedModule([1.0]), group[0], HS, intra_node_size=0)
    with pytest.raises(ValueError, match="only valid for HYBRID_SHARD"):
        FSDP(SeedModule([1.0]), group[0], FS, intra_node_size=2)
    with pytest.raises(ValueError, match="unknown strategy"):
        FSDP(SeedModule([1.0]), group[0], "zero3")
    with pytest.raises(TypeError, match="Module"):
        FSDP(object(), group[0])

    class Mixed(Module):
        def __init__(self):
            super().__init__()
            self.a = Parameter(np.ones(2, np.float32))
            self.b = Parameter(np.ones(2, np.float64))

    with pytest.raises(TypeError, match="single dtype"):
        FSDP(Mixed(), group[0])
    with pytest.raises(TypeError, match="not floating"):
        FSDP(SeedModule([1, 2], dtype=np.int64), group[0])


def test_accessors_and_hybrid_groups():
    def body(b):
        f = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), b, ShardingStrategy.HYBRID_SHARD, intra_node_size=2)
        assert f.backend is b and f.intra_node_size == 2
        assert f.param_names == ["weight"]
        assert "HYBRID_SHARD" in repr(f)
        assert f.train() is f and f.module.training
        f.eval()
        assert not f.module.training
        return f.intra_node_group.members, f.inter_node_group.members

    res = run(body, 4)
    assert res == [((0, 1), (0, 2)), ((0, 1), (1, 3)), ((2, 3), (0, 2)), ((2, 3), (1, 3))]
    f = FSDP(SeedModule([1.0]), one_rank(), "no_shard")
    assert f.intra_node_group is None and f.strategy is NS


def test_forward_refuses_a_stale_prefetch():
    def body(b):
        f = FSDP(SeedModule([1.0, 2.0, 3.0, 4.0]), b)
        f.prefetch_forward_params()
        f.module.weight.data += 1.0  # an update after the prefetch started
        with pytest.raises(FSDPStateError, match="stale"):
            f(np.array([1.0], np.float32))
        assert not f.has_pending_prefetch
        return f(np.array([1.0], np.float32))[0]  # a plain forward gathers the new values

    assert run(body, 2) == [14.0, 14.0]


@pytest.mark.parametrize("strategy", [FS, SGO, NS, "ddp"])
def test_module_without_parameters(strategy):
    def body(b):
        w = wrap(nn.ReLU(), b, strategy)
        out = w(np.array([-1.0, 2.0]))
        g = w.backward(np.ones(2))
        if strategy != "ddp":
            if strategy is FS:
                w.prefetch_forward_params()
            w(np.array([1.0]))
            w.sync_gradients()
            w.broadcast_updated_params()
            assert w.full_state_dict() == {}
        return out.tolist(), g.tolist()

    assert run(body, 2) == [([0.0, 2.0], [0.0, 1.0])] * 2
