"""Run a function as every rank of a real multi-process TcpBackend job (spawned processes)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback

from ferro_backend import TcpBackend
from ferro_backend.testing import free_port


def _child(fn, rank, world, addr, timeout, args, results):
    try:
        with TcpBackend(rank, world, addr, timeout=timeout) as b:
            results.put((rank, "ok", fn(b, *args)))
    except BaseException as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_tcp(fn, world: int, *args, timeout: float = 60.0, backend_timeout: float = 30.0) -> list:
    """``fn(backend, *args)`` on ``world`` spawned processes; returns results by rank.

    ``fn`` must be a module-level function. Every process is joined or killed before returning.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_child, args=(fn, r, world, addr, backend_timeout, args,
                                                results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors = {}
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=timeout)
            (out if status == "ok" else errors)[rank] = value
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(range(world)) - out.keys())} did not report "
                             f"within {timeout}s") from None
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    if errors:
        raise AssertionError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [out[r] for r in range(world)]
