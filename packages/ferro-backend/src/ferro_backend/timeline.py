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

A rank stopped by SIGTERM (ferrorun stopping the others after a rank failed, ``scancel``) still
writes its file under ``FERRO_TRACE``: the calls it was inside then appear with
``unfinished=True``. A call that raised has ``error=<the exception's type>`` in its args.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .trace_files import _earlier_events, check_env_dir, merge, rank_files

__all__ = ["active", "add_hook", "check_env_dir", "merge", "rank_files", "record", "span",
           "start_from_env", "trace"]

log = logging.getLogger("ferro_backend.timeline")

_lock = threading.RLock()  # re-entrant: the SIGTERM handler writes from whatever the thread held
_events: list[dict] | None = None  # None: not tracing
_rank = 0
_name: str | None = None  # the process's name in the file (default "rank <r>")
_label: str | None = None  # the process's label in the file (where its ranks' cores stand)
_hooks: list[Callable[[bool], None]] = []
_open: dict[int, tuple] = {}  # the traced calls in flight: id(entry) -> entry (see _begin)
_written: set[Path] = set()  # the files FERRO_TRACE had this process write (a later init appends)
_in_recv = threading.local()  # .on: inside a traced recv (its inner wait is not recorded again)


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


def record(name: str, cat: str, start_us: float, dur_us: float, /, **args: Any) -> None:
    """One complete event (Chrome's "X" phase) on this thread; nothing when not tracing.

    Parameters
    ----------
    name : str
        The event's name (positional only: any keyword, ``start_us`` too, is an argument).
    cat : str
        Its category.
    start_us : float
        When it started, in microseconds since the epoch.
    dur_us : float
        How long it took, in microseconds.
    **args
        Shown with the event (a non-finite float is written as a string: ``"nan"``).
    """
    _append(name, cat, start_us, dur_us, threading.get_ident(), args)


def _append(name: str, cat: str, start_us: float, dur_us: float, tid: int, args: dict) -> None:
    events = _events
    if events is None:
        return
    ev = {"name": name, "cat": cat, "ph": "X", "ts": start_us, "dur": dur_us, "pid": _rank,
          "tid": tid & 0xFFFFFFFF, "args": args}
    with _lock:
        events.append(ev)


def _begin(name: str, cat: str, args: dict) -> list:
    """A traced call starts: kept in flight (a SIGTERM then records it as unfinished) until
    :func:`_end` records it."""
    entry = [name, cat, _now_us(), threading.get_ident(), args]
    _open[id(entry)] = entry
    return entry


def _end(entry: list, error: BaseException | None = None, **more: Any) -> None:
    """The call ``entry`` (:func:`_begin`) ended: one event, ``error=<type>`` if it raised."""
    if _open.pop(id(entry), None) is None:
        return  # already written as unfinished
    name, cat, t0, tid, args = entry
    if more:
        args = {**args, **more}
    if error is not None:
        args = {**args, "error": type(error).__name__}
    _append(name, cat, t0, _now_us() - t0, tid, args)


def _record_unfinished() -> None:
    """The calls in flight now, as events marked ``unfinished=True`` (before a SIGTERM ends
    the process)."""
    now = _now_us()
    for key in list(_open):
        entry = _open.pop(key, None)
        if entry is not None:
            name, cat, t0, tid, args = entry
            _append(name, cat, t0, now - t0, tid, {**args, "unfinished": True})


@contextlib.contextmanager
def span(name: str, cat: str = "span", /, **args: Any) -> Iterator[None]:
    """Record the time spent inside the block as one event (when tracing).

    Parameters
    ----------
    name : str
        The event's name (positional only, as ``cat``: every keyword is an argument).
    cat : str, default "span"
        Its category.
    **args
        Shown with the event; ``error=<the exception's type>`` is added when the block raises.

    Yields
    ------
    None
        The block runs timed.
    """
    if _events is None:
        yield
        return
    entry = _begin(name, cat, args)
    try:
        yield
    except BaseException as exc:
        _end(entry, exc)
        raise
    _end(entry)


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


def _stop(path: Path, before: list | None = None) -> Path:
    """Stop tracing and write the events (with this rank's process name) to ``path``, after
    ``before`` (the events of an earlier file kept)."""
    global _events, _name
    with _lock:
        events, _events = _events, None
        _open.clear()
    for hook in _hooks:
        hook(False)
    name, _name = _name or f"rank {_rank}", None
    meta = [{"name": "process_name", "ph": "M", "pid": _rank, "args": {"name": name}}]
    if _label is not None:
        meta.append({"name": "process_labels", "ph": "M", "pid": _rank,
                     "args": {"labels": _label}})
    for ev in events or ():
        ev["args"] = {k: _finite(v) for k, v in ev["args"].items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": [*meta, *(before or []), *(events or [])],
                               "displayTimeUnit": "ns"}, default=_plain))
    os.replace(tmp, path)
    return path


def _wrap_p2p(backend) -> Callable[[], None]:
    """Trace ``backend``'s send/recv/irecv/recv_any/irecv_any (instance attributes over the
    class's methods); returns what undoes it. A receive's inner wait (a TCP ``recv`` waits on
    its own ``irecv``) is not recorded again under it."""
    send, recv, irecv = backend.send, backend.recv, backend.irecv
    recv_any, irecv_any = getattr(backend, "recv_any", None), getattr(backend, "irecv_any", None)
    transport = type(backend).__name__

    def nbytes(buf):
        return getattr(buf, "nbytes", None)

    def t_send(data, dst, *, tag=0):
        entry, error = _begin("send", "p2p", {"peer": dst, "tag": tag, "bytes": nbytes(data),
                                              "transport": transport}), None
        try:
            return send(data, dst, tag=tag)
        except BaseException as exc:
            error = exc
            raise
        finally:
            _end(entry, error)

    def receiving(name, call, args, source):
        """Run ``call()`` (a blocking receive) as one event ``name``: its ``wait_us`` is its
        duration; ``source(result)`` names the sender when ``peer`` is not known before."""
        if getattr(_in_recv, "on", False):  # inside a traced receive: that one records it
            return call()
        entry, error, result = _begin(name, "p2p", args), None, None
        _in_recv.on = True
        try:
            result = call()
            return result
        except BaseException as exc:
            error = exc
            raise
        finally:
            _in_recv.on = False
            more = {"wait_us": _now_us() - entry[2]}
            if source is not None and error is None:
                more["peer"] = source(result)
            _end(entry, error, **more)

    def t_recv(out, src, *, tag=0, timeout=None):
        return receiving("recv", lambda: recv(out, src, tag=tag, timeout=timeout),
                         {"peer": src, "tag": tag, "bytes": nbytes(out),
                          "transport": transport}, None)

    def timed_wait(req, name, args, source):
        wait = req.wait

        def t_wait(timeout=None):
            return receiving(name, lambda: wait(timeout), args, source)

        try:
            req.wait = t_wait
        except AttributeError:  # a request type with __slots__: its waits go untimed
            pass
        return req

    def t_irecv(out, src, *, tag=0):
        req = irecv(out, src, tag=tag)
        if getattr(_in_recv, "on", False):
            return req
        return timed_wait(req, "recv.wait", {"peer": src, "tag": tag, "bytes": nbytes(out),
                                             "transport": transport}, None)

    def t_recv_any(out, *, tag=0, timeout=None):
        return receiving("recv_any", lambda: recv_any(out, tag=tag, timeout=timeout),
                         {"peer": None, "tag": tag, "bytes": nbytes(out),
                          "transport": transport}, lambda source: source)

    def t_irecv_any(out, *, tag=0):
        req = irecv_any(out, tag=tag)
        if getattr(_in_recv, "on", False):
            return req
        return timed_wait(req, "recv_any.wait", {"peer": None, "tag": tag, "bytes": nbytes(out),
                                                 "transport": transport},
                          lambda _: getattr(req, "source", None))

    names = ["send", "recv", "irecv"]
    backend.send, backend.recv, backend.irecv = t_send, t_recv, t_irecv
    if recv_any is not None and irecv_any is not None:
        backend.recv_any, backend.irecv_any = t_recv_any, t_irecv_any
        names += ["recv_any", "irecv_any"]

    def undo() -> None:
        for name in names:
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
    exits, SIGTERM included): then ``directory/rank_<r>.json``.

    A second backend of the same process (init, close, init) adds its events to the file the
    first wrote. Called from the main thread while SIGTERM has its default action, it installs
    a handler that writes the file (the calls in flight marked ``unfinished=True``), then
    lets SIGTERM end the process as it would have; the handler is removed when tracing stops.
    The process's name in the file says the attempt under ``ferrorun --max-restarts``
    (``FERRO_RESTART_COUNT``).

    Parameters
    ----------
    backend : ferro_backend.Backend
        The backend whose rank is traced (its point-to-point calls too).
    directory : str
        Where the rank's file goes (``FERRO_TRACE``).
    """
    global _name
    from . import settings

    _start(backend.rank, backend)
    try:
        restart = settings.RESTART_COUNT.get()
    except ValueError:
        restart = 0
    if restart:
        _name = f"rank {backend.rank} (restart {restart})"
    undo = _wrap_p2p(backend)
    target = Path(directory) / f"rank_{backend.rank}.json"
    done = threading.Event()
    handler: list = []  # [the handler installed, the one it replaced]

    def finish(unfinished: bool = False) -> None:
        if done.is_set():
            return
        done.set()
        undo()
        if unfinished:
            _record_unfinished()
        before = _earlier_events(target) if target in _written else None
        try:
            _stop(target, before)
            _written.add(target)
        except Exception as exc:  # a trace that cannot be written must not fail the close
            log.warning("ferro trace: could not write %s: %s", target, exc)
        atexit.unregister(finish)
        if handler and threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, TypeError):
                if signal.getsignal(signal.SIGTERM) is handler[0]:
                    signal.signal(signal.SIGTERM, handler[1])

    def on_sigterm(signum, frame) -> None:
        try:
            finish(unfinished=True)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)  # killed by SIGTERM, as without the trace

    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, TypeError):
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, on_sigterm)
                handler[:] = [on_sigterm, signal.SIG_DFL]
    if hasattr(backend, "on_close"):
        backend.on_close(finish)
    atexit.register(finish)


def _finite(value: Any) -> Any:
    """A non-finite float as a string (JSON has no NaN: chrome://tracing refuses the file)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _plain(value: Any) -> Any:
    """What the trace's JSON holds for an argument JSON has no type for (a call refused for
    it, as a numpy integer rank or an algorithm given as bytes, is recorded too)."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return _finite(item())  # numpy scalars
        except (TypeError, ValueError):
            pass
    return repr(value)
