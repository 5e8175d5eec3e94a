"""FSDP's ``secondary_shard`` (ZeRO++'s hpZ): the forward gathers over the world, the backward
inside the node from each rank's secondary shard; the training gives the same bits."""

import threading

import numpy as np
import pytest
from _helpers import make_data, make_mlp, make_opt, run, train_steps

import ferro_fsdp.units as units_module
from ferro_backend import InvalidWorldSizeError, SimulatedBackend
from ferro_fsdp import FSDP, nn

# (no parameter splits evenly over 4 ranks: every unit gathers packed, with or without the
# secondary shards, so int8 blocks fall alike)
DIMS = (12, 41, 30, 5)


def _train(b, steps, x, y, **kw):
    f = FSDP(make_mlp(DIMS, dtype=np.float32), b, "full_shard", wrap=nn.Linear, **kw)
    sl = slice(4 * b.rank, 4 * b.rank + 4)
    train_steps(f, make_opt("adam", f.parameters()), nn.CrossEntropyLoss(), x[sl], y[sl], steps)
    return f, [np.array(p.data) for p in f.module.parameters()]


@pytest.fixture
def gathers(monkeypatch):
    """The group size of every all-gather FSDP starts, by phase ("forward" / "backward")."""
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def spy(fn):
        def wrapped(x, group, *args, **kwargs):
            with lock:
                seen.append((group.world_size, x.size))
            return fn(x, group, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(units_module, "all_gather", spy(units_module.all_gather))
    monkeypatch.setattr(units_module, "all_gather_async", spy(units_module.all_gather_async))
    return seen


@pytest.mark.parametrize("weights_wire", [None, "int8"])
def test_the_backward_gathers_inside_the_node_and_the_bits_do_not_change(gathers, weights_wire):
    """The same bits as gathering over the world again, and as keeping the forward's
    parameters until the backward (with int8 weights: the forward's decoded values)."""
    x, y = make_data(16, DIMS, dtype=np.float32)
    want = run(lambda b: _train(b, 3, x, y, weights_wire=weights_wire)[1], 4)
    kept = run(lambda b: _train(b, 3, x, y, weights_wire=weights_wire,
                                reshard_after_forward=False)[1], 4)
    assert [[p.tobytes() for p in r] for r in kept] == [[p.tobytes() for p in r] for r in want]
    gathers.clear()

    def body(b):
        f, params = _train(b, 3, x, y, weights_wire=weights_wire, secondary_shard=True,
                           intra_node_size=2)
        sizes = {u.name: (u.secondary.size, u.layout.padded_numel) for u in f._units
                 if u.secondary is not None}
        return params, sizes

    for (params, sizes), ref in zip(run(body, 4), want):
        assert [p.tobytes() for p in params] == [p.tobytes() for p in ref]
        # every resharded unit keeps half of its gathered parameters (2 ranks a node)
        assert sizes and all(2 * part == padded for part, padded in sizes.values())
    world = sum(1 for g, _ in gathers if g == 4)
    node = sum(1 for g, _ in gathers if g == 2)
    # the Linear units' backward gathers went inside the node, none across it
    assert node > 0 and world > 0 and node == 4 * 3 * len(sizes) and world == node


def test_secondary_shard_needs_full_shard_and_the_ranks_per_node():
    (b,) = SimulatedBackend.create_group(1)
    with pytest.raises(ValueError, match="secondary_shard is for FULL_SHARD"):
        FSDP(make_mlp(DIMS), b, "shard_grad_op", secondary_shard=True, intra_node_size=1)
    with pytest.raises(InvalidWorldSizeError, match="multiple of intra_node_size None"):
        FSDP(make_mlp(DIMS), b, "full_shard", secondary_shard=True)
    with pytest.raises(ValueError, match="only valid for HYBRID_SHARD .or FULL_SHARD with "
                                         "secondary_shard"):
        FSDP(make_mlp(DIMS), b, "full_shard", intra_node_size=1)
