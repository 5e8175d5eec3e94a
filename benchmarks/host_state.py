"""The host's state around every launch of a benchmark, whatever runs in it (issue 55).

On this project's VM two processes' cores are found in one of three states, each lasting from
under a second to minutes: they share a cache (a cache line's round trip 28-60 ns), they share
none (88-133 ns) or they sit far apart (426-550 ns). An implementation that launches in a
slower state than its peer's reads slower for it. ferro's launches probe themselves as they
form (``engine.link``); MPI's and torch's cannot run ferro's probe. So ``peers.py`` runs the
probe as a job of its own, of two processes (``min(world, cores)``) bound as ferro binds them,
just before every launch and once after the last: a launch's state is the one the probes either
side of it agree on, else ``moved``. :func:`states_markdown` then compares the implementations
state by state.

    python benchmarks/host_state.py          # one probe now: "apart (113 ns, 40.2 GB/s)"
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

#: a round trip below this many ns: the cores share a cache (the engine's own threshold,
#: ``ferro_backend.engine.link.SHARED_CACHE_NS``, kept here so the tables render without ferro)
SHARED_CACHE_NS = 75.0
#: a round trip from this many ns: the cores sit far apart (between 133 and 426 ns nothing was
#: ever measured here)
FAR_NS = 250.0
#: the states in the order the tables give them; "moved": the probes either side disagree
STATES = ("shared", "apart", "far", "moved")
#: what each state means, for the tables
MEANING = {"shared": f"the cores share a cache (round trip < {SHARED_CACHE_NS:.0f} ns)",
           "apart": "the cores share no cache",
           "far": f"the cores sit far apart (round trip >= {FAR_NS:.0f} ns)",
           "moved": "the probes before and after the launch disagree"}


def state_of(rtt_ns: float) -> str:
    """The state a cache line's round trip of ``rtt_ns`` says."""
    if rtt_ns < SHARED_CACHE_NS:
        return "shared"
    return "apart" if rtt_ns < FAR_NS else "far"


def launch_state(before: list | None, after: list | None) -> str | None:
    """A launch's state from the probes (``[rtt_ns, copy_gbps]``) either side of it; None when
    either is missing."""
    if not before or not after:
        return None
    a, b = state_of(before[0]), state_of(after[0])
    return a if a == b else "moved"


def probe_processes(world: int) -> int:
    """The processes of the probe job for a launch of ``world``: two cores are what the probe
    compares, and the probe spins, so never more processes than cores."""
    return min(world, len(os.sched_getaffinity(0)))


def probe_worker(out_path: str) -> None:
    """One rank of the probe job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
    environment): forms a shared-memory group, whose engine probes as it forms; rank 0 writes
    ``[rtt_ns, copy_gbps]`` to ``out_path``."""
    import ferro_backend

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    b = ferro_backend.ShmBackend(rank, world, f"{os.environ['MASTER_ADDR']}:"
                                 f"{os.environ['MASTER_PORT']}", timeout=60)
    try:
        link = b.engine.link
        if rank == 0:
            Path(out_path).write_text(json.dumps(
                None if link is None else [link.rtt_ns, link.copy_gbps]))
    finally:
        b.close()


def _median_us(rows: list[list[dict]], i: int) -> float:
    return statistics.median(r[i]["seconds"] for r in rows) * 1e6


def states_markdown(launches: list[dict], worlds: list[int], mpi_impls: tuple) -> str:
    """ferro-shm against the best MPI state by state: per world and state, the launches each
    implementation had in it, and where ferro-shm and an MPI both had one, per row the median
    us of ferro-shm's launches, of the fastest MPI's (which) and their ratio (the MPI's time
    over ferro's: above 1, ferro is ahead).

    ``launches``: one dict per launch, ``impl``, ``world``, ``probes`` (before, after: each
    ``[rtt_ns, copy_gbps]`` or None) and ``rows`` (peers.py's rows)."""
    from peers import _human

    lines = ["\nThe host's state around each launch (`host_state.py`: ferro's link probe as a job "
             "of its own just before every launch and after the last; a launch's state is the "
             "one both probes give)."]
    for world in worlds:
        mine = [x for x in launches if x["world"] == world]
        by: dict[str, dict[str, list]] = {}
        for x in mine:
            state = launch_state(*x["probes"])
            if state is not None:
                by.setdefault(state, {}).setdefault(x["impl"], []).append(x["rows"])
        if not by:
            continue
        lines.append(f"\n#### {world} processes, state by state\n")
        for state in (s for s in STATES if s in by):
            counts = ", ".join(f"{impl} {len(rows)}" for impl, rows in by[state].items())
            lines.append(f"- **{state}** ({MEANING[state]}): launches {counts}")
        for state in (s for s in STATES if s in by and s != "moved"):
            impls = by[state]
            mpis = [m for m in mpi_impls if m in impls]
            if "ferro-shm" not in impls or not mpis:
                continue
            lines.append(f"\n{state}: us per call, median of the launches in it\n")
            lines.append("| op | size | ferro-shm | mpi-best (which) | mpi-best / ferro-shm |")
            lines.append("|---|---|---|---|---|")
            ferro = impls["ferro-shm"]
            for i, row in enumerate(ferro[0]):
                best, which = min((_median_us(impls[m], i), m) for m in mpis)
                us = _median_us(ferro, i)
                size = "-" if row["op"] == "barrier" else _human(row["bytes"])
                lines.append(f"| {row['op']} | {size} | {us:.2f} ({len(ferro)}) | {best:.2f} "
                             f"({which}, {len(impls[which])}) | {best / us:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import tempfile

    import peers

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        peers.launch("probe", probe_processes(2), str(out), ["barrier"], [0], timeout=60)
        got = json.loads(out.read_text())
    print("no probe: fewer than 2 cores" if got is None
          else f"{state_of(got[0])} ({got[0]:.0f} ns, {got[1]:.1f} GB/s)")
