"""A GPT-style model (tests/_gpt.py) trained with AdamW: FSDP with one unit per
TransformerBlock on 2 thread ranks follows the single-process trajectory on the whole batch."""

import numpy as np
import pytest
from _gpt import TinyGPT, lm_step
from _helpers import FS, SGO, assert_close_rel, run

from ferro_fsdp import FSDP, nn, optim

VOCAB, SEQ, EMBED, HEADS, LAYERS = 13, 6, 8, 2, 2
BATCH = 8   # 4 sequences per rank on 2 ranks


def data(seed=7):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, VOCAB, (BATCH, SEQ))
    return idx, np.roll(idx, -1, axis=1)    # predict the next token (wrapping around)


def model(dtype=np.float64):
    return TinyGPT(VOCAB, SEQ, EMBED, HEADS, LAYERS, dtype=dtype, rng=11)


def single_process(steps, dtype=np.float64):
    m = model(dtype)
    opt = optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    idx, targets = data()
    loss_fn, losses = nn.CrossEntropyLoss(), []
    for _ in range(steps):
        losses.append(lm_step(m, loss_fn, idx, targets))
        opt.step()
        opt.zero_grad()
    return m.state_dict(), losses


def fsdp_rank(b, steps, strategy=FS, wrap=nn.TransformerBlock, dtype=np.float64):
    f = FSDP(model(dtype), b, strategy, wrap=wrap)
    opt = optim.AdamW(f.module.parameters(), lr=1e-2, weight_decay=0.1)
    idx, targets = data()
    half = BATCH // b.world_size
    mine = slice(b.rank * half, (b.rank + 1) * half)
    loss_fn, losses = nn.CrossEntropyLoss(), []
    for _ in range(steps):
        logits = f(idx[mine])
        losses.append(loss_fn(logits.reshape(-1, VOCAB), targets[mine].reshape(-1)))
        f.backward(loss_fn.backward().reshape(logits.shape))
        f.sync_gradients()
        opt.step()
        opt.zero_grad()
        f.broadcast_updated_params()
    return f.units, losses, f.full_state_dict()


@pytest.mark.parametrize("strategy", [FS, SGO])
def test_fsdp_one_unit_per_block_matches_one_process(strategy):
    steps = 4
    ref_state, ref_losses = single_process(steps)
    results = run(lambda b: fsdp_rank(b, steps, strategy), 2)
    for units, _losses, state in results:
        assert units == ["", "h.0", "h.1"]    # the root (embeddings, ln_f, head) and a unit per block
        assert list(state) == list(ref_state)
        for k in ref_state:
            assert_close_rel(state[k], ref_state[k], 1e-9)
    # the mean of the two ranks' losses is the loss on the whole batch
    for step in range(steps):
        mean = (results[0][1][step] + results[1][1][step]) / 2
        assert mean == pytest.approx(ref_losses[step], rel=1e-10)
    assert ref_losses[-1] < ref_losses[0]


def test_units_per_block_give_the_bits_of_one_unit():
    per_block = run(lambda b: fsdp_rank(b, 2), 2)
    one_unit = run(lambda b: fsdp_rank(b, 2, wrap=None), 2)
    for (_, la, sa), (units, lb, sb) in zip(per_block, one_unit):
        assert units == [""] and la == lb
        for k in sa:
            np.testing.assert_array_equal(sa[k], sb[k])


def test_float32_gpt_learns_a_sequence():
    state, losses = single_process(30, dtype=np.float32)
    assert all(v.dtype == np.float32 for v in state.values())
    assert losses[-1] < 0.5 * losses[0]


def test_ddp_trains_the_gpt_like_one_process():
    from ferro_fsdp import DDP

    steps = 3
    ref_state, _ = single_process(steps)

    def rank(b):
        ddp = DDP(model(), b, bucket_cap_mb=0.001)   # several buckets, allreduces overlapping
        opt = optim.AdamW(ddp.module.parameters(), lr=1e-2, weight_decay=0.1)
        idx, targets = data()
        half = BATCH // b.world_size
        mine = slice(b.rank * half, (b.rank + 1) * half)
        loss_fn = nn.CrossEntropyLoss()
        for _ in range(steps):
            logits = ddp(idx[mine])
            loss_fn(logits.reshape(-1, VOCAB), targets[mine].reshape(-1))
            ddp.backward(loss_fn.backward().reshape(logits.shape))
            opt.step()
            opt.zero_grad()
        return ddp.module.state_dict()

    for state in run(rank, 2):
        for k in ref_state:
            assert_close_rel(state[k], ref_state[k], 1e-9)
