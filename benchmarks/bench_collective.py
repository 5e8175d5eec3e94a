"""ferro-collective: ferro-backend's reduction kernel (`kernels._fold`: arithmetic, bitwise and
half precision) through ``ferro_collective.ops`` against numpy, and the
collectives over the simulated and TCP backends, with bus bandwidth as nccl-tests defines it.

busbw: allreduce = size * 2(n-1)/n / time; all_gather, reduce_scatter = total size * (n-1)/n /
time; broadcast = size / time. For TCP, the benchmark process is rank 0 and the other ranks are
worker processes that receive each round's command over ferro point-to-point first (a 32-byte
message; at 4 KiB that command is part of the measured time). The side-by-side comparison with
mpi4py and gloo, where every implementation runs with the same process layout, is
``benchmarks/peers.py`` (``nox -s bench_peers``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from busbw import busbw_factor

from ferro_backend import SimulatedBackend, TcpBackend
from ferro_backend.testing import free_port
from ferro_collective import (
    ReduceOp,
    all_gather,
    allreduce,
    broadcast,
    reduce_scatter,
)
from ferro_collective.ops import accumulate

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20, "64MiB": 64 << 20}
COLLECTIVES = ["allreduce", "broadcast", "all_gather", "reduce_scatter"]


def run_collective(name: str, x: np.ndarray, backend):
    if name == "allreduce":
        return allreduce(x, backend)
    if name == "broadcast":
        return broadcast(x, backend, 0)
    if name == "all_gather":
        return all_gather(x[: x.size // backend.world_size], backend)
    return reduce_scatter(x, backend)


def _rounds(nbytes: int) -> int:
    return 30 if nbytes <= 1 << 20 else 3


# ------------------------------------------------------------------ kernels vs numpy
@pytest.mark.parametrize("impl", ["numpy", "_fold"])
def bench_sum_kernel_16MiB(benchmark, impl):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(4 << 20, dtype=np.float32), rng.standard_normal(4 << 20,
                                                                              dtype=np.float32)
    acc = a.copy()
    benchmark.group = "kernel SUM float32 16MiB"
    benchmark.extra_info["bytes"] = a.nbytes
    if impl == "numpy":
        benchmark.extra_info["role"] = "baseline"
        benchmark.pedantic(lambda: np.add(acc, b, out=acc), rounds=30, warmup_rounds=3)
    else:
        benchmark.pedantic(lambda: accumulate(acc, b, ReduceOp.SUM), rounds=30, warmup_rounds=3)
    check = a.copy()
    accumulate(check, b, ReduceOp.SUM)
    np.testing.assert_array_equal(check, a + b)


@pytest.mark.parametrize("impl", ["numpy", "_fold"])
def bench_mean_kernel_16MiB(benchmark, impl):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(4 << 20, dtype=np.float32), rng.standard_normal(4 << 20,
                                                                              dtype=np.float32)
    acc = a.copy()
    benchmark.group = "kernel MEAN (last pass) float32 16MiB"
    benchmark.extra_info["bytes"] = a.nbytes
    if impl == "numpy":
        benchmark.extra_info["role"] = "baseline"

        def run():
            np.add(acc, b, out=acc)
            np.divide(acc, 4, out=acc)
    else:
        def run():
            accumulate(acc, b, ReduceOp.MEAN, mean_divisor=4)

    benchmark.pedantic(run, rounds=30, warmup_rounds=3)
    check = a.copy()
    accumulate(check, b, ReduceOp.MEAN, mean_divisor=4)
    np.testing.assert_array_equal(check, np.divide(np.add(a, b), 4))


def _numpy_int4(grid: np.ndarray) -> np.ndarray:
    """int4 blocks in numpy: the values -7..7 as nibbles, two a byte (even index low)."""
    k = np.rint(grid / (np.abs(grid).max(axis=1) / 7)[:, None]).astype(np.int8).reshape(-1)
    nib = (k & 0xF).astype(np.uint8)
    return nib[0::2] | (nib[1::2] << 4)


def _numpy_nibbles(q: np.ndarray) -> np.ndarray:
    """The int4 values of ``q``'s bytes (low nibble first), as float32."""
    lo, hi = (q & 0xF).astype(np.int8), (q >> 4).astype(np.int8)
    out = np.empty(q.size * 2, np.float32)
    out[0::2], out[1::2] = np.where(lo > 7, lo - 16, lo), np.where(hi > 7, hi - 16, hi)
    return out


@pytest.mark.parametrize("impl", ["numpy", "_wire"])
@pytest.mark.parametrize("step", ["encode bf16", "decode+sum bf16", "encode fp16",
                                  "decode+sum fp16", "encode int8", "decode+sum int8",
                                  "encode int4", "decode+sum int4"])
def bench_wire_kernel_16MiB(benchmark, impl, step):
    """The wire formats' codec (ferro_collective._wire) against the same step in numpy."""
    from ferro_collective import _wire
    from ferro_collective.wire import BLOCK, encode

    x = np.random.default_rng(0).standard_normal(4 << 20, dtype=np.float32)
    acc = np.zeros_like(x)
    wire = step.split()[-1]
    buf = encode(x, wire)
    blocks = x.size // BLOCK
    scales, q = buf[:blocks * 4].view(np.float32), buf[blocks * 4:].view(np.int8)
    q4 = buf[blocks * 4:].view(np.uint8)
    benchmark.group = f"kernel wire {step} float32 16MiB"
    benchmark.extra_info["bytes"] = x.nbytes
    if impl == "numpy":
        benchmark.extra_info["role"] = "baseline"
        grid = x.reshape(blocks, BLOCK)
        run = {"encode bf16": lambda: ((x.view(np.uint32) + (0x7FFF + ((x.view(np.uint32) >> 16)
                                                                       & 1))) >> 16
                                       ).astype(np.uint16),
               "decode+sum bf16": lambda: np.add(acc, (buf.view(np.uint16).astype(np.uint32)
                                                       << 16).view(np.float32), out=acc),
               "encode fp16": lambda: x.astype(np.float16),
               "decode+sum fp16": lambda: np.add(acc, buf.view(np.float16), out=acc),
               "encode int8": lambda: np.rint(grid / (np.abs(grid).max(axis=1) / 127)[:, None]
                                              ).astype(np.int8),
               "decode+sum int8": lambda: np.add(acc, (q.reshape(blocks, BLOCK) * scales[:, None]
                                                       ).reshape(-1), out=acc),
               "encode int4": lambda: _numpy_int4(grid),
               "decode+sum int4": lambda: np.add(acc, (_numpy_nibbles(q4).reshape(blocks, BLOCK)
                                                       * scales[:, None]).reshape(-1),
                                                 out=acc)}[step]
    else:
        out16 = np.empty(x.size, np.uint16)
        run = {"encode bf16": lambda: _wire.encode_bf16(x, out16),
               "decode+sum bf16": lambda: _wire.decode_bf16_into(buf.view(np.uint16), acc,
                                                                 _wire.SUM),
               "encode fp16": lambda: _wire.encode_fp16(x, out16),
               "decode+sum fp16": lambda: _wire.decode_fp16_into(buf.view(np.uint16), acc,
                                                                 _wire.SUM),
               "encode int8": lambda: _wire.encode_int8(x, np.empty(blocks, np.float32),
                                                        np.empty(x.size, np.int8)),
               "decode+sum int8": lambda: _wire.decode_int8_into(scales, q, acc, _wire.SUM),
               "encode int4": lambda: _wire.encode_int4(x, np.empty(blocks, np.float32),
                                                        np.empty(x.size // 2, np.uint8)),
               "decode+sum int4": lambda: _wire.decode_int4_into(scales, q4, acc,
                                                                 _wire.SUM)}[step]
    benchmark.pedantic(run, rounds=20, warmup_rounds=2)


@pytest.mark.parametrize("op", ["BAND", "BOR", "BXOR"])
@pytest.mark.parametrize("impl", ["numpy", "_fold"])
def bench_bitwise_kernel_16MiB(benchmark, impl, op):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2**32, 4 << 20, dtype=np.uint32)
    b = rng.integers(0, 2**32, 4 << 20, dtype=np.uint32)
    acc = a.copy()
    rop = ReduceOp[op]
    ufunc = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
    benchmark.group = f"kernel {op} uint32 16MiB"
    benchmark.extra_info["bytes"] = a.nbytes
    if impl == "numpy":
        benchmark.extra_info["role"] = "baseline"
        benchmark.pedantic(lambda: ufunc(acc, b, out=acc), rounds=30, warmup_rounds=3)
    else:
        benchmark.pedantic(lambda: accumulate(acc, b, rop), rounds=30, warmup_rounds=3)
    check = a.copy()
    accumulate(check, b, rop)
    np.testing.assert_array_equal(check, ufunc(a, b))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("impl", ["numpy", "_fold"])
def bench_half_fold_kernel_16MiB(benchmark, impl, dtype):
    """A 4-input SUM of 16 MiB float16/bfloat16 arrays, widened to float32, folded in rank
    order and rounded once: the engine's fold against numpy doing the same in three passes."""
    import ml_dtypes

    from ferro_collective.ops import fold

    dt = np.dtype(np.float16) if dtype == "float16" else np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(8 << 20, dtype=np.float32).astype(dt) for _ in range(4)]
    out = np.empty_like(inputs[0])
    benchmark.group = f"kernel SUM of 4 {dtype} 16MiB"
    benchmark.extra_info["bytes"] = out.nbytes
    wide = [np.empty(out.size, np.float32) for _ in range(2)]

    def numpy_fold():
        np.copyto(wide[0], inputs[0])
        for x in inputs[1:]:
            np.copyto(wide[1], x)
            np.add(wide[0], wide[1], out=wide[0])
        np.copyto(out, wide[0], casting="unsafe")

    if impl == "numpy":
        benchmark.extra_info["role"] = "baseline"
        benchmark.pedantic(numpy_fold, rounds=10, warmup_rounds=2)
    else:
        benchmark.pedantic(lambda: fold(out, inputs, ReduceOp.SUM), rounds=10, warmup_rounds=2)
    fold(out, inputs, ReduceOp.SUM)
    got = out.copy()
    numpy_fold()
    np.testing.assert_array_equal(got.view(np.uint16), out.view(np.uint16))


# ------------------------------------------------------------------ simulated
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", COLLECTIVES)
def bench_simulated(benchmark, name, world, size):
    import threading

    nbytes = SIZES[size]
    benchmark.group = f"{name} simulated world={world} {size}"
    x = np.ones(nbytes // 4, dtype=np.float32)
    group = SimulatedBackend.create_group(world)
    barrier = threading.Barrier(world)
    stop = threading.Event()

    def worker(b):
        while True:
            barrier.wait()
            if stop.is_set():
                return
            run_collective(name, x, b)

    threads = [threading.Thread(target=worker, args=(b,), daemon=True) for b in group[1:]]
    for t in threads:
        t.start()

    def one():
        barrier.wait()
        return run_collective(name, x, group[0])

    result = benchmark.pedantic(one, rounds=_rounds(nbytes), warmup_rounds=1)
    stop.set()
    barrier.wait()
    for t in threads:
        t.join(10)
    t = benchmark.stats.stats.median
    benchmark.extra_info["busbw_GBps"] = nbytes * busbw_factor(name, world) / t / 1e9
    assert result is not None


# ------------------------------------------------------------------ TCP
WORKER = """
import sys
import numpy as np
from ferro_backend import TcpBackend
sys.path.insert(0, sys.argv[3])
from bench_collective import run_collective, COLLECTIVES
rank, world, _, addr = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
b = TcpBackend(rank, world, addr, timeout=300)
cmd = np.empty(2, np.int64)
cache = {}
while True:
    b.recv(cmd, 0, tag=99, timeout=600)
    op, nbytes = int(cmd[0]), int(cmd[1])
    if op < 0:
        break
    x = cache.setdefault(nbytes, np.ones(nbytes // 4, np.float32))
    run_collective(COLLECTIVES[op], x, b)
b.close()
"""


class TcpJob:
    def __init__(self, world: int) -> None:
        import os

        here = os.path.dirname(os.path.abspath(__file__))
        addr = f"127.0.0.1:{free_port()}"
        self.procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WORKER), str(r),
                                        str(world), here, addr]) for r in range(1, world)]
        self.backend = TcpBackend(0, world, addr, timeout=300)

    def run(self, name: str, x: np.ndarray):
        cmd = np.array([COLLECTIVES.index(name), x.nbytes], np.int64)
        for r in range(1, self.backend.world_size):
            self.backend.send(cmd, r, tag=99)
        return run_collective(name, x, self.backend)

    def close(self) -> None:
        for r in range(1, self.backend.world_size):
            self.backend.send(np.array([-1, 0], np.int64), r, tag=99)
        self.backend.close()
        for p in self.procs:
            p.wait(30)


_jobs: dict[int, TcpJob] = {}


@pytest.fixture(scope="module")
def tcp_jobs():
    yield _jobs
    for job in _jobs.values():
        job.close()
    _jobs.clear()


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", COLLECTIVES)
def bench_tcp(benchmark, tcp_jobs, name, world, size):
    nbytes = SIZES[size]
    benchmark.group = f"{name} tcp world={world} {size}"
    if world not in tcp_jobs:
        tcp_jobs[world] = TcpJob(world)
    job = tcp_jobs[world]
    x = np.ones(nbytes // 4, dtype=np.float32)
    result = benchmark.pedantic(job.run, args=(name, x), rounds=_rounds(nbytes),
                                warmup_rounds=1)
    t = benchmark.stats.stats.median
    benchmark.extra_info["busbw_GBps"] = nbytes * busbw_factor(name, world) / t / 1e9
    if name == "allreduce":
        assert float(result[0]) == world
