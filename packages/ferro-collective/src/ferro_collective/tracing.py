"""The collectives on the timeline (``ferro_backend.trace``, ``FERRO_TRACE``, ``ferrorun
--trace``): while a process traces, every call (blocking, through the compiled entry, and
``*_async``, on its worker) becomes one event: the collective's name, bytes and dtype of this
rank's input, the algorithm asked for, the transport, the caller's rank and world size (a
process running several ranks as threads records them all, told apart by rank and thread).
On the same-host engine it also gives ``wait_us``: how long the call's engine steps waited for
their peers (the engine times its waits only while a call is traced); over the other transports
the backend's ``recv.wait`` events under the call show it. Off, the dispatcher checks one flag
(:mod:`.dispatch`, which hands its calls to :func:`traced_call` while tracing). A call that
raised has ``error=<the exception's type>`` in its args; one still running when a SIGTERM ends
the rank, ``unfinished=True``."""

from __future__ import annotations

import numpy as np

from ferro_backend import timeline


def _now() -> float:
    return timeline._now_us()


def _describe(tensor, backend, algorithm) -> dict:
    x = tensor if isinstance(tensor, np.ndarray) else None
    engine = getattr(backend, "engine", None) is not None
    return {"bytes": None if x is None else int(x.nbytes),
            "dtype": None if x is None else str(x.dtype),
            "algorithm": algorithm or "auto",
            "transport": "engine" if engine else type(backend).__name__,
            "rank": backend.rank, "world": backend.world_size}


class _EngineWaits:
    """The seconds ``backend``'s engine steps wait for their peers during one call (their
    waits timed for the call); nothing for a backend without the engine."""

    def __init__(self, backend) -> None:
        engine = getattr(backend, "engine", None)
        self.steps = None if engine is None else engine.steps
        if self.steps is not None:
            self.start = self.steps.timed_waits(True)

    def args(self) -> dict:
        if self.steps is None:
            return {}
        return {"wait_us": round((self.steps.timed_waits(False) - self.start) * 1e6, 1)}


def traced_call(run, coll, tensor, backend, arg=None, timeout=None, algorithm=None, out=None,
                span=0):
    """One collective, ``run(coll, tensor, backend, arg, timeout, algorithm, out, span)``,
    timed (what the dispatcher does with a call while tracing)."""
    entry = timeline._begin(coll.name, "collective", _describe(tensor, backend, algorithm))
    waits, error = _EngineWaits(backend), None
    try:
        return run(coll, tensor, backend, arg, timeout, algorithm, out, span)
    except BaseException as exc:
        error = exc
        raise
    finally:
        timeline._end(entry, error, **waits.args())


def traced_job(name: str, job, tensor, backend, algorithm):
    """An ``*_async`` call's job, timed on the worker that runs it (while tracing)."""
    if not timeline.active():
        return job

    def run():
        entry = timeline._begin(name, "collective.async", _describe(tensor, backend, algorithm))
        waits, error = _EngineWaits(backend), None
        try:
            return job()
        except BaseException as exc:
            error = exc
            raise
        finally:
            timeline._end(entry, error, **waits.args())

    return run


__all__ = ["traced_call", "traced_job"]
