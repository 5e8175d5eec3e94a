"""FSDP units (wrap=, nested FSDP): the same bits as one unit, at most two units full at once,
prefetch one ahead, each unit's reduction started as soon as its backward is done."""

import threading

import numpy as np
import pytest
from _helpers import FS, HS, NS, SGO, make_data, make_mlp, make_opt, run, train_steps
from hypothesis import given, settings
from hypothesis import strategies as st

import ferro_fsdp.units as units_mod
from ferro_fsdp import FSDP, Module, Parameter, nn

DIMS = (7, 13, 11, 5)  # three Linear layers, no size divisible by 2, 3 or 4


def train(b, strategy, wrap, *, steps=3, intra=None, opt="sgd", model=None, reshard=None):
    x, y = make_data(12 * b.world_size, dims=DIMS)
    model = model if model is not None else make_mlp(DIMS, seed=5)
    f = FSDP(model, b, strategy, wrap=wrap, intra_node_size=intra, reshard_after_forward=reshard)
    o = make_opt(opt, f.module.parameters())
    lo = slice(12 * b.rank, 12 * b.rank + 12)
    losses = train_steps(f, o, nn.CrossEntropyLoss(), x[lo], y[lo], steps)
    return f.units, losses, f.full_state_dict(), None


@pytest.mark.parametrize("strategy,world,intra", [(FS, 2, None), (FS, 3, None), (SGO, 3, None),
                                                  (NS, 2, None), (HS, 4, 2)])
@pytest.mark.parametrize("wrap", [nn.Linear, (nn.Linear, nn.ReLU), 100])
def test_units_give_the_bits_of_one_unit(strategy, world, intra, wrap):
    one = run(lambda b: train(b, strategy, None, intra=intra), world)
    many = run(lambda b: train(b, strategy, wrap, intra=intra), world)
    for (u1, l1, s1, _), (un, ln, sn, _) in zip(one, many):
        assert u1 == [""] and len(un) > 1
        assert l1 == ln
        for k in s1:
            np.testing.assert_array_equal(s1[k], sn[k])


def test_unit_names_by_type_and_by_size():
    def body(b):
        by_type = FSDP(make_mlp(DIMS), b, wrap=nn.Linear).units
        by_size = FSDP(make_mlp(DIMS), b, wrap=150).units  # 7*13+13=104, 13*11+11=154, 11*5+5=60
        everything = FSDP(make_mlp(DIMS), b, wrap=1).units
        return by_type, by_size, everything

    for by_type, by_size, everything in run(body, 2):
        assert by_type == ["", "0", "2", "4"]
        assert by_size == ["", "2"]
        assert everything == ["", "0", "2", "4"]  # ReLU has no parameters: never a unit


def _mlp4(seed=0):
    rng = np.random.default_rng(seed)
    return nn.Sequential(*[m for i in range(4) for m in
                           (nn.Linear(32, 32, rng=rng), nn.ReLU())][:-1])


def test_at_most_two_units_full_at_once_and_prefetch_one_ahead(monkeypatch):
    gathers = []
    lock = threading.Lock()
    real = units_mod.all_gather_async

    def logged(tensor, group, *args, **kwargs):
        with lock:
            gathers.append(group.rank)
        return real(tensor, group, *args, **kwargs)

    monkeypatch.setattr(units_mod, "all_gather_async", logged)
    x, y = make_data(8, dims=(32, 32), dtype=np.float32, classes=False)

    def body(b):
        f = FSDP(_mlp4(), b, FS, wrap=nn.Linear)
        most = [0]
        full_bytes = sum(p.data.nbytes for p in _mlp4().parameters())

        def count(*_):
            held = sum(1 for u in f._units if u.pending is not None
                       or u.fps and any(fp.data.size for fp in u.fps))
            most[0] = max(most[0], held)
            assert f.local_param_bytes() <= full_bytes / b.world_size + 2 * 33 * 32 * 4

        for m in f.module:
            if isinstance(m, nn.Linear):
                m.register_forward_pre_hook(count)  # after FSDP's: gathered, next prefetching
                m.register_backward_pre_hook(count)
        o = make_opt("sgd", f.module.parameters())
        train_steps(f, o, nn.MSELoss(), x, y, 3)
        return most[0], f.units

    for most, units in run(body, 2):
        assert units == ["", "0", "2", "4", "6"]
        assert most == 2
    # steps 2 and 3: every unit's forward and backward gathers ran as prefetches
    assert len(gathers) >= 2 * 2 * 7


def test_reduce_scatter_of_a_unit_starts_before_the_first_unit_backward(monkeypatch):
    events = []
    lock = threading.Lock()
    real = units_mod.reduce_scatter_async

    def logged(tensor, group, *args, **kwargs):
        with lock:
            events.append((group.rank, "reduce_scatter"))
        return real(tensor, group, *args, **kwargs)

    monkeypatch.setattr(units_mod, "reduce_scatter_async", logged)
    x, y = make_data(8, dims=(32, 32), dtype=np.float32, classes=False)

    def body(b):
        model = _mlp4()
        model[0].register_backward_pre_hook(lambda *a: events.append((b.rank, "first backward")))
        f = FSDP(model, b, FS, wrap=nn.Linear)
        o = make_opt("sgd", f.module.parameters())
        train_steps(f, o, nn.MSELoss(), x, y, 1)

    run(body, 2)
    for r in range(2):
        kinds = [k for rank, k in events if rank == r]
        assert kinds.index("reduce_scatter") < kinds.index("first backward")
        # 4 Linear units, weight and bias each reduced in place (both split evenly over 2
        # ranks: Unit.direct); the empty root sends nothing
        assert kinds.count("reduce_scatter") == 8


class Block(Module):
    def __init__(self, b, seed, wrap_inner, **fsdp):
        super().__init__()
        lin = nn.Linear(13, 13, rng=seed, dtype=np.float64)
        self.lin = FSDP(lin, b, **fsdp) if wrap_inner else lin
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.lin(x))

    def backward(self, g):
        return self.lin.backward(self.act.backward(g))


def _nested_model(b, nested, **fsdp):
    rng = np.random.default_rng(3)
    return nn.Sequential(nn.Linear(7, 13, rng=rng, dtype=np.float64),
                         Block(b, 4, nested, **fsdp), Block(b, 5, nested, **fsdp),
                         nn.Linear(13, 5, rng=rng, dtype=np.float64))


@pytest.mark.parametrize("world, strategy", [(2, FS), (3, FS), (4, HS)])
def test_nested_fsdp_gives_the_bits_of_one_unit(world, strategy):
    # HYBRID_SHARD: each nested FSDP's node groups had its parent's name and members, so the
    # same tags: their reduce-scatters in flight at once crossed (a mismatch on every run)
    intra = {"intra_node_size": 2} if strategy is HS else {}

    def body(b, nested):
        model = _nested_model(b, nested, strategy=strategy, **intra)
        units, losses, state, _ = train(b, strategy, None, model=model,
                                        intra=intra.get("intra_node_size"))
        f_names = [n for n, _ in model.named_parameters()]
        return units, losses, state, f_names

    flat = run(lambda b: body(b, False), world)
    nested = run(lambda b: body(b, True), world)
    for (_, l1, s1, n1), (_, l2, s2, n2) in zip(flat, nested):
        assert n1 == n2  # an FSDP inside a module is transparent to names
        assert l1 == l2
        for k in s1:
            np.testing.assert_array_equal(s1[k], s2[k])


def test_nested_fsdp_state_dicts_and_errors():
    def body(b):
        model = _nested_model(b, True)
        f = FSDP(model, b, FS)
        tensors, specs = f.sharded_state_dict()
        f.load_sharded_state_dict(tensors)
        with pytest.raises(ValueError, match="nested FSDP '1.lin'.*backend and strategy"):
            FSDP(_nested_model(b, True), b, NS)
        return sorted(tensors)

    names = run(body, 2)[0]
    assert "1.lin.weight" in names and "0.weight" in names


def test_reshard_after_forward_per_unit_and_errors():
    def body(b):
        f = FSDP(make_mlp(DIMS), b, FS, wrap=nn.Linear, reshard_after_forward={"2": False})
        f(np.ones((2, 7)))
        held = [u.name for u in f._units if u.fps and any(fp.data.size for fp in u.fps)]
        with pytest.raises(ValueError, match=r"names \['9'\], which are not units"):
            FSDP(make_mlp(DIMS), b, FS, wrap=nn.Linear, reshard_after_forward={"9": False})
        with pytest.raises(TypeError, match="wrap='linear'"):
            FSDP(make_mlp(DIMS), b, FS, wrap="linear")
        with pytest.raises(TypeError, match="wrap=0"):
            FSDP(make_mlp(DIMS), b, FS, wrap=0)
        return held

    assert run(body, 2) == [["2"], ["2"]]


@pytest.mark.parametrize("strategy", [FS, NS])
def test_no_sync_with_units_accumulates_then_reduces_once(strategy):
    x, y = make_data(16, dims=DIMS)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")

    def body(b, wrap, use_no_sync):
        f = FSDP(make_mlp(DIMS), b, strategy, wrap=wrap)
        lo = 8 * b.rank
        for k, half in enumerate((slice(lo, lo + 4), slice(lo + 4, lo + 8))):
            loss_fn(f(x[half]), y[half])
            if use_no_sync and k == 0:
                with f.no_sync():
                    f.backward(loss_fn.backward())
            else:
                f.backward(loss_fn.backward())
        f.sync_gradients()
        return [p.grad.copy() for p in f.module.parameters()]

    ref = run(lambda b: body(b, None, True), 2)
    for got in (run(lambda b: body(b, nn.Linear, True), 2),
                run(lambda b: body(b, nn.Linear, False), 2)):
        for ga, gb in zip(ref, got):
            for a, c in zip(ga, gb):
                np.testing.assert_allclose(a, c, rtol=1e-12, atol=1e-14)


@settings(max_examples=12, deadline=None)
@given(widths=st.lists(st.integers(1, 9), min_size=2, max_size=5), world=st.integers(1, 4),
       size=st.integers(1, 80))
def test_any_model_any_wrap_size_same_bits(widths, world, size):
    dims = (3, *widths)
    x = np.random.default_rng(0).standard_normal((4 * world, 3))
    y = np.random.default_rng(1).standard_normal((4 * world, dims[-1]))

    def body(b, wrap):
        f = FSDP(make_mlp(dims, seed=2), b, FS, wrap=wrap)
        o = make_opt("adam", f.module.parameters())
        lo = slice(4 * b.rank, 4 * b.rank + 4)
        losses = train_steps(f, o, nn.MSELoss(), x[lo], y[lo], 2)
        return losses, f.full_state_dict()

    one = run(lambda b: body(b, None), world)
    many = run(lambda b: body(b, size), world)
    for (l1, s1), (l2, s2) in zip(one, many):
        assert l1 == l2
        for k in s1:
            np.testing.assert_array_equal(s1[k], s2[k])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", [FS, SGO, NS])
def test_clip_grad_norm_with_units_equals_one_unit(world, strategy):
    x, y = make_data(8 * world, dims=DIMS)

    def body(b, wrap):
        f = FSDP(make_mlp(DIMS, seed=9), b, strategy, wrap=wrap)
        o = make_opt("sgd", f.module.parameters())
        loss_fn = nn.CrossEntropyLoss()
        norms = []
        for _ in range(2):
            lo = slice(8 * b.rank, 8 * b.rank + 8)
            loss_fn(f(x[lo]), y[lo])
            f.backward(loss_fn.backward())
            f.sync_gradients()
            norms.append(f.clip_grad_norm_(0.05))
            o.step()
            o.zero_grad()
            f.broadcast_updated_params()
        return norms, f.full_state_dict()

    one = run(lambda b: body(b, None), world)
    many = run(lambda b: body(b, nn.Linear), world)
    for (n1, s1), (n2, s2) in zip(one, many):
        assert n1 == n2
        for k in s1:
            np.testing.assert_array_equal(s1[k], s2[k])


EVEN = (8, 12, 16, 4)  # every weight and bias splits evenly over 2 and 4 ranks


def train_even(b, strategy, direct, intra=None):
    x, y = make_data(12 * b.world_size, dims=EVEN)
    f = FSDP(make_mlp(EVEN, seed=7), b, strategy, wrap=nn.Linear, intra_node_size=intra)
    assert all(u.direct for u in f._units)
    for u in f._units:
        u.direct = direct
    o = make_opt("adam", f.module.parameters())
    lo = slice(12 * b.rank, 12 * b.rank + 12)
    losses = train_steps(f, o, nn.CrossEntropyLoss(), x[lo], y[lo], 3)
    return losses, f.full_state_dict(), [u.full_buf is None for u in f._units]


@pytest.mark.parametrize("strategy,world,intra", [(FS, 2, None), (FS, 4, None), (SGO, 2, None),
                                                  (HS, 4, 2)])
def test_per_parameter_gathers_and_reductions_give_the_packed_bits(strategy, world, intra):
    # Unit.direct: one all-gather and one reduce-scatter per parameter, in place, against the
    # packed flat shard of the unit (pack, gather, copy out; copy in, reduce-scatter)
    packed = run(lambda b: train_even(b, strategy, False, intra), world)
    direct = run(lambda b: train_even(b, strategy, True, intra), world)
    for (lp, sp, _), (ld, sd, freed_after) in zip(packed, direct):
        assert lp == ld
        assert sp.keys() == sd.keys()
        for k in sp:
            np.testing.assert_array_equal(sp[k], sd[k])
        assert all(freed_after) or strategy is SGO  # gathered buffers went back to the pool


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6).flatmap(lambda n: st.tuples(st.permutations(range(n)),
                                                      st.integers(0, n))))
def test_a_pooled_buffer_goes_back_only_once_every_reduction_reading_it_is_done(case):
    """A unit's per-parameter reductions read its full-gradient buffer; a backend's async
    workers run them side by side, so they may end in any order (the last started first: the
    buffer went back early, another unit of the same size took it and wrote its gradients into
    it while a reduction still read it). ``already`` of them are done before the hand-off."""
    from concurrent.futures import Future

    from ferro_fsdp.buffer_pool import BufferPool
    from ferro_fsdp.inflight import give_when_done

    order, already = case
    pool, buf = BufferPool(), np.zeros(8)
    futures = [Future() for _ in order]
    for i in order[:already]:
        futures[i].set_result(None)
    give_when_done(futures, pool, buf)
    for i in order[already:]:
        assert pool.held_bytes() == 0
        futures[i].set_result(None)
    assert pool.take(8, buf.dtype) is buf


class _Scaled(Module):
    """``act(lin(x)) * scale`` (``scale`` a size-1 Parameter the caller may share)."""

    def __init__(self, lin, scale):
        super().__init__()
        self.lin, self.scale, self.act = lin, scale, nn.ReLU()

    def forward(self, x):
        self._h = self.act(self.lin(x))
        return self._h * self.scale.data

    def backward(self, g):
        self.scale.accumulate_grad(np.array([np.sum(g * self._h)]))
        return self.lin.backward(self.act.backward(g * self.scale.data))


class _Tied(Module):
    """Two ``_Scaled`` blocks sharing one Linear weight, one ``scale`` shared by the first
    block and the root itself (which scales the head's output by it)."""

    def __init__(self, width, seed):
        super().__init__()
        rng = np.random.default_rng(seed)
        scale = Parameter(np.array([1.5]))
        a, b = (nn.Linear(width, width, rng=rng, dtype=np.float64) for _ in range(2))
        b.weight = a.weight  # tied: one Parameter under "0.lin.weight" and "1.lin.weight"
        self.blocks = nn.Sequential(_Scaled(a, scale), _Scaled(b, Parameter(np.array([0.5]))))
        self.head = nn.Linear(width, 3, rng=rng, dtype=np.float64)
        self.scale = scale

    def forward(self, x):
        return self.head(self.blocks(x)) * self.scale.data

    def backward(self, g):
        return self.blocks.backward(self.head.backward(g * self.scale.data))


@settings(max_examples=10, deadline=None)
@given(case=st.sampled_from([(FS, 2, None), (FS, 3, None), (SGO, 2, None), (NS, 2, None),
                             (HS, 4, 2)]),
       width=st.integers(1, 6), reshard=st.booleans())
def test_a_parameter_shared_by_units_gives_the_bits_of_one_unit(case, width, reshard):
    # a weight tied between two units was gathered and reduced by the first only: the second
    # computed on the flat shard (FULL_SHARD: a shape error) or its gradient was dropped
    # (NO_SHARD, SHARD_GRAD_OP); a size-1 scale of a unit also used by the root: rank 1
    # computed with its zero padding. Such a parameter is its users' common unit's.
    strategy, world, intra = case
    x = np.random.default_rng(0).standard_normal((4 * world, width))
    y = np.random.default_rng(1).integers(0, 3, 4 * world)

    def body(b, wrap):
        f = FSDP(_Tied(width, 3), b, strategy, wrap=wrap, intra_node_size=intra,
                 reshard_after_forward=reshard if strategy in (FS, HS) else None)
        o = make_opt("sgd", f.module.parameters())
        lo = slice(4 * b.rank, 4 * b.rank + 4)
        losses = train_steps(f, o, nn.CrossEntropyLoss(), x[lo], y[lo], 2)
        tensors, _ = f.sharded_state_dict(o)
        f.load_sharded_state_dict(tensors, o)
        return f.units, losses, f.full_state_dict(), tensors

    one = run(lambda b: body(b, None), world)
    many = run(lambda b: body(b, _Scaled), world)
    for (_, l1, s1, t1), (units, l2, s2, t2) in zip(one, many):
        assert units == ["", "blocks.0", "blocks.1"]
        assert l1 == l2
        assert list(s1) == list(s2) and list(t1) == list(t2)
        for k in s1:
            np.testing.assert_array_equal(s1[k], s2[k])
        for k in t1:
            np.testing.assert_array_equal(t1[k], t2[k])


def test_a_shared_parameter_belongs_to_the_innermost_unit_holding_all_its_users():
    class Pair(Module):  # a unit around both blocks (and a parameter of its own)
        def __init__(self, blocks):
            super().__init__()
            self.blocks, self.bias = blocks, Parameter(np.zeros(4))

    def body(b):
        tied = _Tied(4, 0)
        units = FSDP(tied, b, FS, wrap=_Scaled)._units
        tied = _Tied(4, 0)
        tied.blocks = Pair(tied.blocks)
        nested = FSDP(tied, b, FS, wrap=(_Scaled, Pair))
        return [{u.name: sorted(f._names[i] for i in u.idx) for u in f._units}
                for f in (units[0].owner, nested)]

    flat, nested = run(body, 2)[0]
    # the tied weight: no unit but the root holds both blocks; scale: block 0's and the root's
    assert flat == {"": ["blocks.0.lin.weight", "blocks.0.scale", "head.bias", "head.weight"],
                    "blocks.0": ["blocks.0.lin.bias"],
                    "blocks.1": ["blocks.1.lin.bias", "blocks.1.scale"]}
    assert nested == {"": ["blocks.blocks.0.scale", "head.bias", "head.weight"],
                      "blocks": ["blocks.bias", "blocks.blocks.0.lin.weight"],
                      "blocks.blocks.0": ["blocks.blocks.0.lin.bias"],
                      "blocks.blocks.1": ["blocks.blocks.1.lin.bias", "blocks.blocks.1.scale"]}
