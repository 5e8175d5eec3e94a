"""ferro-checkpoint against raw safetensors on a 256 MiB state dict (64 float32 tensors of 4 MiB),
and the `_along_dim` kernels against np.concatenate / slicing + np.copyto.

ferro's save does more than ``safetensors.numpy.save_file``: a crc32 per tensor, fsync of the
shard and the directory, and the commit record. Each group also times the baseline plus an
fsync, so the price of durability shows.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy as stn

from ferro_checkpoint import (
    AsyncCheckpointer,
    ShardMetadata,
    TensorShardSpec,
    compute_shard_sizes,
    concat_along_dim,
    consolidate,
    load_distributed,
    reshard,
    save_distributed,
    slice_along_dim,
)

N_TENSORS, ROWS, COLS = 64, 1024, 1024  # 64 x 4 MiB


@pytest.fixture(scope="module")
def state():
    rng = np.random.default_rng(0)
    return {f"layer{i}.weight": rng.standard_normal((ROWS, COLS), dtype=np.float32)
            for i in range(N_TENSORS)}


def spec(world: int) -> ShardMetadata:
    return ShardMetadata(world, {f"layer{i}.weight": TensorShardSpec(
        (ROWS, COLS), 0, compute_shard_sizes(ROWS, world)) for i in range(N_TENSORS)})


@pytest.fixture
def workdir():
    d = Path(tempfile.mkdtemp(prefix="ferro_bench_ckpt_"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _fsync(path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _info(benchmark, group):
    benchmark.group = group
    benchmark.extra_info["bytes"] = N_TENSORS * ROWS * COLS * 4


@pytest.mark.parametrize("impl", ["safetensors", "safetensors+fsync", "ferro"])
def bench_save_256MiB(benchmark, impl, state, workdir):
    _info(benchmark, "save 256MiB")
    counter = iter(range(10**6))
    if impl.startswith("safetensors"):
        if impl == "safetensors":
            benchmark.extra_info["role"] = "baseline"

        def run():
            path = workdir / f"s{next(counter)}.safetensors"
            stn.save_file(state, str(path))
            if impl.endswith("fsync"):
                _fsync(path)
    else:
        meta = spec(1)

        def run():
            save_distributed(state, workdir / f"c{next(counter)}", 0, 1, meta,
                             checkpoint_id="bench")

    benchmark.pedantic(run, rounds=3, warmup_rounds=1)


@pytest.mark.parametrize("impl", ["safetensors", "ferro", "ferro(verify=False)"])
def bench_load_256MiB(benchmark, impl, state, workdir):
    """ferro verifies every tensor's crc32 by default; verify=False shows what that costs."""
    _info(benchmark, "load 256MiB")
    stn.save_file(state, str(workdir / "s.safetensors"))
    save_distributed(state, workdir / "c", 0, 1, spec(1), checkpoint_id="bench")
    if impl == "safetensors":
        benchmark.extra_info["role"] = "baseline"
        out = benchmark.pedantic(lambda: stn.load_file(str(workdir / "s.safetensors")),
                                 rounds=3, warmup_rounds=1)
    else:
        verify = impl == "ferro"
        out = benchmark.pedantic(lambda: load_distributed(workdir / "c", 0, 1, verify=verify),
                                 rounds=3, warmup_rounds=1)
    np.testing.assert_array_equal(out["layer3.weight"], state["layer3.weight"])


@pytest.mark.parametrize("impl", ["safetensors", "ferro"])
def bench_reshard_4_to_8(benchmark, impl, state, workdir):
    """Baseline: load the 4 old shard files whole with safetensors and slice the new shard."""
    _info(benchmark, "reshard 4->8 (one new rank) 256MiB")
    old = spec(4)
    for r in range(4):
        s = old.tensor_specs["layer0.weight"].start(r)
        shard = {k: v[s:s + ROWS // 4] for k, v in state.items()}
        save_distributed(shard, workdir, r, 4, old, checkpoint_id="bench")
    new_rank = 3
    lo, hi = new_rank * ROWS // 8, (new_rank + 1) * ROWS // 8
    if impl == "safetensors":
        benchmark.extra_info["role"] = "baseline"

        def run():
            parts = [stn.load_file(str(workdir / f"rank_{r}.safetensors")) for r in range(4)]
            return {k: np.concatenate([p[k] for p in parts])[lo:hi] for k in state}
    else:
        def run():
            return reshard(workdir, 4, 8, new_rank)

    out = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    np.testing.assert_array_equal(out["layer7.weight"], state["layer7.weight"][lo:hi])


@pytest.mark.parametrize("impl", ["safetensors", "ferro"])
def bench_consolidate_256MiB(benchmark, impl, state, workdir):
    """Baseline: load every shard with safetensors, concatenate, save_file once."""
    _info(benchmark, "consolidate 4 shards 256MiB")
    old = spec(4)
    for r in range(4):
        s = old.tensor_specs["layer0.weight"].start(r)
        save_distributed({k: v[s:s + ROWS // 4] for k, v in state.items()}, workdir / "c", r, 4,
                         old, checkpoint_id="bench")
    if impl == "safetensors":
        benchmark.extra_info["role"] = "baseline"

        def run():
            parts = [stn.load_file(str(workdir / "c" / f"rank_{r}.safetensors"))
                     for r in range(4)]
            stn.save_file({k: np.concatenate([p[k] for p in parts]) for k in state},
                          str(workdir / "full_st.safetensors"))
    else:
        def run():
            consolidate(workdir / "c", workdir / "full_ferro.safetensors")

    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    if impl == "ferro":
        back = stn.load_file(str(workdir / "full_ferro.safetensors"))
        np.testing.assert_array_equal(back["layer9.weight"], state["layer9.weight"])


@pytest.mark.parametrize("impl", ["plain_copy", "ferro.save_async"])
def bench_save_async_blocking_time(benchmark, impl, state, workdir):
    """How long save_async blocks the caller, against a plain copy of the state."""
    _info(benchmark, "save_async blocking 256MiB")
    if impl == "plain_copy":
        benchmark.extra_info["role"] = "baseline"
        benchmark.pedantic(lambda: {k: v.copy() for k, v in state.items()}, rounds=5,
                           warmup_rounds=1)
        return
    ck = AsyncCheckpointer(workdir, 0, 1, spec(1))
    futures = []

    def setup():
        if futures:
            futures[-1].wait()

    benchmark.pedantic(lambda: futures.append(ck.save_async(state)), setup=setup, rounds=5,
                       warmup_rounds=1)
    futures[-1].wait()
    np.testing.assert_array_equal(load_distributed(workdir, 0, 1)["layer1.weight"],
                                  state["layer1.weight"])


# ------------------------------------------------------------------ _along_dim kernels
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("impl", ["numpy", "_along_dim"])
def bench_concat_along_dim(benchmark, impl, dim):
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((512, 2048), dtype=np.float32) for _ in range(8)]
    shape = (4096, 2048) if dim == 0 else (512, 16384)
    out = np.empty(shape, np.float32)
    benchmark.group = f"concat_along_dim dim={dim} 32MiB"
    benchmark.extra_info["bytes"] = out.nbytes
    if impl == "numpy":
        benchmark.extra_info["role"] = "baseline"
        benchmark.pedantic(lambda: np.concatenate(parts, axis=dim, out=out), rounds=20,
                           warmup_rounds=2)
    else:
        benchmark.pedantic(lambda: concat_along_dim(parts, dim, out=out), rounds=20,
                           warmup_rounds=2)
    np.testing.assert_array_equal(out, np.concatenate(parts, axis=dim))


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("impl", ["copyto", "_along_dim"])
def bench_slice_along_dim(benchmark, impl, dim):
    a = np.random.default_rng(2).standard_normal((4096, 4096), dtype=np.float32)
    benchmark.group = f"slice_along_dim dim={dim} 16MiB of 64MiB"
    benchmark.extra_info["bytes"] = a.nbytes // 4
    idx = (slice(1024, 2048), slice(None)) if dim == 0 else (slice(None), slice(1024, 2048))
    if impl == "copyto":
        benchmark.extra_info["role"] = "baseline"
        out = np.empty(a[idx].shape, np.float32)
        benchmark.pedantic(lambda: np.copyto(out, a[idx]), rounds=20, warmup_rounds=2)
    else:
        out = benchmark.pedantic(lambda: slice_along_dim(a, dim, 1024, 2048), rounds=20,
                                 warmup_rounds=2)
    np.testing.assert_array_equal(out, a[idx])
