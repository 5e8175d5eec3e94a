"""Rank functions for the split allreduce tests (spawned processes import them)."""

import os

import numpy as np
from engine_fns import StallFlag, _wait_for

import ferro_collective as fc
from ferro_collective import ReduceOp
from ferro_collective.engine_group import group_of


def equals_star(b, cases: list) -> list[str]:
    """Each (dtype, item count, op) allreduce on the split path against the star algorithm, bit
    for bit: new result, ``out=``, in place, and one rank on the general path (a strided input)
    while the others take the compiled one; returns the failures (empty: all equal)."""
    g = group_of(b) or (fc.barrier(b) or group_of(b))
    bad = [] if g.steps.split_bytes > 0 else ["the split path is off"]
    rng = np.random.default_rng(b.rank)
    for dtype, count, op_name in cases:
        dt, op = np.dtype(dtype), ReduceOp[op_name]
        x = ((rng.standard_normal(count) * 3).astype(dt) if dt.kind == "f"
             else rng.integers(0, 50, count).astype(dt))
        label = f"{dtype}[{count}] {op_name}"
        with np.errstate(all="ignore"):
            ref = fc.allreduce(x, b, op, algorithm="star").tobytes()
            got = fc.allreduce(x, b, op)
            out = np.empty_like(x)
            fc.allreduce(x, b, op, out=out)
            inplace = x.copy()
            fc.allreduce(inplace, b, op, out=inplace)
            wide = np.repeat(x, 2)  # rank 1 passes a strided view: the general path
            mixed = fc.allreduce(wide[::2] if b.rank == 1 else x, b, op)
        for name, res in (("new", got), ("out=", out), ("in place", inplace), ("mixed", mixed)):
            if res.tobytes() != ref:
                bad.append(f"{label} {name}")
    return bad


def late_in_split(b, count: int, flags: str) -> list:
    """Rank 1 starts each split allreduce after rank 0's stall report (it waits for the file
    rank 0's log handler writes on it; the report comes at a quarter of the 4 s deadline), so
    before the deadline: rank 0's call waits on and returns the right result, on the compiled
    path and on the general path."""
    fc.set_stall_report(0.25)
    got = []
    x = np.arange(count, dtype=np.float32) + b.rank
    expected = sum(np.arange(count, dtype=np.float32) + r for r in range(b.world_size))
    with StallFlag(flags) as stall:
        for strided in (False, True):
            stall.flag = f"stall{int(strided)}"
            if b.rank == 1:
                got.append(_wait_for(os.path.join(flags, stall.flag)))
            arg = np.repeat(x, 2)[::2] if strided else x
            got.append(bool((fc.allreduce(arg, b, timeout=4) == expected).all()))
    fc.barrier(b, timeout=10)
    return got


def gathers_equal_star(b, sizes: list) -> list[str]:
    """all_gather of blocks beyond a slot (streamed through the slots, the ring of chunks
    wrapping many times) against the star algorithm, bit for bit: new result, ``out=``, and
    one rank on the general path while the others take the compiled one."""
    bad = []
    rng = np.random.default_rng(b.rank)
    for size in sizes:
        x = rng.integers(0, 1 << 16, size, dtype=np.uint16)
        ref = fc.all_gather(x, b, algorithm="star").tobytes()
        out = np.empty(size * b.world_size, np.uint16)
        results = {"new": fc.all_gather(x, b), "out=": fc.all_gather(x, b, out=out),
                   "mixed": fc.all_gather(np.repeat(x, 2)[::2] if b.rank == 1 else x, b)}
        bad += [f"all_gather {size} {name}" for name, res in results.items()
                if res.tobytes() != ref]
    return bad


def late_in_stream(b, size: int, flags: str) -> list:
    """Rank 1 starts a streamed all_gather after rank 0's stall report (the file rank 0's log
    handler writes on it; at a quarter of the 4 s deadline), before its deadline."""
    fc.set_stall_report(0.25)
    out = []
    x = np.full(size, b.rank, np.float32)
    with StallFlag(flags) as stall:
        stall.flag = "stall"
        if b.rank == 1:
            out.append(_wait_for(os.path.join(flags, stall.flag)))
        got = fc.all_gather(x, b, timeout=4)
    fc.barrier(b, timeout=10)
    return out + [bool((got == np.repeat(np.arange(b.world_size, dtype=np.float32),
                                         size)).all())]


def stream_then_one_step(b, rounds: int) -> list[str]:
    """Streamed all_gathers each followed at once by a one-step allreduce that fills a slot
    (4 KiB slots, blocks of 12 KiB: the ring wraps and its last chunks sit in the slot the next
    step writes): a rank done first must not overwrite chunks a peer has still to read."""
    bad = []
    n = b.world_size
    out = np.empty(3072 * n, np.float32)
    for k in range(rounds):
        x = np.full(3072, k * n + b.rank, np.float32)
        fc.all_gather(x, b, out=out)
        y = fc.allreduce(np.full(1024, float(-k - b.rank), np.float32), b)
        if not (out == np.repeat(np.arange(k * n, k * n + n, dtype=np.float32), 3072)).all():
            bad.append(f"all_gather of round {k}")
        if not (y == -float(k * n + n * (n - 1) // 2)).all():
            bad.append(f"allreduce of round {k}")
    return bad


def scatters_equal_star(b, cases: list, within: bool = False) -> list[str]:
    """Each (dtype, items per rank, op) reduce_scatter on the split path (beyond a slot; or,
    ``within``, from 256 KiB within one, where only the other ranks' parts go into this rank's
    slot) against the star algorithm, bit for bit: new result, ``out=``, and one rank on the
    general path (a strided input) while the others take the same step; returns the
    failures."""
    n = b.world_size
    g = group_of(b) or (fc.barrier(b) or group_of(b))
    bad = [] if g.steps.split_bytes > 0 else ["the split path is off"]
    rng = np.random.default_rng(b.rank)
    for dtype, per, op_name in cases:
        dt, op = np.dtype(dtype), ReduceOp[op_name]
        x = ((rng.standard_normal(n * per) * 3).astype(dt) if dt.kind == "f"
             else rng.integers(0, 50, n * per).astype(dt))
        label = f"{dtype}[{n}x{per}] {op_name}"
        if within and not 256 << 10 <= x.nbytes <= g.slot_bytes:
            bad.append(f"{label}: not from 256 KiB within a slot")
        elif not within and x.nbytes <= g.slot_bytes:  # (the door splits beyond a slot)
            bad.append(f"{label}: not split beyond a slot")
        with np.errstate(all="ignore"):
            ref = fc.reduce_scatter(x, b, op, algorithm="star").tobytes()
            sent = b.engine.bytes_sent
            got = fc.reduce_scatter(x, b, op)
            # split from 256 KiB and 4 split thresholds (an oversubscribed job's is higher)
            split = not within or x.nbytes >= max(256 << 10, 4 * g.steps.split_bytes)
            want = x.nbytes - x.nbytes // n if split else x.nbytes
            if b.engine.bytes_sent - sent != want:
                bad.append(f"{label}: wrote {b.engine.bytes_sent - sent} bytes into the slot, "
                           f"{'split' if split else 'one step'} writes {want}")
            out = np.empty(per, dt)
            fc.reduce_scatter(x, b, op, out=out)
            wide = np.repeat(x, 2)
            mixed = fc.reduce_scatter(wide[::2] if b.rank == 1 else x, b, op)
            inplace = x.copy()  # out is this rank's part of the input itself
            mine = inplace[b.rank * per:(b.rank + 1) * per]
            fc.reduce_scatter(inplace, b, op, out=mine)
        for name, res in (("new", got), ("out=", out), ("mixed", mixed), ("in place", mine)):
            if res.tobytes() != ref:
                bad.append(f"{label} {name}")
    return bad


def equals_star_streaming(b, cases: list, small_bytes: int, slow_factor: float) -> list[str]:
    """equals_star with this rank's copies into the segment set by ``Steps.set_put``
    (``small_bytes=0, slow_factor=0``: every large call counts as slow and streams, every
    64th re-tries plain stores); also returns the rate it calibrated, ns per KiB."""
    g = group_of(b) or (fc.barrier(b) or group_of(b))
    rate = g.steps.set_put(small_bytes, slow_factor)
    bad = equals_star(b, cases)
    return bad + ([] if rate >= 0 else [f"calibrated rate {rate}"])


def broadcasts_in_half_slots(b, cases: list) -> list[str]:
    """Each (dtype, items, root) broadcast through the door, from the root's random data, on
    every rank: the root's bits (new result, ``out=``, a non-root passing None), in the number
    of steps the door takes: one a slot, or one a half slot for more than half a slot up to
    8 MiB (items equal across the steps); returns the failures."""
    g = group_of(b) or (fc.barrier(b) or group_of(b))
    bad = []
    for dtype, count, root in cases:
        dt = np.dtype(dtype)
        data = np.random.default_rng(count).integers(0, 250, count).astype(dt)
        label = f"{dtype}[{count}] from {root}"
        x = data if b.rank == root else np.zeros(count, dt)
        item, slot = dt.itemsize, g.slot_bytes // dt.itemsize * dt.itemsize
        half = slot // 2 // item * item
        if half < x.nbytes <= 8 << 20:
            pieces = -(-x.nbytes // half)
            chunk = -(-count // pieces) * item
        else:
            chunk = slot
        want = max(1, -(-x.nbytes // chunk))
        before = b.engine.comm.step
        got = fc.broadcast(x, b, root)
        if b.engine.comm.step - before != want:
            bad.append(f"{label}: {b.engine.comm.step - before} steps, want {want}")
        out = np.empty(count, dt)
        fc.broadcast(x, b, root, out=out)
        none = fc.broadcast(x if b.rank == root else None, b, root)
        for name, res in (("new", got), ("out=", out), ("None", none)):
            if res.tobytes() != data.tobytes():
                bad.append(f"{label} {name}")
    return bad
