"""ferro-checkpoint against raw safetensors on a 256 MiB state dict (64 float32 tensors of 4 MiB),
against torch's distributed checkpoint (DCP) on 2 ranks, and its kernels against numpy / zlib:
`_along_dim` against np.concatenate / slicing + np.copyto, `_copy_crc` (copy and CRC-32C in one
pass) against np.copyto and zlib.crc32.

ferro's save does more than ``safetensors.numpy.save_file``: a checksum per 1 MiB chunk, fsync of
the shard and the directory, and the commit record. Each group also times the baseline plus an
fsync, so the price of durability shows.

The 2-rank groups (``bench_dcp_*``, ``bench_reshard_2_ranks``) run two spawned processes (gloo
for DCP, one thread each, ``LOCAL_WORLD_SIZE=2`` as torchrun sets it) and time each round from
the command sent to both ranks to both replies; each side's files are written in the same run.
"warm": the files are in the page cache (written just before); "cold": every file of both sides
is dropped from the page cache before each round (``posix_fadvise(DONTNEED)`` after fsync).
DCP loads into a state dict allocated and touched before timing (its only mode); ferro's rows
say whether they return new arrays, load into ``out=`` arrays likewise allocated before, or map
the files (``mmap=True``). They need torch (skipped without it). ``FERRO_BENCH_4GIB=1`` adds the
4 GiB restore against ``np.copyto`` (about 14 GiB of memory; off by default).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import tempfile
import time
import traceback
import zlib
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy as stn

from ferro_checkpoint import (
    AsyncCheckpointer,
    CheckpointManager,
    ShardMetadata,
    TensorShardSpec,
    _copy_crc,
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


# ------------------------------------------------------------------ _copy_crc kernel
KERNEL_BYTES = 64 << 20


@pytest.fixture(scope="module")
def kernel_bytes():
    src = np.random.default_rng(5).integers(0, 256, KERNEL_BYTES, dtype=np.uint8)
    dst = np.ones_like(src)
    return src, dst


@pytest.mark.parametrize("impl", ["copyto", "copyto+zlib.crc32", "_copy_crc",
                                  "_copy_crc(no checksum)"])
def bench_copy_crc_64MiB(benchmark, impl, kernel_bytes):
    """The load's one pass (copy + CRC-32C per 1 MiB chunk) against a plain np.copyto, and
    against what loads did before (np.copyto, then zlib.crc32 over the copy)."""
    src, dst = kernel_bytes
    benchmark.group = "_copy_crc copy+checksum 64MiB (in memory)"
    benchmark.extra_info["bytes"] = KERNEL_BYTES
    crcs = np.empty(KERNEL_BYTES >> 20, np.uint32)
    if impl == "copyto":
        benchmark.extra_info["role"] = "baseline"
        run = lambda: np.copyto(dst, src)
    elif impl == "copyto+zlib.crc32":
        benchmark.extra_info["role"] = "context"
        run = lambda: (np.copyto(dst, src), zlib.crc32(dst))
    else:
        c = crcs if impl == "_copy_crc" else crcs[:0]
        run = lambda: _copy_crc.copy_window(src, dst, 0, src.size, 1, src.size, src.size, 0,
                                            0, src.size, c, 1 << 20, True)
    benchmark.pedantic(run, rounds=15, warmup_rounds=2)
    np.testing.assert_array_equal(dst, src)
    if impl == "_copy_crc":
        assert int(crcs[3]) == _copy_crc.crc32c(src[3 << 20:4 << 20])


@pytest.mark.parametrize("impl", ["zlib.crc32", "_copy_crc.crc32c"])
def bench_crc32c_64MiB(benchmark, impl, kernel_bytes):
    """Checksum alone (what a verified zero-copy load costs): CRC-32C on the CPU's instruction
    against zlib's crc32."""
    src, _ = kernel_bytes
    benchmark.group = "_copy_crc checksum 64MiB (in memory)"
    benchmark.extra_info["bytes"] = KERNEL_BYTES
    benchmark.extra_info["implementation"] = _copy_crc.implementation()
    if impl == "zlib.crc32":
        benchmark.extra_info["role"] = "baseline"
        benchmark.pedantic(lambda: zlib.crc32(src), rounds=15, warmup_rounds=2)
    else:
        benchmark.pedantic(lambda: _copy_crc.crc32c(src), rounds=15, warmup_rounds=2)


# ------------------------------------------------------------------ 2 ranks, against torch DCP
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard(spec_world: int, rank: int, n: int, rows: int, cols: int) -> dict:
    """Rank ``rank``'s rows of the benchmark state (tensor i is the same on every world)."""
    sizes = compute_shard_sizes(rows, spec_world)
    lo = sum(sizes[:rank])
    out = {}
    for i in range(n):
        full = np.random.default_rng(i).standard_normal((rows, cols), dtype=np.float32)
        out[f"layer{i}.weight"] = full[lo:lo + sizes[rank]].copy()
        del full
    return out


def _spec(world: int, n: int, rows: int, cols: int) -> ShardMetadata:
    return ShardMetadata(world, {f"layer{i}.weight": TensorShardSpec(
        (rows, cols), 0, compute_shard_sizes(rows, world)) for i in range(n)})


def _rank_main(rank: int, world: int, port: int, conn) -> None:
    """One benchmark rank: runs the coordinator's commands, replies with the time taken."""
    os.environ.update(LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    mesh = init_device_mesh("cpu", (world,))
    st: dict = {}

    def dtensors(arrays):
        return {k: DTensor.from_local(torch.from_numpy(v), mesh, [Shard(0)])
                for k, v in arrays.items()}

    def writer(fmt, path):
        fs = dcp.FileSystemWriter
        return (dcp.HuggingFaceStorageWriter(path, save_distributed=True) if fmt == "hf"
                else fs(path, sync_files=fmt != "torch_save_nosync"))

    def reader(fmt, path):
        return dcp.HuggingFaceStorageReader(path) if fmt == "hf" else dcp.FileSystemReader(path)

    def prepare(world_of, n, rows, cols, dcp=True):  # this rank's state, `out`, DCP's target
        st.clear()
        st["state"] = _shard(world_of, rank, n, rows, cols) if rank < world_of else {}
        st["spec"] = _spec(world_of, n, rows, cols)
        st["world_of"] = world_of
        # allocated and touched (np.full_like writes every page): a model's existing tensors
        st["out"] = {k: np.full_like(v, 1) for k, v in st["state"].items()}
        if dcp:
            st["target"] = dtensors({k: np.full_like(v, 1) for k, v in st["state"].items()})
        st["step"] = 0

    def op(name, **kw):
        if name == "prepare":
            return prepare(**kw)
        if name == "ferro_save":  # keeps every step: the coordinator deletes old ones untimed
            st["step"] += 1
            CheckpointManager(kw["root"], rank, kw["world"], keep_last=10**6).save(
                st["step"], st["state"], st["spec"])
        elif name == "ferro_restore":
            kwargs = dict(kw.get("kwargs", {}))
            if kwargs.pop("out", False):
                kwargs["out"] = st["out"]
            st["last"], _ = CheckpointManager(kw["root"], rank, kw["world"]).restore(**kwargs)
        elif name == "dcp_save":
            dcp.save(dtensors(st["state"]), storage_writer=writer(kw["fmt"], kw["path"]))
        elif name == "dcp_load":
            dcp.load(st["target"], storage_reader=reader(kw["fmt"], kw["path"]))
            st["last"] = {k: v.to_local().numpy() for k, v in st["target"].items()}
        elif name == "copyto":
            for k, v in st["state"].items():
                np.copyto(st["out"][k], v)
            st["last"] = st["out"]
        elif name == "copy":  # into new arrays: their pages faulted in and zeroed by the kernel
            st["last"] = {k: v.copy() for k, v in st["state"].items()}
        elif name == "check":  # the last result against this rank's rows of the state
            want = st["state"] if kw["world"] == st["world_of"] else \
                _shard(kw["world"], rank, *kw["shape"])
            got = st.pop("last")
            return all(np.array_equal(got[k], want[k]) for k in want) and len(got) == len(want)
        return None

    while True:
        name, kw = conn.recv()
        if name == "stop":
            break
        if name != "check":
            st.pop("last", None)  # the previous result is freed before timing, not during
        try:
            t0 = time.perf_counter()
            result = op(name, **kw)
            conn.send(("ok", time.perf_counter() - t0, result))
        except BaseException:
            conn.send(("error", traceback.format_exc(), None))
    dist.destroy_process_group()


class TwoRanks:
    """Two spawned ranks (gloo process group for DCP) that run commands on demand."""

    def __init__(self, world: int = 2) -> None:
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        self.conns, self.procs = [], []
        for r in range(world):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(r, world, port, b), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)

    def __call__(self, name: str, ranks=None, **kw):
        conns = self.conns if ranks is None else [self.conns[r] for r in ranks]
        for c in conns:
            c.send((name, kw))
        replies = [c.recv() for c in conns]
        for status, info, _ in replies:
            if status != "ok":
                raise RuntimeError(f"rank failed in {name}:\n{info}")
        return [result for _, _, result in replies]

    def close(self) -> None:
        for c in self.conns:
            c.send(("stop", {}))
        for p in self.procs:
            p.join(60)


STATE_256 = (N_TENSORS, ROWS, COLS)


@pytest.fixture(scope="module")
def two_ranks():
    pytest.importorskip("torch.distributed.checkpoint")
    pytest.importorskip("safetensors.torch")  # DCP's HF reader and writer
    job = TwoRanks()
    yield job
    job.close()


def _drop_page_cache(*dirs: Path) -> None:
    for d in dirs:
        for p in Path(d).rglob("*"):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _clear(directory: Path) -> None:
    """Delete earlier saves (untimed, on both sides: a save's time is the write alone)."""
    for p in Path(directory).iterdir():
        shutil.rmtree(p, ignore_errors=True)


DCP_SAVES = {"torch_dcp(torch_save)": "torch_save", "torch_dcp(hf safetensors)": "hf",
             "torch_dcp(torch_save, no fsync)": "torch_save_nosync"}


@pytest.mark.parametrize("impl", [*DCP_SAVES, "ferro"])
def bench_dcp_save_2_ranks(benchmark, impl, two_ranks, workdir):
    """Durable saves: DCP's fastest durable writer (torch_save format, fsync) is the baseline;
    its safetensors writer and its writer without fsync are timed for context."""
    benchmark.group = "save 2 ranks 256MiB: ferro vs torch DCP"
    _info(benchmark, benchmark.group)
    two_ranks("prepare", world_of=2, n=N_TENSORS, rows=ROWS, cols=COLS)
    counter = iter(range(10**6))
    if impl == "ferro":
        run = lambda: two_ranks("ferro_save", root=str(workdir), world=2)
    else:
        benchmark.extra_info["role"] = "baseline" if impl == "torch_dcp(torch_save)" else \
            "context"
        run = lambda: two_ranks("dcp_save", fmt=DCP_SAVES[impl],
                                path=str(workdir / f"d{next(counter)}"))
    benchmark.pedantic(run, setup=lambda: _clear(workdir), rounds=5, warmup_rounds=1)


RESTORES = {"ferro": {}, "ferro(verify=False)": {"verify": False},
            "ferro(out=)": {"out": True}, "ferro(out=, verify=False)": {"out": True,
                                                                       "verify": False},
            "ferro(mmap=True)": {"mmap": True}, "ferro(mmap=True, verify=False)":
            {"mmap": True, "verify": False}}


@pytest.mark.parametrize("cache", ["warm", "cold"])
@pytest.mark.parametrize("impl", ["torch_dcp(hf safetensors)", "torch_dcp(torch_save)",
                                  *RESTORES])
def bench_dcp_restore_2_ranks(benchmark, impl, cache, two_ranks, workdir):
    """Same-world restore. Baseline: DCP's fastest loader (its safetensors reader, which checks
    nothing), into a state dict allocated before timing."""
    if cache == "cold" and impl not in ("torch_dcp(hf safetensors)", "torch_dcp(torch_save)",
                                        "ferro", "ferro(out=)", "ferro(mmap=True)"):
        pytest.skip("cold: the default restores only")
    benchmark.group = f"restore 2 ranks 256MiB ({cache}): ferro vs torch DCP"
    _info(benchmark, benchmark.group)
    two_ranks("prepare", world_of=2, n=N_TENSORS, rows=ROWS, cols=COLS)
    if impl.startswith("torch_dcp"):
        fmt = "hf" if "hf" in impl else "torch_save"
        benchmark.extra_info["role"] = "baseline" if fmt == "hf" else "context"
        two_ranks("dcp_save", fmt=fmt, path=str(workdir / "dcp"))
        run = lambda: two_ranks("dcp_load", fmt=fmt, path=str(workdir / "dcp"))
    else:
        two_ranks("ferro_save", root=str(workdir), world=2)
        run = lambda: two_ranks("ferro_restore", root=str(workdir), world=2,
                                kwargs=RESTORES[impl])
    setup = (lambda: _drop_page_cache(workdir)) if cache == "cold" else None
    benchmark.pedantic(run, setup=setup, rounds=7, warmup_rounds=0 if setup else 1)
    assert all(two_ranks("check", world=2, shape=STATE_256))


@pytest.mark.parametrize("impl", ["same world", "resharded"])
@pytest.mark.parametrize("move", ["2->1", "1->2"])
def bench_reshard_2_ranks(benchmark, impl, move, two_ranks, workdir):
    """A reshard load against the same-world restore onto the same world (verified, warm):
    2 -> 1 against 1 -> 1 (one rank loads all 256 MiB), 1 -> 2 against 2 -> 2."""
    benchmark.group = f"reshard {move} 256MiB (warm): against the same-world restore"
    _info(benchmark, benchmark.group)
    saved, loaded = (int(w) for w in move.split("->"))
    if impl == "same world":
        saved = loaded
        benchmark.extra_info["role"] = "baseline"
    two_ranks("prepare", world_of=saved, n=N_TENSORS, rows=ROWS, cols=COLS)
    two_ranks("ferro_save", ranks=range(saved), root=str(workdir), world=saved)
    run = lambda: two_ranks("ferro_restore", ranks=range(loaded),
                            root=str(workdir), world=loaded)
    benchmark.pedantic(run, rounds=7, warmup_rounds=1)
    assert all(two_ranks("check", ranks=range(loaded), world=loaded, shape=STATE_256))


@pytest.mark.parametrize("impl", ["copyto", "ferro", "ferro(out=)", "ferro(mmap=True)"])
def bench_restore_4GiB_2_ranks(benchmark, impl, two_ranks, workdir):
    """A 4 GiB state (64 float32 tensors of 64 MiB) on 2 ranks, warm: the verified restore
    against np.copyto of the same bytes (each rank's 2 GiB, into arrays allocated before)."""
    if os.environ.get("FERRO_BENCH_4GIB") != "1":
        pytest.skip("set FERRO_BENCH_4GIB=1 (needs about 14 GiB of memory)")
    shape = (64, 16384, 1024)
    benchmark.group = "restore 4GiB 2 ranks (warm): ferro vs np.copyto"
    benchmark.extra_info["bytes"] = 4 << 30
    two_ranks("prepare", world_of=2, n=shape[0], rows=shape[1], cols=shape[2], dcp=False)
    if impl == "copyto":
        benchmark.extra_info["role"] = "baseline"
        run = lambda: two_ranks("copyto")
    else:
        two_ranks("ferro_save", root=str(workdir), world=2)
        run = lambda: two_ranks("ferro_restore", root=str(workdir), world=2,
                                kwargs=RESTORES[impl])
    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    assert all(two_ranks("check", world=2, shape=shape))
    two_ranks("prepare", world_of=2, n=1, rows=2, cols=1)  # frees the 4 GiB


# ------------------------------------------------------------------ interleaved, by hand
def _interleaved(rounds: int, big: bool) -> None:
    """Every 2-rank contender once per round, in turn (so each sees the same moments of a
    shared, noisy host), ``rounds`` rounds: per contender the median, min and max, and the
    median of its per-round ratio to the group's baseline (baseline time / its time)."""
    import statistics

    job = TwoRanks()
    work = Path(tempfile.mkdtemp(prefix="ferro_bench_ckpt_"))
    n, rows, cols = (64, 16384, 1024) if big else STATE_256
    try:
        groups = {}
        if not big:
            job("prepare", world_of=1, n=n, rows=rows, cols=cols)
            job("ferro_save", ranks=[0], root=str(work / "w1"), world=1)
        job("prepare", world_of=2, n=n, rows=rows, cols=cols, dcp=not big)
        job("ferro_save", root=str(work / "w2"), world=2)
        restore = {k: (lambda kw=kw: job("ferro_restore", root=str(work / "w2"), world=2,
                                         kwargs=kw)) for k, kw in RESTORES.items()}
        if big:
            groups["restore 4GiB 2 ranks (warm)"] = {"np.copyto": lambda: job("copyto"),
                                                     "ndarray.copy (new arrays)":
                                                     lambda: job("copy"), **restore}
        else:
            for fmt in ("hf", "torch_save"):
                job("dcp_save", fmt=fmt, path=str(work / fmt))
            groups["restore 2 ranks 256MiB (warm)"] = {
                "torch_dcp(hf safetensors)": lambda: job("dcp_load", fmt="hf",
                                                         path=str(work / "hf")),
                "torch_dcp(torch_save)": lambda: job("dcp_load", fmt="torch_save",
                                                     path=str(work / "torch_save")),
                "ndarray.copy (new arrays)": lambda: job("copy"), **restore}
            groups["reshard 1 -> 2 (warm), against 2 -> 2"] = {
                "2->2": restore["ferro"],
                "1->2": lambda: job("ferro_restore", root=str(work / "w1"), world=2)}
            groups["reshard 2 -> 1 (warm), against 1 -> 1"] = {
                "1->1": lambda: job("ferro_restore", ranks=[0], root=str(work / "w1"), world=1),
                "2->1": lambda: job("ferro_restore", ranks=[0], root=str(work / "w2"), world=1)}
            count = iter(range(10**6))
            groups["save 2 ranks 256MiB, durable"] = {
                "torch_dcp(torch_save)": lambda: job("dcp_save", fmt="torch_save",
                                                     path=str(work / "s" / f"{next(count)}")),
                "torch_dcp(hf safetensors)": lambda: job("dcp_save", fmt="hf",
                                                         path=str(work / "s" / f"{next(count)}")),
                "ferro": lambda: job("ferro_save", root=str(work / "s"), world=2)}
        for title, runs in groups.items():
            times: dict[str, list[float]] = {k: [] for k in runs}
            for run in runs.values():
                run()  # warm-up
            for _ in range(rounds):
                for k, run in runs.items():
                    t = time.perf_counter()
                    run()
                    times[k].append(time.perf_counter() - t)
                    if (work / "s").is_dir():
                        _clear(work / "s")
            base = next(iter(times))
            print(f"\n{title}: {rounds} rounds, ratio = {base} time / its time (per round)")
            for k, ts in times.items():
                ratio = statistics.median(b / t for b, t in zip(times[base], ts))
                print(f"  {k:32s} median {statistics.median(ts) * 1e3:8.1f} ms  "
                      f"[{min(ts) * 1e3:.1f}, {max(ts) * 1e3:.1f}]  ratio {ratio:.2f}x")
    finally:
        job.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="the 2-rank groups, contenders interleaved")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--4gib", dest="big", action="store_true",
                        help="the 4 GiB state against np.copyto instead (about 14 GiB)")
    args = parser.parse_args()
    _interleaved(args.rounds, args.big)
