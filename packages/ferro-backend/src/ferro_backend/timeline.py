"""A timeline of what each rank did: Chrome/Perfetto trace-event JSON, one file per rank.

``with ferro_backend.trace("rank0.json", backend=b): ...`` (or ``FERRO_TRACE=dir`` under any
launcher: ``init_from_env`` then writes ``dir/rank_<r>.json`` when the backend closes or the
process exits) records every collective (ferro-collective reports its calls here: op, bytes,
dtype, algorithm asked, transport, start and duration), every point-to-point call of the traced
backend (send, recv, and the time a receive waited for its message), and spans the other layers
open with :func:`span` (FSDP's unit gathers and reduce-scatters, checkpoint saves).
``ferrorun --trace DIR`` merges the ranks' files into ``DIR/trace.json``, one process per rank,
which https://ui.perfetto.dev (or chrome://tracing) opens.

Off (the default) it costs nothing on the hot paths: the collectives' compiled entry checks one
C pointer, and backends are wrapped only while traced.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["active", "add_hook", "merge", "record", "span", "start_from_env", "trace"]

_lock = threading.Lock()
_events: list[dict] | None = None  # None: not tracing
_rank = 0
_label: str | None = None  # the process's label in the file (where its ranks' cores stand)
_hooks: list[Callable[[bool], None]] = []


def _now_us() -> float:
    return time.time_ns() / 1000.0


def active() -> bool:
    """Whether this process is tracing now."""
    return _events is not None


def add_hook(hook: Callable[[bool], None]) -> None:
    """``hook(True)`` when tracing starts, ``hook(False)`` when it stops (at once if it is on):
    how a layer above that keeps state of its own while tracing is told."""
    _hooks.append(hook)
    if active():
        hook(True)


def record(name: str, cat: str, start_us: float, dur_us: float, **args: Any) -> None:
    """One complete event (Chrome's "X" phase) on this thread; nothing when not tracing."""
    events = _events
    if events is None:
        return
    ev = {"name": name, "cat": cat, "ph": "X", "ts": start_us, "dur": dur_us, "pid": _rank,
          "tid": threading.get_ident() & 0xFFFFFFFF, "args": args}
    with _lock:
        events.append(ev)


@contextlib.contextmanager
def span(name: str, cat: str = "span", **args: Any) -> Iterator[None]:
    """Record the time spent inside the block as one event (when tracing)."""
    if _events is None:
        yield
        return
    t0 = _now_us()
    try:
        yield
    finally:
        record(name, cat, t0, _now_us() - t0, **args)


def _start(rank: int, backend=None) -> None:
    global _events, _rank, _label
    with _lock:
        if _events is not None:
            raise RuntimeError("trace: this process is already tracing")
        _events, _rank = [], rank
    # a same-host engine's latest link probe (engine/link.py): which state the job runs in
    link = getattr(getattr(backend, "engine", None), "link", None)
    _label = None if link is None else f"at the last link probe, {link.describe()}"
    for hook in _hooks:
        hook(True)


def _stop(path: Path) -> Path:
    """Stop tracing and write the events (with this rank's process name) to ``path``."""
    global _events
    with _lock:
        events, _events = _events, None
    for hook in _hooks:
        hook(False)
    meta = [{"name": "process_name", "ph": "M", "pid": _rank, "args": {"name": f"rank {_rank}"}}]
    if _label is not None:
        meta.append({"name": "process_labels", "ph": "M", "pid": _rank,
                     "args": {"labels": _label}})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": [*meta, *(events or [])],
                               "displayTimeUnit": "ns"}, default=_plain))
    os.replace(tmp, path)
    return path


def _wrap_p2p(backend) -> Callable[[], None]:
    """Trace ``backend``'s send/recv/irecv (instance attributes over the class's methods);
    returns what undoes it."""
    send, recv, irecv = backend.send, backend.recv, backend.irecv
    transport = type(backend).__name__

    def t_send(data, dst, *, tag=0):
        t0 = _now_us()
        try:
            return send(data, dst, tag=tag)
        finally:
            record("send", "p2p", t0, _now_us() - t0, peer=dst, tag=tag,
                   bytes=getattr(data, "nbytes", None), transport=transport)

    def t_recv(out, src, *, tag=0, timeout=None):
        t0 = _now_us()
        try:
            return recv(out, src, tag=tag, timeout=timeout)
        finally:
            dur = _now_us() - t0
            record("recv", "p2p", t0, dur, peer=src, tag=tag, bytes=getattr(out, "nbytes", None),
                   transport=transport, wait_us=dur)

    def t_irecv(out, src, *, tag=0):
        req = irecv(out, src, tag=tag)
        wait = req.wait

        def t_wait(timeout=None):
            t0 = _now_us()
            try:
                return wait(timeout)
            finally:
                record("recv.wait", "p2p", t0, _now_us() - t0, peer=src, tag=tag,
                       bytes=getattr(out, "nbytes", None), transport=transport,
                       wait_us=_now_us() - t0)

        try:
            req.wait = t_wait
        except AttributeError:  # a request type with __slots__: its waits go untimed
            pass
        return req

    backend.send, backend.recv, backend.irecv = t_send, t_recv, t_irecv

    def undo() -> None:
        for name in ("send", "recv", "irecv"):
            backend.__dict__.pop(name, None)

    return undo


@contextlib.contextmanager
def trace(path, *, backend=None, rank: int | None = None) -> Iterator[None]:
    """Trace this process inside the block and write ``path`` (trace-event JSON) at its end.

    Parameters
    ----------
    path : str or os.PathLike
        The trace-event JSON file written when the block ends (open it in Perfetto or
        ``chrome://tracing``).
    backend : ferro_backend.Backend, optional
        Also trace its point-to-point calls (and name the file's process after its rank).
    rank : int, optional
        The process's number in the file when no backend is given (default 0).

    Yields
    ------
    None
        The block runs traced.

    Raises
    ------
    RuntimeError
        This process is already tracing.

    Examples
    --------
    >>> with trace("rank0.json", backend=backend):
    ...     allreduce(x, backend)
    """
    who = rank if rank is not None else (backend.rank if backend is not None else 0)
    _start(who, backend)
    undo = _wrap_p2p(backend) if backend is not None else (lambda: None)
    try:
        yield
    finally:
        undo()
        _stop(Path(path))


def start_from_env(backend, directory: str) -> None:
    """``FERRO_TRACE=directory``: trace ``backend``'s rank until it closes (or the process
    exits): then ``directory/rank_<r>.json``."""
    _start(backend.rank, backend)
    undo = _wrap_p2p(backend)
    target = Path(directory) / f"rank_{backend.rank}.json"
    done = threading.Event()

    def finish() -> None:
        if not done.is_set():
            done.set()
            undo()
            _stop(target)

    backend.on_close(finish) if hasattr(backend, "on_close") else None
    import atexit

    atexit.register(finish)


def _plain(value: Any) -> Any:
    """What the trace's JSON holds for an argument JSON has no type for (a call refused for
    it, as a numpy integer rank or an algorithm given as bytes, is recorded too)."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()  # numpy scalars
        except (TypeError, ValueError):
            pass
    return repr(value)


def merge(files, out) -> Path:
    """One trace of the whole job from the ranks' files (``ferrorun --trace``)."""
    events: list = []
    for f in sorted(map(Path, files)):
        events.extend(json.loads(f.read_text())["traceEvents"])
    out = Path(out)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ns"}))
    return out
