"""DistributedDataParallel: rank 0's parameters at start, bucketed fused allreduces, no_sync."""

import threading

import numpy as np
import pytest
from _helpers import make_data, make_mlp, run

import ferro_fsdp.background as background_mod
from ferro_backend import CollectiveTimeoutError, SimulatedBackend
from ferro_fsdp import DDP, DistributedDataParallel, Module, Parameter, nn
from ferro_fsdp.wrapper import ModuleWrapper


def count_allreduces(monkeypatch):
    calls = []
    lock = threading.Lock()
    real = background_mod.allreduce_async

    def counted(tensor, backend, *args, **kwargs):
        with lock:
            calls.append((backend.rank, tensor.size))
        return real(tensor, backend, *args, **kwargs)

    monkeypatch.setattr(background_mod, "allreduce_async", counted)
    return calls


def test_alias():
    assert DDP is DistributedDataParallel


def test_construction_broadcasts_rank_0_parameters():
    def body(b):
        d = DDP(make_mlp(seed=10 + b.rank), b)
        return d.module.state_dict()

    ref = make_mlp(seed=10).state_dict()
    for sd in run(body, 3):
        for name in ref:
            np.testing.assert_array_equal(sd[name], ref[name])


def test_buckets_in_reverse_order_each_one_message(monkeypatch):
    calls = count_allreduces(monkeypatch)
    x, y = make_data(8)

    def body(b):
        d = DDP(make_mlp(), b, bucket_cap_mb=1048 / (1 << 20))
        loss_fn = nn.CrossEntropyLoss()
        loss_fn(d(x[:4]), y[:4])
        d.backward(loss_fn.backward())
        return d.buckets

    for buckets in run(body, 2):
        assert buckets == [["2.bias", "2.weight", "0.bias"], ["0.weight"]]
    assert sorted(calls) == [(0, 13 + 65 + 5), (0, 91), (1, 13 + 65 + 5), (1, 91)]


def test_a_small_first_bucket_then_the_cap_with_the_same_grads():
    """first_bucket_cap_mb caps the first bucket (the last layer's parameters) alone; the
    gradients are those of one bucket, bit for bit."""
    x, y = make_data(8)

    def body(b, first):
        d = DDP(make_mlp(), b, first_bucket_cap_mb=first)
        loss_fn = nn.CrossEntropyLoss()
        sl = slice(4 * b.rank, 4 * b.rank + 4)
        loss_fn(d(x[sl]), y[sl])
        d.backward(loss_fn.backward())
        return d.buckets, d.first_bucket_cap_bytes, [p.grad.copy() for p in d.module.parameters()]

    small = run(lambda b: body(b, 600 / (1 << 20)), 2)
    one = run(lambda b: body(b, None), 2)
    for (buckets, first, grads), (one_buckets, one_first, one_grads) in zip(small, one):
        # float64: 2.bias 40 B and 2.weight 520 B fit 600 B; 0.bias would not
        assert buckets == [["2.bias", "2.weight"], ["0.bias", "0.weight"]]
        assert first == 600 and one_first == 25 << 20 and len(one_buckets) == 1
        for g, h in zip(grads, one_grads):
            np.testing.assert_array_equal(g, h)


def test_default_cap_is_one_bucket_and_grads_are_the_mean():
    x, y = make_data(8)

    def body(b):
        d = DDP(make_mlp(), b)
        assert len(d.buckets) == 1 and d.bucket_cap_bytes == 25 << 20
        loss_fn = nn.CrossEntropyLoss()
        sl = slice(4 * b.rank, 4 * b.rank + 4)
        loss_fn(d(x[sl]), y[sl])
        d.backward(loss_fn.backward())
        return [p.grad for p in d.module.parameters()]

    ref = make_mlp()
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(ref(x), y)
    ref.backward(loss_fn.backward())
    g0, g1 = run(body, 2)
    for a, b_, r in zip(g0, g1, ref.parameters()):
        np.testing.assert_array_equal(a, b_)
        np.testing.assert_allclose(a, r.grad, rtol=1e-12, atol=1e-15)


def test_no_sync_accumulates_locally(monkeypatch):
    calls = count_allreduces(monkeypatch)
    x, y = make_data(8)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")

    def body(b):
        d = DDP(make_mlp(), b)
        with d.no_sync():
            loss_fn(d(x[4 * b.rank:4 * b.rank + 2]), y[4 * b.rank:4 * b.rank + 2])
            d.backward(loss_fn.backward())
        loss_fn(d(x[4 * b.rank + 2:4 * b.rank + 4]), y[4 * b.rank + 2:4 * b.rank + 4])
        d.backward(loss_fn.backward())
        return [p.grad for p in d.module.parameters()]

    ref = make_mlp()
    loss_fn(ref(x), y)
    ref.backward(loss_fn.backward())
    for grads in run(body, 2):
        for g, r in zip(grads, ref.parameters()):
            np.testing.assert_allclose(g, r.grad / 2, rtol=1e-12, atol=1e-15)
    assert len(calls) == 2  # one sync per rank, after the second backward


def test_dtypes_get_their_own_buckets_and_missing_grads_count_as_zero():
    class Mixed(Module):
        def __init__(self):
            super().__init__()
            self.a = Parameter(np.ones(3, np.float32))
            self.b = Parameter(np.ones(2, np.float64))
            self.c = Parameter(np.ones(2, np.float32))

    def body(b):
        d = DDP(Mixed(), b)
        if b.rank == 0:
            d.module.a.grad = np.full(3, 2.0, np.float32)
            d.module.b.grad = np.full(2, 4.0)
        d.sync_gradients()
        return d.buckets, d.module.a.grad, d.module.b.grad, d.module.c.grad

    for buckets, a, b_, c in run(body, 2):
        assert buckets == [["c", "a"], ["b"]]
        assert a.dtype == np.float32 and b_.dtype == np.float64
        np.testing.assert_array_equal(a, 1.0)
        np.testing.assert_array_equal(b_, 2.0)
        np.testing.assert_array_equal(c, 0.0)


def test_state_dict_and_errors():
    b = SimulatedBackend.create_group(1)[0]
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDP(make_mlp(), b, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="first_bucket_cap_mb -1"):
        DDP(make_mlp(), b, first_bucket_cap_mb=-1)
    with pytest.raises(TypeError, match="Module"):
        DDP(object(), b)
    d = DDP(make_mlp(), b)
    assert d.train() is d and d.eval() is d and not d.module.training
    tensors, specs = d.sharded_state_dict()
    assert specs["0.weight"] == ((91,), 0, (91,))
    d.module.zero_grad()
    d.load_sharded_state_dict(tensors)
    d.module.parameters()[0].grad = np.ones(3)
    lone = SimulatedBackend.create_group(2)[0]  # a rank of two whose peer never comes:
    with pytest.raises(CollectiveTimeoutError, match="all_gather"):  # the construction's check
        DDP(d.module, lone, broadcast_parameters=False, timeout=0.2)
    with pytest.MonkeyPatch.context() as mp:  # past that check, to the gradient's shape
        mp.setattr(ModuleWrapper, "_check_same_parameters", lambda *args: None)
        lone_ddp = DDP(d.module, lone, broadcast_parameters=False)
    with pytest.raises(ValueError, match="shape"):
        lone_ddp.sync_gradients()


# -- persistent buckets and overlap (0.2) ------------------------------------------------------
def _train(d, x, y, steps, momentum=0.9):
    from ferro_fsdp import optim

    opt = optim.SGD(d.parameters(), lr=0.1, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for s in range(steps):
        lo = slice(4 * d.backend.rank + s, 4 * d.backend.rank + s + 4)
        losses.append(loss_fn(d(x[lo]), y[lo]))
        d.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
    return losses, d.module.state_dict()


def test_grads_are_views_into_persistent_buckets():
    x, y = make_data(16)

    def body(b):
        d = DDP(make_mlp(), b, bucket_cap_mb=1048 / (1 << 20))
        loss_fn = nn.CrossEntropyLoss()
        flats = []
        for _ in range(2):
            loss_fn(d(x[:4]), y[:4])
            d.backward(loss_fn.backward())
            for p in d.parameters():
                assert any(np.shares_memory(p.grad, f) for f in d._flats)
            flats.append([f.__array_interface__["data"][0] for f in d._flats])
            grads = [p.grad.copy() for p in d.parameters()]
            d.module.zero_grad()
        assert flats[0] == flats[1]  # the same buffers, step after step
        return grads

    a, c = run(body, 2)
    for ga, gc in zip(a, c):
        np.testing.assert_array_equal(ga, gc)


def test_buckets_start_during_backward(monkeypatch):
    """With one bucket per layer, the last layer's bucket is reduced before the first layer's
    backward has run: the allreduce overlaps the rest of the backward."""
    events = count_allreduces(monkeypatch)  # (rank, size), and the markers (rank, name)
    x, y = make_data(8)

    def body(b):
        model = make_mlp()
        first = model[0]
        first.register_backward_pre_hook(
            lambda m, args: events.append((b.rank, "first layer backward")))
        d = DDP(model, b, bucket_cap_mb=400 / (1 << 20))
        loss_fn = nn.CrossEntropyLoss()
        loss_fn(d(x[:4]), y[:4])
        d.backward(loss_fn.backward())
        return d.buckets

    buckets = run(body, 2)[0]
    assert len(buckets) >= 3
    for r in range(2):
        mine = [k for rank, k in events if rank == r]
        sizes = [i for i, k in enumerate(mine) if not isinstance(k, str)]
        assert sizes[0] < mine.index("first layer backward")
        assert len(sizes) == len(buckets)


def test_a_linear_bucket_starts_before_its_input_gradient(monkeypatch):
    """A Linear says its gradients are final before it computes its input's
    (``Module.grads_ready``): its bucket's allreduce starts inside its backward, not after it
    returned; a module that does not say so starts its bucket when its backward returns."""
    events = count_allreduces(monkeypatch)
    x, y = make_data(8)

    def body(b):
        model = make_mlp()
        last = model[len(model) - 1]
        last.register_backward_hook(
            lambda m, args, out: events.append((b.rank, "last layer returned")))
        d = DDP(model, b, bucket_cap_mb=400 / (1 << 20))
        loss_fn = nn.CrossEntropyLoss()
        loss_fn(d(x[:4]), y[:4])
        d.backward(loss_fn.backward())
        sizes = dict((name, p.size) for name, p in model.named_parameters())
        name = f"{len(model) - 1}.weight"
        bucket = next(names for names in d.buckets if name in names)
        return sum(sizes[n] for n in bucket)

    for r, size in enumerate(run(body, 2)):
        mine = [k for rank, k in events if rank == r]
        assert mine.index(size) < mine.index("last layer returned")


@pytest.mark.parametrize("world", [2, 3])
def test_overlap_gives_the_same_bits_as_after_backward(world):
    x, y = make_data(40)

    def body(b, overlap):
        return _train(DDP(make_mlp(seed=3), b, bucket_cap_mb=700 / (1 << 20),
                          overlap=overlap), x, y, 4)

    on = run(lambda b: body(b, True), world)
    off = run(lambda b: body(b, False), world)
    for (la, sa), (lb, sb) in zip(on, off):
        assert la == lb
        for k in sa:
            np.testing.assert_array_equal(sa[k], sb[k])
    for _, s in on[1:]:  # every rank holds the same model
        for k in s:
            np.testing.assert_array_equal(s[k], on[0][1][k])


def test_module_used_twice_is_a_clear_error_and_overlap_false_runs_it():
    class Twice(Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3, rng=0, dtype=np.float64)

        def forward(self, x):
            return self.lin(self.lin(x))

        def backward(self, g):
            return self.lin.backward(g)  # (a toy: only the last use's gradient)

    def body(b, overlap):
        d = DDP(Twice(), b, overlap=overlap)
        d(np.ones((2, 3)))
        d.backward(np.ones((2, 3)))
        d.backward(np.ones((2, 3)))
        return d.module.lin.weight.grad.copy()

    run(lambda b: body(b, False), 2)

    class Reuse(Twice):
        def backward(self, g):
            return self.lin.backward(self.lin.backward(g))

    def body2(b):
        d = DDP(Reuse(), b)
        d(np.ones((2, 3)))
        with pytest.raises(RuntimeError, match="lin.weight.*another gradient"):
            d.backward(np.ones((2, 3)))
        d.sync_gradients()  # the started bucket is waited for; the ranks stay in step
        return True

    assert run(body2, 2) == [True, True]


def test_no_sync_accumulates_in_the_bucket_then_syncs():
    x, y = make_data(16)

    def body(b):
        d = DDP(make_mlp(), b)
        loss_fn = nn.CrossEntropyLoss()
        r = 8 * b.rank
        with d.no_sync():
            loss_fn(d(x[r:r + 4]), y[r:r + 4])
            d.backward(loss_fn.backward())
        local = [p.grad.copy() for p in d.parameters()]
        loss_fn(d(x[r + 4:r + 8]), y[r + 4:r + 8])
        d.backward(loss_fn.backward())
        return local, [p.grad.copy() for p in d.parameters()]

    (l0, g0), (l1, g1) = run(body, 2)
    for a, c in zip(g0, g1):
        np.testing.assert_array_equal(a, c)
    assert not all(np.array_equal(a, c) for a, c in zip(l0, l1))  # local grads differ per rank
