"""Persistent buffers on the step path: DDP and FSDP units allocate no bucket- or unit-sized
array per step, and FULL_SHARD with one unit per layer holds at most two layers in full."""

import concurrent.futures
import gc
import threading
import tracemalloc

import numpy as np
import pytest
from _helpers import run

import ferro_fsdp.background as background_mod
import ferro_fsdp.units as units_mod
from ferro_fsdp import DDP, FSDP, nn
from ferro_fsdp.buffer_pool import BufferPool
from ferro_fsdp.wrapper import ModuleWrapper

WIDTH, LAYERS, BATCH = 128, 8, 4
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4


def _model():
    rng = np.random.default_rng(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, rng=rng) for _ in range(LAYERS)])


class _Done:
    """A finished collective, shaped like a Work (the fakes below move no bytes)."""

    def __init__(self, value):
        self.future = concurrent.futures.Future()
        self.future.set_result(value)

    def wait(self, timeout=None):
        return self.future.result()


def _fake_collectives(monkeypatch):
    """Collectives that write their result into ``out`` without allocating: what is measured
    is the wrappers' own allocations, not the transport's message copies."""

    def all_gather_async(x, group, *, out, timeout=None):
        out.reshape(group.world_size, -1)[...] = x
        return _Done(out)

    def reduce_scatter_async(x, group, op, *, out, timeout=None):
        out[...] = x.reshape(group.world_size, -1)[group.rank]
        return _Done(out)

    def allreduce_async(x, group, op, *, out, timeout=None, wire=None):
        return _Done(out)

    monkeypatch.setattr(units_mod, "all_gather_async", all_gather_async)
    monkeypatch.setattr(units_mod, "reduce_scatter_async", reduce_scatter_async)
    monkeypatch.setattr(background_mod, "allreduce_async", allreduce_async)
    # (the check at construction that every rank wraps the same parameters: one rank here)
    monkeypatch.setattr(ModuleWrapper, "_check_same_parameters", lambda *args: None)


_trace_lock = threading.Lock()


def _peak_of(fn):
    """Bytes allocated at the peak of ``fn()`` above what was allocated when it started."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start, _ = tracemalloc.get_traced_memory()
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - start


def _step(w, x, y, loss_fn):
    loss_fn(w(x), y)
    w.backward(loss_fn.backward())
    if isinstance(w, FSDP):
        w.sync_gradients()
    w.module.zero_grad()


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_step_allocates_no_bucket_or_unit_sized_array(monkeypatch, kind):
    _fake_collectives(monkeypatch)
    (b,) = __import__("ferro_backend").SimulatedBackend.create_group(1)
    # a world of one would skip the collectives: pretend two ranks on one backend
    monkeypatch.setattr(type(b), "world_size", property(lambda self: 2))
    w = DDP(_model(), b, bucket_cap_mb=LAYER_BYTES / (1 << 20), broadcast_parameters=False) \
        if kind == "ddp" else FSDP(_model(), b, "full_shard", wrap=nn.Linear)
    x = np.random.default_rng(1).standard_normal((BATCH, WIDTH)).astype(np.float32)
    y = np.zeros((BATCH, WIDTH), np.float32)
    loss_fn = nn.MSELoss()
    for _ in range(2):  # warm up: buckets, pools, execution order
        _step(w, x, y, loss_fn)
    peak = _peak_of(lambda: _step(w, x, y, loss_fn))
    activations = 6 * LAYERS * BATCH * WIDTH * 8
    assert peak < LAYER_BYTES / 2 + activations, (kind, peak, LAYER_BYTES)


def test_full_shard_one_unit_per_layer_holds_at_most_two_layers():
    """Real collectives, 2 ranks as threads (tracemalloc counts both): a forward with prefetch
    holds at most two full layers per rank above the shards, where one unit holds all eight."""
    x = np.random.default_rng(1).standard_normal((BATCH, WIDTH)).astype(np.float32)
    y = np.zeros((BATCH, WIDTH), np.float32)
    barrier = threading.Barrier(2)
    peaks = {}

    def traced(b, key, fn):
        """``fn()`` on every rank at once; ``peaks[key]``: the bytes all ranks allocated at
        the peak of it (tracemalloc counts the whole process: every rank's thread)."""
        barrier.wait(timeout=30)
        if b.rank == 0:
            gc.collect()
            tracemalloc.start()
            tracemalloc.reset_peak()
            peaks["start"] = tracemalloc.get_traced_memory()[0]
        barrier.wait(timeout=30)
        fn()
        barrier.wait(timeout=30)
        if b.rank == 0:
            peaks[key] = tracemalloc.get_traced_memory()[1] - peaks["start"]
            tracemalloc.stop()
        barrier.wait(timeout=30)

    def body(b, wrap):
        f = FSDP(_model(), b, "full_shard", wrap=wrap)
        _step(f, x, y, nn.MSELoss())  # records the execution order
        f._pool = BufferPool()        # start from an empty pool: every byte counts
        for u in f._units:
            u.result = None
        traced(b, wrap, lambda: f(x))

    def bare_gather(b):  # what the transport itself allocates for one unit's all-gather
        from ferro_collective import all_gather

        shard = np.ones(LAYER_BYTES // 4 // 2, np.float32)
        out = np.empty(2 * shard.size, np.float32)
        all_gather(shard, b, out=out)  # warm
        traced(b, "transport", lambda: all_gather(shard, b, out=out))

    run(bare_gather, 2)
    run(lambda b: body(b, nn.Linear), 2)
    run(lambda b: body(b, None), 2)
    per_rank = peaks[nn.Linear] / 2
    # two full layers, the shard a prefetch sent, the transport's own copies for the two
    # gathers that may be in flight (one measured above), the activations
    bound = 2 * LAYER_BYTES + LAYER_BYTES / 2 + peaks["transport"] \
        + BATCH * WIDTH * 4 * LAYERS
    assert per_rank <= bound, (peaks, bound)
    assert peaks[None] / 2 >= LAYERS * LAYER_BYTES  # one unit: the whole model at once
