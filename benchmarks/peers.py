"""Side by side: ferro (TCP, shared memory) against mpi4py/Open MPI and torch.distributed (gloo).

Every implementation runs with the same process layout (N processes on this machine) and the
same measurement: a barrier, K/10 warm-up calls, then K calls timed on every rank; a call's time is
the slowest rank's mean. Bus bandwidth follows nccl-tests: allreduce = S * 2(n-1)/n / t,
all_gather, reduce_scatter, gather, scatter and all_to_all = S * (n-1)/n / t (S the
gathered/reduced/scattered total, for all_to_all one rank's send buffer), broadcast = S / t.
Rooted collectives use root 0; all_to_all sends equal splits (ferro's all_to_all_single, MPI's
Alltoall, torch's all_to_all_single).

    python benchmarks/peers.py --worlds 2 4 --out benchmarks/peers      (what nox -s bench_peers runs)
    python benchmarks/peers.py --impls ferro-shm impi --impi-venv DIR     (Intel MPI: its own venv)

Intel MPI (``impi``) runs from a virtualenv of its own holding ``impi-rt``, ``mpi4py`` and numpy
(``--impi-venv``; ``nox -s bench_peers`` makes it), with ``I_MPI_FABRICS=shm``. ``mpi-best`` is, per
row, the fastest of Open MPI's default, Open MPI with ``--mca coll_sm_priority 100`` and Intel MPI.
    python benchmarks/peers.py --worlds 2 --ops gather scatter all_to_all  # a new run directory
    python benchmarks/peers.py --ops broadcast_object all_gather_object    # pickled objects

The object collectives (not in the default run) send S bytes as one ``bytes`` object, pickled
per call by every implementation: ferro's ``broadcast_object`` / ``all_gather_object``, mpi4py's
lowercase ``bcast`` / ``allgather``, torch's ``broadcast_object_list`` / ``all_gather_object``.

``--impls ferro-shm torch-ferro gloo`` measures torch's layer: torch.distributed's collectives
on ferro-torch's backend "ferro" (over the same engine) against the same call on ferro directly
and on gloo, in a table of its own (us per call). torch's ranks run with
``THP_MEM_ALLOC_ENABLE=1``: torch's allocator then backs large tensors with huge pages, as
numpy backs arrays from 4 MiB (without it torch's 16 MiB broadcast took 2x ferro's on numpy
arrays here, for the pages alone).

``--impls ... limit`` adds the machine's limit per row (:func:`_limit_ops`): the numpy copy and
add of the same data on every rank at once, in the same run.

``--fresh``: before every call each rank writes one byte in every 64-byte line of its input
(a counter), as a backward pass or an optimizer step writes the data a real collective sends;
the time is that of the writes and the call together, for every implementation alike (a
4 KiB - 1 MiB buffer takes 0.5 - 27 us to touch here; beyond the caches the writes weigh more).
Without it every call sends the same untouched buffer, which a peer reading it directly (Open
MPI's single-copy path) finds in its own cache from the previous call.

The host's state around every launch: ferro's link probe runs as a job of its own just before
each launch and after the last (``host_state.py``; ``--no-host-probe`` skips it), so every
implementation's launches, MPI's too, are told apart by where the host's cores were;
``results.md`` ends with the comparison state by state.

Implementations whose library is not installed are skipped with a message. Writes
``<out>/results.json``, ``<out>/results.md`` (the tables), ``<out>/busbw.png`` (the plot) and
``<out>/launches.json`` (every launch's rows and the probes either side of it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import host_state
import numpy as np
import tables
from busbw import busbw

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
#: one BLAS/OpenMP thread per rank for every implementation
THREAD_CAPS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
OPS = ["allreduce", "all_gather", "reduce_scatter", "broadcast", "gather", "scatter", "all_to_all",
       "barrier", "pingpong"]
#: the object collectives (``--ops``; not in the default run): S bytes as one ``bytes`` object,
#: pickled per call by every implementation (ferro's broadcast_object / all_gather_object,
#: mpi4py's lowercase ``bcast`` / ``allgather``, torch's ``broadcast_object_list`` /
#: ``all_gather_object``); their bus bandwidth is broadcast's and all_gather's
OBJECT_OPS = {"broadcast_object": "broadcast", "all_gather_object": "all_gather"}
#: collectives whose bus bandwidth factor busbw.py does not have: nccl-tests' (n-1)/n of the
#: total (gather, scatter: the gathered/scattered total; alltoall: one rank's send buffer)
RING_FACTOR_OPS = ("gather", "scatter", "all_to_all")


def op_busbw(op: str, nbytes: int, n: int, seconds: float) -> float:
    """Bus bandwidth in GB/s of one call of ``op``, as nccl-tests defines it (pingpong: the
    bytes of one round trip, 2S, over its time)."""
    if op == "pingpong":
        return 2 * nbytes / seconds / 1e9 if seconds > 0 else 0.0
    op = OBJECT_OPS.get(op, op)
    if op in RING_FACTOR_OPS:
        return nbytes * (n - 1) / n / seconds / 1e9 if seconds > 0 else 0.0
    return busbw(op, nbytes, n, seconds)


def iters_for(nbytes: int) -> int:
    """Calls timed per cell: about 256 MiB moved, 2000 at most, and at least 10 (3 calls of a
    16 MiB cell made it swing with a single slow call). 200 calls of 64 KiB (0.6 ms, the
    earlier cap) read ferro's broadcast and all_gather at 0.75-0.79x of Intel MPI's in a run
    where 2000-call loops of both, in the same hour, read ferro 1.2x ahead: a cell's first few
    hundred calls still carry the start of the size (pages, caches, the peers falling in step)."""
    return max(10, min(2000, (256 << 20) // max(nbytes, 1)))


def warmups_for(k: int) -> int:
    """Untimed calls before a cell's ``k`` timed ones: a tenth of them, at least 3 (ferro's
    first calls make its group and its plan; every implementation gets the same)."""
    return max(3, k // 10)


# --------------------------------------------------------------------------- workers
def _ferro_ops(transport: str):
    import ferro_backend
    from ferro_collective import (
        all_gather,
        all_gather_object,
        all_to_all_single,
        allreduce,
        barrier,
        broadcast,
        broadcast_object,
        gather,
        reduce_scatter,
        scatter,
    )

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    cls = ferro_backend.ShmBackend if transport == "shm" else ferro_backend.TcpBackend
    b = cls(rank, world, addr, timeout=300)
    outs = _Outputs(lambda n: np.empty(n, np.float32))
    ops = {
        "allreduce": lambda x: allreduce(x, b, out=outs.get("ar", x.size)),
        "all_gather": lambda x: all_gather(x[: x.size // world], b,
                                           out=outs.get("ag", x.size // world * world)),
        "reduce_scatter": lambda x: reduce_scatter(x, b, out=outs.get("rs", x.size // world)),
        "broadcast": lambda x: broadcast(x, b, 0, out=x),
        "gather": lambda x: gather(x[: x.size // world], b, 0,
                                   out=outs.get("ga", x.size // world * world) if rank == 0
                                   else None),
        "scatter": lambda x: scatter(x if rank == 0 else None, b, 0,
                                     out=outs.get("sc", x.size // world)),
        "all_to_all": lambda x: all_to_all_single(x, b, out=outs.get("a2a", x.size)),
        "barrier": lambda x: barrier(b),
        "pingpong": _pingpong(rank, world, b.send, b.recv),
        **_object_ops(rank, world, lambda o: broadcast_object(o, b, 0),
                      lambda o: all_gather_object(o, b)),
    }
    engine = getattr(b, "engine", None)
    if engine is not None and engine.link is not None:  # where the ranks landed (collective)
        ops["_link"] = lambda: [(lk.rtt_ns, lk.copy_gbps) for lk in (engine.link,
                                                                    engine.probe_link())]
    return rank, world, ops, lambda: barrier(b), np.ones, b.close


def _object_ops(rank: int, world: int, broadcast_object, all_gather_object) -> dict:
    """The object collectives' cells: broadcast_object of S bytes from rank 0 (``bytes``, made
    once per size) and all_gather_object of S / world bytes from every rank, on one
    implementation's ``broadcast_object(obj)`` and ``all_gather_object(obj)``."""
    made: dict[int, bytes] = {}

    def obj(x, items: int) -> bytes:
        if items not in made:
            arr = np.asarray(x.numpy() if hasattr(x, "numpy") else x).reshape(-1)
            made[items] = arr[:items].tobytes()
        return made[items]

    def size(x) -> int:
        return x.numel() if hasattr(x, "numel") else x.size

    return {"broadcast_object": lambda x: broadcast_object(obj(x, size(x)) if rank == 0 else None),
            "all_gather_object": lambda x: all_gather_object(obj(x, size(x) // world))}


def _pingpong(rank: int, world: int, send, recv):
    """Point-to-point round trips: ranks 2k and 2k+1 exchange S bytes and back (an odd last
    rank idles); every implementation's plain blocking send and receive."""
    peer = rank ^ 1
    if peer >= world:
        return lambda x: None
    if rank % 2 == 0:
        def run(x):
            send(x, peer)
            recv(x, peer)
    else:
        def run(x):
            recv(x, peer)
            send(x, peer)
    return run


class _Outputs:
    """Output buffers made once per size and reused, for every implementation alike: a user
    tuning for speed preallocates (MPI's Allreduce(x, out), torch's *_into_tensor, ferro's
    out=), so no run pays page faults for a fresh result each call."""

    def __init__(self, empty) -> None:
        self._empty = empty
        self._bufs: dict[tuple[str, int], object] = {}

    def get(self, key: str, n: int):
        buf = self._bufs.get((key, n))
        if buf is None:
            buf = self._bufs[(key, n)] = self._empty(n)
        return buf


def _mpi_ops():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()

    outs = _Outputs(lambda n: np.empty(n, np.float32))

    def allreduce(x):
        out = outs.get("ar", x.size)
        comm.Allreduce(x, out, op=MPI.SUM)
        return out

    def all_gather(x):
        part = x[: x.size // world]
        out = outs.get("ag", part.size * world)
        comm.Allgather(part, out)
        return out

    def reduce_scatter(x):
        out = outs.get("rs", x.size // world)
        comm.Reduce_scatter_block(x, out, op=MPI.SUM)
        return out

    def broadcast(x):
        comm.Bcast(x, root=0)
        return x

    def gather(x):
        part = x[: x.size // world]
        out = outs.get("ga", part.size * world) if rank == 0 else None
        comm.Gather(part, out, root=0)
        return out

    def scatter(x):
        out = outs.get("sc", x.size // world)
        comm.Scatter(x if rank == 0 else None, out, root=0)
        return out

    def all_to_all(x):
        out = outs.get("a2a", x.size)
        comm.Alltoall(x, out)
        return out

    ops = {"allreduce": allreduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
           "broadcast": broadcast, "gather": gather, "scatter": scatter,
           "all_to_all": all_to_all, "barrier": lambda x: comm.Barrier(),
           "pingpong": _pingpong(rank, world, lambda x, p: comm.Send(x, dest=p),
                                 lambda x, p: comm.Recv(x, source=p)),
           **_object_ops(rank, world, lambda o: comm.bcast(o, root=0), comm.allgather)}
    return rank, world, ops, comm.Barrier, np.ones, lambda: None


def _torch_ops(backend: str):
    """torch.distributed's collectives on ``backend``: "gloo", or "ferro" (ferro-torch's
    backend, here over the same-host engine as ferro-shm, so the difference to ferro-shm is
    the cost of torch's layer). all_reduce and broadcast work in place on the input, as DDP
    and a user call them; the others into preallocated outputs."""
    import torch
    import torch.distributed as dist

    if backend == "ferro":
        import ferro_torch  # noqa: F401 - registers the backend "ferro"

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, rank=rank, world_size=world,
                            init_method=f"tcp://{os.environ['MASTER_ADDR']}:"
                                        f"{os.environ['MASTER_PORT']}")

    outs = _Outputs(lambda n: torch.empty(n, dtype=torch.float32))
    # torch 2.13 names them *_single and warns on every call of the old names
    gather_into = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter_from = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

    def allreduce(x):
        dist.all_reduce(x)
        return x

    def all_gather(x):
        part = x[: x.numel() // world]
        out = outs.get("ag", part.numel() * world)
        gather_into(out, part)
        return out

    def reduce_scatter(x):
        out = outs.get("rs", x.numel() // world)
        scatter_from(out, x)
        return out

    def broadcast(x):
        dist.broadcast(x, 0)
        return x

    def gather(x):
        part = x[: x.numel() // world]
        out = outs.get("ga", part.numel() * world) if rank == 0 else None
        dist.gather(part, list(out.chunk(world)) if rank == 0 else None, dst=0)
        return out

    def scatter(x):
        out = outs.get("sc", x.numel() // world)
        dist.scatter(out, list(x.chunk(world)) if rank == 0 else None, src=0)
        return out

    def all_to_all(x):
        out = outs.get("a2a", x.numel())
        dist.all_to_all_single(out, x)
        return out

    ops = {"allreduce": allreduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
           "broadcast": broadcast, "gather": gather, "scatter": scatter,
           "all_to_all": all_to_all, "barrier": lambda x: dist.barrier(),
           "pingpong": _pingpong(rank, world, lambda x, p: dist.send(x, p),
                                 lambda x, p: dist.recv(x, p))}

    def broadcast_object(obj):
        got = [obj]
        dist.broadcast_object_list(got, src=0)
        return got[0]

    def all_gather_object(obj):
        got = [None] * world
        dist.all_gather_object(got, obj)
        return got
    ops.update(_object_ops(rank, world, broadcast_object, all_gather_object))

    def ones(n, dtype=np.float32):
        return torch.ones(n, dtype=torch.float32)

    return rank, world, ops, dist.barrier, ones, dist.destroy_process_group


def _limit_ops():
    """The machine's limit for each collective, as the issue of record defines it for a 2-rank
    allreduce (``one copy plus one add of the data``): every rank, at the same time as the
    others (their barrier is ferro's), copies and adds the collective's data in its own memory
    with numpy, no communication. allreduce: a copy and an add of S; all_gather and broadcast:
    a copy of S; reduce_scatter: an add of S; barrier: nothing (reported as 0)."""
    rank, world, _, barrier, ones, close = _ferro_ops("shm")
    outs = _Outputs(lambda n: np.empty(n, np.float32))

    def copy_add(x):
        tmp, out = outs.get("tmp", x.size), outs.get("out", x.size)
        np.copyto(tmp, x)
        np.add(tmp, x, out=out)

    def copy(x):
        np.copyto(outs.get("out", x.size), x)

    def add(x):
        np.add(x, x, out=outs.get("out", x.size))

    ops = {"allreduce": copy_add, "all_gather": copy, "broadcast": copy, "reduce_scatter": add,
           "gather": copy, "scatter": copy, "all_to_all": copy, "barrier": lambda x: None,
           "pingpong": copy, "broadcast_object": copy, "all_gather_object": copy}
    return rank, world, ops, barrier, ones, close


def _toucher(x):
    """A function writing one byte (a counter) into every 64-byte line of ``x`` (a numpy array
    or a torch tensor)."""
    lines = np.asarray(x.numpy() if hasattr(x, "numpy") else x).reshape(-1).view(np.uint8)[::64]
    state = [0]

    def touch() -> None:
        state[0] = (state[0] + 1) & 0x3F  # low mantissa bits of float32 ones: finite values
        lines[...] = state[0]
    return touch


def _timed(k: int, call) -> float:
    t0 = time.perf_counter()
    for _ in range(k):
        call()
    return time.perf_counter() - t0


def worker(impl: str, out_path: str, ops_filter: list[str], sizes: list[int],
           fresh: bool = False) -> None:
    if impl == "probe":
        host_state.probe_worker(out_path)
        return
    if impl in MPI_IMPLS:
        rank, world, ops, barrier, ones, close = _mpi_ops()
    elif impl in TORCH_IMPLS:
        rank, world, ops, barrier, ones, close = _torch_ops(TORCH_IMPLS[impl])
    elif impl == "limit":
        rank, world, ops, barrier, ones, close = _limit_ops()
    else:
        rank, world, ops, barrier, ones, close = _ferro_ops(impl.split("-")[1])
    rows = []
    # settle: a quarter second idle before the first cell, for every implementation alike (a
    # process's background threads finish starting up meanwhile: without it ferro's first cell
    # ran at 100 us per call in 2 of 3 runs, the next cells did not), then one barrier
    time.sleep(0.25)
    barrier()
    for op in ops_filter:
        for nbytes in (sizes if op != "barrier" else [0]):
            x = ones(max(nbytes // 4, world), dtype=np.float32)
            # (a barrier cell times 5000 calls, 2-3 ms: 200 took 100 us, within the host's
            # hiccups, and read 0.5-0.9 us where 5000 read 0.5 for ferro, 0.3 for coll/sm)
            k = iters_for(nbytes) if op != "barrier" else 5000
            for _ in range(warmups_for(k)):
                ops[op](x)
            if fresh and op != "barrier":
                touch, run = _toucher(x), ops[op]

                def call(touch=touch, run=run, x=x):
                    touch()
                    run(x)
                barrier()
                elapsed = _timed(k, call) / k
            else:
                barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    ops[op](x)
                elapsed = (time.perf_counter() - t0) / k
            rows.append({"op": op, "bytes": nbytes, "seconds": elapsed})
    # the engine's link probe as the job formed and again now (ferro-shm): the state it ran in
    link = ops["_link"]() if "_link" in ops else None
    if link is not None and rank == 0:
        Path(f"{out_path}.link").write_text(json.dumps(link))
    # the slowest rank's time per call
    times = np.array([r["seconds"] for r in rows])
    Path(f"{out_path}.rank{rank}").write_text(json.dumps(times.tolist()))
    barrier()
    if rank == 0:
        all_times = [json.loads(Path(f"{out_path}.rank{r}").read_text()) for r in range(world)]
        worst = np.max(np.array(all_times), axis=0)
        for r, t in zip(rows, worst):
            r["seconds"] = float(t)
            r["busbw_GBps"] = op_busbw(r["op"], r["bytes"], world, float(t))
        Path(out_path).write_text(json.dumps(rows))
    barrier()
    Path(f"{out_path}.rank{rank}").unlink()
    close()


# --------------------------------------------------------------------------- driver
#: the MPI implementations (every one runs the mpi4py worker): Open MPI default and coll/sm, Intel
MPI_IMPLS = ("mpi", "mpi-sm", "impi")
#: torch.distributed on a backend: gloo, and ferro-torch's "ferro" (torch's layer over ferro)
TORCH_IMPLS = {"gloo": "gloo", "torch-ferro": "ferro"}
#: Intel MPI's own virtualenv (--impi-venv)
IMPI_VENV: Path | None = None


def _impi(tool: str) -> Path:
    return (IMPI_VENV or Path("/nonexistent")) / "bin" / tool


def available(impl: str) -> str | None:
    """None if ``impl`` can run here, else why not."""
    if impl == "impi":
        missing = [t for t in ("mpiexec", "python") if not _impi(t).exists()]
        return (f"no Intel MPI virtualenv with {missing} at {IMPI_VENV} (--impi-venv)"
                if missing else None)
    try:
        if impl in ("mpi", "mpi-sm"):
            import mpi4py  # noqa: F401

            if not shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep
                                + os.environ.get("PATH", "")):
                return "mpirun not found"
        elif impl == "gloo":
            import torch.distributed  # noqa: F401
        elif impl == "torch-ferro":
            import ferro_torch  # noqa: F401
        elif impl in ("ferro-shm", "limit"):
            import ferro_backend

            if not hasattr(ferro_backend, "ShmBackend"):
                return "ferro_backend has no ShmBackend"
        else:
            import ferro_collective  # noqa: F401
    except ImportError as exc:
        return f"not installed ({exc.name})"
    return None


def launch(impl: str, world: int, out_path: str, ops: list[str], sizes: list[int],
           timeout: float, fresh: bool = False) -> None:
    from ferro_backend.testing import free_port

    args = [__file__, "--worker", impl, "--result", out_path, "--ops", *ops, "--sizes",
            *map(str, sizes), *(["--fresh"] if fresh else [])]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               **THREAD_CAPS)
    if impl == "impi":
        procs = [subprocess.Popen([str(_impi("mpiexec")), "-n", str(world), str(_impi("python")),
                                   *args], env=dict(env, I_MPI_FABRICS="shm"))]
    elif impl in ("mpi", "mpi-sm"):
        mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep
                              + env.get("PATH", ""))
        extra = ["--mca", "coll_sm_priority", "100"] if impl == "mpi-sm" else []
        procs = [subprocess.Popen([mpirun, "-n", str(world), "--oversubscribe", *extra,
                                   sys.executable, *args], env=env)]
    else:
        if impl in TORCH_IMPLS:  # torch's allocator with huge pages, as numpy has them from 4
            env["THP_MEM_ALLOC_ENABLE"] = "1"  # MiB (4 KiB pages: torch's 16 MiB broadcast 2x)
        procs = [subprocess.Popen([sys.executable, *args], env=dict(env, RANK=str(r),
                                                                    LOCAL_RANK=str(r)))
                 for r in range(world)]
    try:
        for p in procs:
            p.wait(timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{impl} world={world} failed: exit codes {[p.returncode for p in procs]}")


class HostProbe:
    """The host's link probe as a job of its own (``host_state.py``), around the launches: the
    probe after one launch is the one before the next (when it ran for as many processes)."""

    def __init__(self, out: Path, enabled: bool) -> None:
        self.out, self.enabled = out, enabled
        self.last: tuple[int, list | None] | None = None

    def now(self, world: int, fresh: bool = False) -> list | None:
        """``[rtt_ns, copy_gbps]`` for a launch of ``world`` processes (None: disabled, or the
        probe did not run); ``fresh``: probe again even if the last probe was for as many."""
        n = host_state.probe_processes(world)
        if not self.enabled or n < 2:
            return None
        if not fresh and self.last is not None and self.last[0] == n:
            return self.last[1]
        path = self.out / f"probe-{n}.json"
        try:
            launch("probe", n, str(path), ["barrier"], [0], timeout=120)
            got = json.loads(path.read_text())
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
            print(f"peers: the host probe failed, left out: {exc}", flush=True)
            got = None
        path.unlink(missing_ok=True)
        self.last = (n, got)
        return got


def best_mpi(results: dict, world: int) -> list[dict] | None:
    """MPI at its best: per row, the fastest of Open MPI default, Open MPI coll/sm and Intel
    MPI (those that ran)."""
    runs = [results[f"{k}/{world}"] for k in MPI_IMPLS if f"{k}/{world}" in results]
    if not runs:
        return None
    return [min(rows, key=lambda r: r["seconds"]) for rows in zip(*runs)]


def markdown(results: dict, worlds: list[int], impls: list[str]) -> str:
    lines = ["Median of the repeats; `spread` = (max - min) / median of ferro-shm's runs. "
             "`mpi-best` is the fastest of Open MPI's default, Open MPI with `--mca "
             "coll_sm_priority 100` and Intel MPI (`I_MPI_FABRICS=shm`) per row. BLAS/OpenMP "
             "capped to one thread per rank for everyone. `limit` (where run): every rank at "
             "once copies and adds the data in its own memory, no communication (allreduce: a "
             "copy and an add of S; all_gather, broadcast: a copy of S; reduce_scatter: an add "
             "of S), shown as the bus bandwidth that time would give; `ferro-shm / limit` < 1 "
             "is how far ferro is from it (0.5: twice the limit's time)."]
    for world in worlds:
        present = [i for i in impls if f"{i}/{world}" in results]
        if not present:
            continue
        lines.append(f"\n#### {world} processes: bus bandwidth, GB/s (barrier: latency, us)\n")
        lines.append("| op | size | " + " | ".join(present) + " | ferro-shm spread | ferro-shm / "
                     "mpi-best | ferro-shm / gloo | ferro-tcp / gloo | ferro-shm / limit |")
        lines.append("|---" * (len(present) + 7) + "|")
        rows = results[f"{present[0]}/{world}"]
        for i, row in enumerate(rows):
            cells, vals = [], {}
            for impl in present:
                r = results[f"{impl}/{world}"][i]
                v = r["seconds"] * 1e6 if r["op"] == "barrier" else r["busbw_GBps"]
                vals[impl] = v
                cells.append(f"{v:.1f}" if r["op"] == "barrier" else f"{v:.3f}")

            def ratio(a, b, row=row, vals=vals):
                if a not in vals or b not in vals or not vals[a] or not vals[b] or (
                        b == "limit" and row["op"] == "barrier"):  # a barrier moves nothing
                    return "-"
                q = vals[b] / vals[a] if row["op"] == "barrier" else vals[a] / vals[b]
                return f"{q:.2f}x"

            shm = results.get(f"ferro-shm/{world}")
            spread = f"{shm[i].get('spread', 0) * 100:.0f}%" if shm else "-"
            size = "-" if row["op"] == "barrier" else _human(row["bytes"])
            lines.append(f"| {row['op']} | {size} | " + " | ".join(cells) + f" | {spread} | "
                         f"{ratio('ferro-shm', 'mpi-best')} | {ratio('ferro-shm', 'gloo')} | "
                         f"{ratio('ferro-tcp', 'gloo')} | {ratio('ferro-shm', 'limit')} |")
    return "\n".join(lines) + "\n"


def links_markdown(links: dict) -> str:
    """Which state each ferro-shm launch ran in: its engine's link probe (a cache line's round
    trip between the ranks' cores) as the job formed and at its end."""
    lines = ["\nferro-shm's link probe per launch (a cache line's round trip between the ranks' "
             "cores, ns, as the job formed -> at its end; below "
             f"{host_state.SHARED_CACHE_NS:.0f} ns the cores share a cache):"]
    for key, runs in links.items():
        shared = sum(1 for (start, _end) in runs if host_state.state_of(start[0]) == "shared")
        trips = ", ".join(f"{start[0]:.0f} -> {end[0]:.0f}" for start, end in runs)
        lines.append(f"- {key.split('/')[1]} processes: {trips} ({shared} of {len(runs)} "
                     "launches formed sharing a cache)")
    return "\n".join(lines) + "\n"


def torch_markdown(results: dict, worlds: list[int]) -> str:
    """The cost of torch's layer: torch's collectives on "ferro" against the same call on
    ferro directly (ferro-shm) and torch's on gloo, as time per call (us)."""
    lines = []
    for world in worlds:
        layer = results.get(f"torch-ferro/{world}")
        if layer is None:
            continue
        direct, gloo = results.get(f"ferro-shm/{world}"), results.get(f"gloo/{world}")
        lines.append(f"\n#### {world} processes: through torch, us per call (median of the "
                     "runs; spread = (max - min) / median)\n")
        lines.append("| op | size | torch-ferro | spread | ferro-shm | gloo | torch-ferro / "
                     "ferro-shm | gloo / torch-ferro |")
        lines.append("|---" * 8 + "|")
        for i, row in enumerate(layer):
            us = row["seconds"] * 1e6

            def other(rows, i=i):
                return rows[i]["seconds"] * 1e6 if rows else None

            d, g = other(direct), other(gloo)
            size = "-" if row["op"] == "barrier" else _human(row["bytes"])
            lines.append(f"| {row['op']} | {size} | {us:.1f} | {row['spread'] * 100:.0f}% | "
                         + (f"{d:.1f}" if d else "-") + " | " + (f"{g:.1f}" if g else "-")
                         + " | " + (f"{us / d:.2f}x" if d else "-") + " | "
                         + (f"{g / us:.1f}x" if g else "-") + " |")
    return "\n".join(lines) + "\n" if lines else ""


def _human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def plot(results: dict, worlds: list[int], impls: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = {r["op"] for rows in results.values() for r in rows}
    ops = [o for o in OPS + list(OBJECT_OPS) if o != "barrier" and o in present]
    if not ops:  # (a barrier alone: its latency is in the table, there is no curve to draw)
        return
    fig, axes = plt.subplots(len(worlds), len(ops), figsize=(4 * len(ops), 3.2 * len(worlds)),
                             squeeze=False)
    for wi, world in enumerate(worlds):
        for oi, op in enumerate(ops):
            ax = axes[wi][oi]
            for impl in impls:
                rows = [r for r in results.get(f"{impl}/{world}", []) if r["op"] == op]
                if rows:
                    ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows],
                            marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op}, {world} processes")
            ax.set_xlabel("bytes")
            ax.set_ylabel("bus bandwidth (GB/s)")
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _median_rows(runs: list[list[dict]]) -> list[dict]:
    """Per row, the run with the median time, plus the spread (max - min) / median."""
    merged = []
    for rows in zip(*runs):
        times = sorted(r["seconds"] for r in rows)
        med = times[len(times) // 2]
        row = dict(next(r for r in rows if r["seconds"] == med))
        row["spread"] = (times[-1] - times[0]) / med if med else 0.0
        row["runs"] = [r["seconds"] for r in rows]
        merged.append(row)
    return merged


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--impls", nargs="+",
                   default=["ferro-shm", "ferro-tcp", "mpi", "mpi-sm", "impi", "gloo"])
    p.add_argument("--impi-venv", type=Path, default=None,
                   help="a virtualenv holding impi-rt, mpi4py and numpy (Intel MPI)")
    p.add_argument("--ops", nargs="+", default=OPS, choices=OPS + list(OBJECT_OPS))
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    p.add_argument("--out", default=None,
                   help="default: a new results/<version>/<machine>/peers-<date>")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of every implementation (interleaved); rows give the median")
    p.add_argument("--fresh", action="store_true",
                   help="every rank rewrites its input (a byte per cache line) before each call")
    p.add_argument("--no-host-probe", dest="host_probe", action="store_false",
                   help="skip the host's link probe around every launch (host_state.py)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(tables.run_dir("peers"))
    global IMPI_VENV
    IMPI_VENV = args.impi_venv
    if args.worker:
        worker(args.worker, args.result, args.ops, args.sizes, args.fresh)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    impls = []
    for impl in args.impls:
        why = available(impl)
        if why:
            print(f"peers: skipping {impl}: {why}", flush=True)
            continue
        impls.append(impl)
    runs: dict[str, list[list[dict]]] = {}
    links: dict[str, list] = {}  # ferro-shm's link probes per launch (engine/link.py)
    launches: list[dict] = []  # every launch's rows and the host's probes either side of it
    host = HostProbe(out, args.host_probe and available("ferro-shm") is None)
    for rep in range(args.repeat):  # interleaved, so a noisy minute hits every implementation
        for impl in impls:
            for world in args.worlds:
                path = out / f"{impl}-{world}.json"
                print(f"peers: {impl} with {world} processes, run {rep + 1}/{args.repeat}",
                      flush=True)
                before = host.now(world)
                try:
                    launch(impl, world, str(path), args.ops, args.sizes, args.timeout,
                           args.fresh)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    print(f"peers: {impl} with {world} processes failed, run left out: {exc}",
                          flush=True)
                    continue
                rows = json.loads(path.read_text())
                runs.setdefault(f"{impl}/{world}", []).append(rows)
                launches.append({"impl": impl, "world": world, "rep": rep, "rows": rows,
                                 "probes": [before, host.now(world, fresh=True)]})
                path.unlink()
                probe = Path(f"{path}.link")
                if probe.exists():
                    links.setdefault(f"{impl}/{world}", []).append(json.loads(probe.read_text()))
                    probe.unlink()
    results = {key: _median_rows(rows) for key, rows in runs.items()}
    for world in args.worlds:
        mpi = best_mpi(results, world)
        if mpi is not None:
            results[f"mpi-best/{world}"] = mpi
    (out / "results.json").write_text(json.dumps(results, indent=1))
    md = markdown(results, args.worlds, impls + ["mpi-best"]) + torch_markdown(results,
                                                                                 args.worlds)
    if links:
        (out / "links.json").write_text(json.dumps(links, indent=1))
        md += links_markdown(links)
    if any(x["probes"][0] for x in launches):
        (out / "launches.json").write_text(json.dumps(launches, indent=1))
        md += host_state.states_markdown(launches, args.worlds, MPI_IMPLS)
    (out / "results.md").write_text(md)
    print(md)
    try:
        plot(results, args.worlds, impls + ["mpi-best"], out / "busbw.png")
    except ImportError:
        print("peers: matplotlib not installed, no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
