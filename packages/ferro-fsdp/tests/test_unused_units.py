"""Parameters and units that get no gradient on some ranks only (a branch some ranks' batches
do not take): they count as zeros, and every rank issues the same reductions in the same order,
so the result is the one-process mean whatever each rank's backward ran."""

import numpy as np
import pytest
from _helpers import FS, HS, NS, SGO, run

from ferro_fsdp import FSDP, Module, nn

NAMES = ("a", "b", "c")
# which layers each rank's forward skips, by step: layers of equal size (4x4), so a reduction
# of one paired with another's on another rank was indistinguishable to the mismatch check
SKIPS = [
    [set(), {"b"}, {"a", "c"}, {"c"}],
    [{"c"}, set(), {"b"}, {"a", "b", "c"}],
]


class Branchy(Module):
    """Three 4x4 Linear layers in a row; the layers in ``skip`` are not run (nor their
    backward): their parameters get no gradient on this rank."""

    def __init__(self):
        super().__init__()
        for k, name in enumerate(NAMES):
            setattr(self, name, nn.Linear(4, 4, rng=k, dtype=np.float64))
        self.skip: set[str] = set()
        self._ran: list[str] = []

    def forward(self, x):
        self._ran = [n for n in NAMES if n not in self.skip]
        for n in self._ran:
            x = getattr(self, n)(x)
        return x

    def backward(self, g):
        for n in reversed(self._ran):
            g = getattr(self, n).backward(g)
        return g


def _x(rank, step):
    return np.random.default_rng(10 * step + rank).standard_normal((3, 4))


def reference(world):
    """One process: every step's mean over the ranks of each parameter's gradient (None: 0)."""
    out = []
    for step, skips in enumerate(SKIPS):
        total = {}
        for r in range(world):
            m = Branchy()
            m.skip = skips[r]
            y = m(_x(r, step))
            m.backward(np.ones_like(y) / world)
            for n, p in m.named_parameters():
                total[n] = total.get(n, 0) + (0 if p.grad is None else p.grad)
        out.append({n: np.broadcast_to(g, p.data.shape) for (n, p), g in
                    zip(Branchy().named_parameters(), total.values())})
    return out


def this_ranks_piece(f, i, full):
    """What ``module.<p>.grad`` holds on this rank for parameter ``i`` whose mean gradient is
    ``full``, in the strategy's ``grad_form``."""
    form = f._spec.grad_form
    if form == "full":
        return full
    start, length = f._layout.region(i, f._shard_rank)
    if form == "chunk":
        return full.reshape(-1)[start:start + length]
    piece = np.zeros_like(full)
    piece.reshape(-1)[start:start + length] = full.reshape(-1)[start:start + length]
    return piece


def train(b, strategy, wrap, intra):
    f = FSDP(Branchy(), b, strategy, wrap=wrap, intra_node_size=intra)
    grads = []
    for step, skips in enumerate(SKIPS):
        f.module.skip = skips[b.rank]
        y = f(_x(b.rank, step))
        f.backward(np.ones_like(y))
        f.sync_gradients()
        grads.append([np.array(p.grad, copy=True) for p in f.module.parameters()])
        f.module.zero_grad()
    return grads, f


# FULL_SHARD / HYBRID_SHARD gather each unit as it runs (a collective): with wrap= every rank
# must run the same units; wrap=None (one unit) lets the ranks' branches differ
CASES = [(FS, 2, None, None), (FS, 4, None, None), (HS, 4, 2, None),
         *((s, w, None, wrap) for s, w in [(SGO, 2), (SGO, 3), (NS, 2), (NS, 4)]
           for wrap in (None, nn.Linear))]


@pytest.mark.parametrize("strategy,world,intra,wrap", CASES)
def test_a_parameter_without_a_gradient_on_some_ranks_counts_as_zeros(strategy, world, intra,
                                                                      wrap):
    # wrap=None, every parameter split evenly over the ranks (Unit.direct): the per-parameter
    # path was taken only where this rank had every gradient, so the ranks issued different
    # reduce-scatters (CollectiveMismatchError). wrap=nn.Linear: each rank started its units'
    # reductions in its own backward's order, and those its backward did not reach in
    # sync_gradients: equal-size reductions of different units paired up across ranks (NO_SHARD,
    # SHARD_GRAD_OP: wrong gradients, silently; FULL_SHARD: a mismatch)
    ref = reference(world)

    def body(b):
        grads, f = train(b, strategy, wrap, intra)
        names = [n for n, _ in f.module.named_parameters()]
        return [[this_ranks_piece(f, i, ref[step][n]) for i, n in enumerate(names)]
                for step in range(len(SKIPS))], grads

    for want, got in run(body, world):
        for w_step, g_step in zip(want, got):
            for w, g in zip(w_step, g_step):
                np.testing.assert_allclose(g, w, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("strategy,world", [(SGO, 2), (SGO, 3), (NS, 2), (NS, 4)])
def test_units_unused_on_some_ranks_give_the_bits_of_one_unit(strategy, world):
    # wrap= changes when bytes move, never the results, whichever units a rank's backward ran
    one = run(lambda b: train(b, strategy, None, None)[0], world)
    units = run(lambda b: train(b, strategy, nn.Linear, None)[0], world)
    for ra, rb in zip(one, units):
        for sa, sb in zip(ra, rb):
            for a, c in zip(sa, sb):
                np.testing.assert_array_equal(a, c)


def test_reductions_wait_for_their_turn_in_the_common_order(monkeypatch):
    # a unit whose backward is done before the units ahead of it in the common order (the
    # units' order reversed) is reduced after them: the order is every rank's
    import ferro_fsdp.units as units_mod

    issued = {0: [], 1: []}
    real = units_mod.Unit.start_reduce

    def logged(self, op):
        issued[self.owner._backend.rank].append(self.name or "<root>")
        return real(self, op)

    monkeypatch.setattr(units_mod.Unit, "start_reduce", logged)

    class Reversed(Branchy):
        def forward(self, x):  # rank 1 runs the layers the other way round
            self._ran = [n for n in NAMES if n not in self.skip]
            if self.rank == 1:
                self._ran.reverse()
            for n in self._ran:
                x = getattr(self, n)(x)
            return x

    def body(b):
        m = Reversed()
        m.rank = b.rank
        f = FSDP(m, b, NS, wrap=nn.Linear)
        y = f(_x(b.rank, 0))
        f.backward(np.ones_like(y))
        f.sync_gradients()
        return [p.grad.copy() for p in f.module.parameters()]

    run(body, 2)
    assert issued[0] == issued[1] == ["c", "b", "a", "<root>"]


@pytest.mark.parametrize("strategy,world,wrap", [(FS, 2, None), (SGO, 3, nn.Linear),
                                                 (NS, 2, nn.Linear), (NS, 4, nn.Linear)])
@pytest.mark.parametrize("no_sync_first", [True, False])
def test_no_sync_micro_steps_with_units_unused_on_some_ranks(strategy, world, wrap,
                                                             no_sync_first):
    # two micro-steps, one inside no_sync(), each skipping other layers on each rank: which
    # units sync_gradients reduces again is decided the same on every rank (it was decided
    # from this rank's gradients)
    ref = reference(world)

    def body(b):
        f = FSDP(Branchy(), b, strategy, wrap=wrap)
        for step, skips in enumerate(SKIPS):
            f.module.skip = skips[b.rank]
            y = f(_x(b.rank, step))
            if (step == 0) == no_sync_first:
                with f.no_sync():
                    f.backward(np.ones_like(y))
            else:
                f.backward(np.ones_like(y))
        f.sync_gradients()
        want = [this_ranks_piece(f, i, ref[0][n] + ref[1][n])
                for i, (n, _) in enumerate(f.module.named_parameters())]
        return want, [np.array(p.grad, copy=True) for p in f.module.parameters()]

    for want, got in run(body, world):
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w, rtol=1e-13, atol=1e-15)
