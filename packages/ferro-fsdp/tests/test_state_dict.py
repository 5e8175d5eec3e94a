"""Sharded state dicts: stop on one world size and strategy, resume on another, same trajectory.

ferro-checkpoint is not a dependency; `checkpoint_reshard` below does what its save + load on a
new world size does (concatenate the pieces along dim 0 in rank order, split again with "the
first full % world ranks get one extra row").
"""

import numpy as np
import pytest
from _helpers import (
    DIMS,
    FS,
    HS,
    NS,
    SGO,
    assert_close_rel,
    full_params,
    make_data,
    make_mlp,
    make_opt,
    reference_training,
    run,
    train_steps,
    wrap,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from ferro_fsdp import FSDP, nn, split_sizes

N = 24
STEPS = 20
STOP = 9


def consolidate(per_rank, specs_per_rank):
    """The full flattened tensors from every rank's pieces, checking the specs on the way."""
    specs = specs_per_rank[0]
    for other in specs_per_rank[1:]:
        assert other == specs, "every rank must compute the same specs"
    full = {}
    for key, (full_shape, shard_dim, sizes) in specs.items():
        assert shard_dim == 0 and len(full_shape) == 1
        assert len(sizes) == len(per_rank)
        assert sum(sizes) == full_shape[0]
        pieces = [t[key] for t in per_rank]
        assert [p.shape for p in pieces] == [(s,) for s in sizes]
        full[key] = np.concatenate(pieces)
    return full


def checkpoint_reshard(full, world):
    out = []
    for r in range(world):
        d = {}
        for key, arr in full.items():
            sizes = split_sizes(arr.shape[0], world)
            start = sum(sizes[:r])
            d[key] = arr[start:start + sizes[r]].copy()
        out.append(d)
    return out


def train_and_save(strategy, world, intra, opt_kind, steps):
    x, y = make_data(N)
    per = N // world

    def body(b):
        w = wrap(make_mlp(), b, strategy, intra)
        opt = make_opt(opt_kind, w.module.parameters())
        sl = slice(b.rank * per, (b.rank + 1) * per)
        losses = train_steps(w, opt, nn.CrossEntropyLoss(), x[sl], y[sl], steps)
        tensors, specs = w.sharded_state_dict(opt)
        return tensors, specs, losses

    res = run(body, world)
    return [r[0] for r in res], [r[1] for r in res], [r[2] for r in res]


def load_and_train(strategy, world, intra, opt_kind, per_rank, steps):
    x, y = make_data(N)
    per = N // world

    def body(b):
        model = make_mlp(seed=123)  # other initial values: everything comes from the state dict
        w = wrap(model, b, strategy, intra)
        opt = make_opt(opt_kind, w.module.parameters())
        w.load_sharded_state_dict(per_rank[b.rank], opt)
        sl = slice(b.rank * per, (b.rank + 1) * per)
        losses = train_steps(w, opt, nn.CrossEntropyLoss(), x[sl], y[sl], steps)
        return full_params(w), losses

    return run(body, world)


RESUMES = [
    ((FS, 4, None), (FS, 2, None)),
    ((FS, 2, None), (FS, 4, None)),
    ((FS, 4, None), (FS, 3, None)),
    ((HS, 4, 2), (FS, 2, None)),
    ((FS, 4, None), (HS, 4, 2)),
    ((SGO, 4, None), (NS, 2, None)),
    ((NS, 2, None), (SGO, 4, None)),
    (("ddp", 4, None), (FS, 2, None)),
    ((FS, 2, None), ("ddp", 4, None)),
]


def _id(case):
    (s1, w1, _), (s2, w2, _) = case
    return f"{getattr(s1, 'name', s1)}{w1}-to-{getattr(s2, 'name', s2)}{w2}"


@pytest.mark.parametrize("opt_kind", ["adam", "sgd"])
@pytest.mark.parametrize("case", RESUMES, ids=[_id(c) for c in RESUMES])
def test_resume_on_another_world_size_continues_the_trajectory(case, opt_kind):
    (s1, w1, i1), (s2, w2, i2) = case
    x, y = make_data(N)
    ref_params, ref_losses = reference_training(opt_kind, STEPS, x, y)
    per_rank, specs, losses1 = train_and_save(s1, w1, i1, opt_kind, STOP)
    full = consolidate(per_rank, specs)
    n_state = 2 if opt_kind == "adam" else 1
    assert len(full) == 4 * (1 + n_state + (opt_kind == "adam"))
    if opt_kind == "adam":
        assert all((full[k] == STOP).all() for k in full if k.endswith(".step"))
    results = load_and_train(s2, w2, i2, opt_kind, checkpoint_reshard(full, w2), STEPS - STOP)
    for params, _ in results:
        for name in ref_params:
            assert_close_rel(params[name], ref_params[name], 1e-10)
    mean_before = np.mean(losses1, axis=0)
    mean_after = np.mean([r[1] for r in results], axis=0)
    np.testing.assert_allclose(np.concatenate([mean_before, mean_after]), ref_losses, rtol=1e-10)


def test_specs_describe_the_pieces():
    per_rank, specs, _ = train_and_save(FS, 4, None, "adam", 1)
    assert specs[0]["0.weight"] == ((91,), 0, (23, 23, 23, 22))
    assert specs[0]["optim.0.weight.exp_avg"] == ((91,), 0, (23, 23, 23, 22))
    assert specs[0]["optim.0.weight.step"] == ((4,), 0, (1, 1, 1, 1))
    assert per_rank[3]["0.weight"].shape == (22,)
    assert per_rank[0]["optim.0.weight.step"].dtype == np.int64
    hybrid, hspecs, _ = train_and_save(HS, 4, 2, "sgd", 1)
    assert hspecs[0]["0.weight"] == ((91,), 0, (46, 45, 0, 0))
    assert hybrid[2]["0.weight"].shape == (0,)


def test_load_what_was_saved_on_the_same_world_and_full_tensors():
    # the same world size: ferro-checkpoint hands back each rank's own file (here: hybrid's
    # first-node layout); a consolidated checkpoint: the full tensors on every rank
    per_rank, specs, _ = train_and_save(HS, 4, 2, "adam", 3)
    full = consolidate(per_rank, specs)
    x, y = make_data(N)
    ref_params, _ = reference_training("adam", 5, x, y)
    for pieces in (per_rank, [dict(full)] * 4):
        for params, _ in load_and_train(HS, 4, 2, "adam", pieces, 2):
            for name in ref_params:
                assert_close_rel(params[name], ref_params[name], 1e-10)


def test_bad_state_dicts_raise_on_every_rank():
    per_rank, specs, _ = train_and_save(FS, 2, None, "sgd", 1)

    def attempt(mutate):
        pieces = [dict(d) for d in per_rank]
        mutate(pieces)

        def body(b):
            w = FSDP(make_mlp(), b)
            opt = make_opt("sgd", w.module.parameters())
            try:
                w.load_sharded_state_dict(pieces[b.rank], opt)
            except ValueError as exc:
                return str(exc)
            return None

        return run(body, 2)

    msgs = attempt(lambda p: [d.pop("0.weight") for d in p])
    assert all(m and "missing parameter keys ['0.weight']" in m for m in msgs)
    msgs = attempt(lambda p: p[1].update({"bogus": np.zeros(1)}))
    assert all(m and "unexpected keys" in m for m in msgs)
    msgs = attempt(lambda p: p[0].update({"0.bias": np.zeros(2)}))
    assert all(m and "add up" in m for m in msgs)
    msgs = attempt(lambda p: p[0].pop("optim.0.weight.momentum_buffer"))
    assert all(m and "present on ranks [1] only" in m for m in msgs)


@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_a_transposed_full_tensor_or_an_incomplete_adam_state_is_refused_on_every_rank(wrapper):
    """A full tensor of the parameter's size but another shape loaded scrambled, and Adam's
    moments without their step count (or one moment) loaded, then failed or reset at the
    step: both are refused before anything is loaded."""
    from ferro_fsdp import DDP

    per_rank, specs, _ = train_and_save(FS, 2, None, "adam", 1)
    full = consolidate(per_rank, specs)  # (flat)
    shape = make_mlp().state_dict()["0.weight"].shape

    def attempt(pieces):
        def body(b):
            model = make_mlp()
            w = FSDP(model, b) if wrapper == "fsdp" else DDP(model, b)
            opt = make_opt("adam", w.module.parameters())
            before = [p.data.copy() for p in w.module.parameters()]
            with pytest.raises(ValueError) as exc:
                w.load_sharded_state_dict(dict(pieces[b.rank]), opt)
            assert all(np.array_equal(p.data, q) for p, q in zip(w.module.parameters(), before))
            return str(exc.value)

        return run(body, 2)

    bad = dict(full, **{"0.weight": full["0.weight"].reshape(shape).T.copy()})
    msgs = attempt([bad, dict(full)])  # (rank 1's is right: it refuses too)
    assert all("full tensors of another shape on ranks [0]" in m for m in msgs), msgs
    assert f"'0.weight' has shape {shape[::-1]}, its parameter {shape}" in msgs[0]
    for gone in ("step", "exp_avg_sq"):
        key = f"optim.0.weight.{gone}"
        msgs = attempt([{k: v for k, v in d.items() if k != key} for d in per_rank])
        assert all(f"optimizer state of '0.weight' lacks ['{key}']" in m for m in msgs), msgs


def test_optimizer_must_hold_the_parameters():
    def body(b):
        w = FSDP(make_mlp(), b)
        other = make_opt("sgd", make_mlp().parameters())
        with pytest.raises(ValueError, match="does not hold"):
            w.sharded_state_dict(other)

    run(body, 1)


def test_resume_into_a_model_of_another_shape_names_the_shapes_and_sizes():
    per_rank, _, _ = train_and_save(FS, 2, None, "sgd", 1)
    dims = (DIMS[0], DIMS[1] + 1, *DIMS[2:])      # a wider first hidden layer
    want_shape = (dims[1], dims[0])

    def body(b):
        w = FSDP(make_mlp(dims), b)
        opt = make_opt("sgd", w.module.parameters())
        with pytest.raises(ValueError) as info:
            w.load_sharded_state_dict(per_rank[b.rank], opt)
        return str(info.value)

    saved = [per_rank[r]["0.weight"].size for r in range(2)]
    n = dims[0] * dims[1]
    for msg in run(body, 2):
        assert "'0.weight'" in msg and "pieces" not in msg
        assert f"shape {want_shape} ({n} elements)" in msg       # what it expected
        assert f"add up to {n} (e.g. {list(split_sizes(n, 2))})" in msg
        assert f"got shard sizes {saved} ({sum(saved)} elements in all" in msg  # what it got
        assert "another shape" in msg


@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_shards_of_a_model_twice_as_wide_are_not_taken_for_full_tensors(wrapper):
    """Hidden width halved on 2 ranks: every rank's piece has the new parameter's size, and
    was loaded as "the full tensor on every rank" (rank 0 the first half, rank 1 the second).
    It is refused on every rank before anything is loaded; the full tensors still load."""
    from ferro_fsdp import DDP

    wide, narrow = (4, 8, 2), (4, 4, 2)

    def save(b):
        w = FSDP(make_mlp(wide), b)
        opt = make_opt("sgd", w.module.parameters())
        train_steps(w, opt, nn.CrossEntropyLoss(), *make_data(4, wide), 1)
        return w.sharded_state_dict(opt)[0], FSDP(make_mlp(narrow, seed=4), b).full_state_dict()

    saved = run(save, 2)
    full = saved[0][1]

    def load(b):
        model = make_mlp(narrow, seed=7)
        w = FSDP(model, b) if wrapper == "fsdp" else DDP(model, b)
        opt = make_opt("sgd", w.module.parameters())
        before = [p.data.copy() for p in w.module.parameters()]
        with pytest.raises(ValueError) as exc:
            w.load_sharded_state_dict(saved[b.rank][0], opt)
        assert all(np.array_equal(p.data, q) for p, q in zip(w.module.parameters(), before))
        msgs = [str(exc.value)]
        for given_ in (full, {k: v.reshape(-1) for k, v in full.items()}):
            w.load_sharded_state_dict(dict(given_))  # the full tensors on every rank
            got = w.full_state_dict() if wrapper == "fsdp" else w.module.state_dict()
            msgs.append(all(np.array_equal(got[k], full[k]) for k in full))
        return msgs

    for msg, *loaded in run(load, 2):
        assert "'0.weight' does not fit this model's parameter of shape (4, 4)" in msg, msg
        assert "ranks [1] hold other values than rank 0" in msg and "another shape" in msg
        assert loaded == [True, True]


@settings(max_examples=10, deadline=None)
@given(case=st.sampled_from([(FS, 2, None), (FS, 3, None), (SGO, 3, None), (NS, 2, None),
                             (HS, 4, 2)]), seed=st.integers(0, 3))
def test_state_dict_is_the_full_tensors_and_loads_back(case, seed):
    # FSDP.state_dict() gave this rank's padded flat shards under the full parameters' names,
    # and load_state_dict(full_state_dict()) failed: torch's FSDP.state_dict is full tensors
    strategy, world, intra = case
    want = make_mlp(seed=seed).state_dict()

    def body(b):
        f = FSDP(make_mlp(seed=9), b, strategy, intra_node_size=intra)
        f.load_state_dict(want)  # a one-process model's
        loaded = f.state_dict()
        shards = [p.data.copy() for p in f.module.parameters()]
        f.load_state_dict(f.full_state_dict())
        again = [p.data for p in f.module.parameters()]
        with pytest.raises(KeyError, match="missing keys"):
            f.load_state_dict({k: v for k, v in want.items() if k != "0.bias"})
        with pytest.raises(ValueError, match="has shape"):
            f.load_state_dict({k: v.reshape(-1) for k, v in want.items()})
        return loaded, shards, again

    for loaded, shards, again in run(body, world):
        assert list(loaded) == list(want)
        for k in want:
            np.testing.assert_array_equal(loaded[k], want[k])
        for s, a in zip(shards, again):
            np.testing.assert_array_equal(s, a)
