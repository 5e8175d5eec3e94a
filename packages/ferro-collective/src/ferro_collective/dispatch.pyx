# cython: language_level=3
"""The dispatcher: where every collective call is run, its executor chosen in one place, with
calls that only go down.

A call is a collective's record (:class:`.plan.Collective`, :mod:`.records`) and its
arguments. :func:`run` tries the executors in order:

1. **the one-call path** (:func:`._onecall.one_call`, compiled, a C call from here): the
   record's ``kind`` on a backend with the same-host engine, the common case (no algorithm
   forced, a contiguous array, an ``out=`` of the result's shape) run whole behind the engine's
   door; it answers ``NOT_TAKEN`` for any other call before taking a ticket;
2. **the plan** (:func:`.executors.general`): the record's ``prepare`` checks the call and
   plans it, and the plan runs on the executor :func:`.executors.executor` picks (hierarchical
   stages, the engine in its issue order, or the point-to-point algorithms).

:func:`submit` runs a call in the background (its place in the order of calls taken now).
While the process traces (``ferro_backend.timeline``) each call is one event
(:func:`.tracing.traced_call` times :func:`run_direct`); off, a call looks up one name.

Nothing below calls back up here: the executors are imported, not registered.
"""

from cpython.tuple cimport PyTuple_Check, PyTuple_GET_ITEM, PyTuple_GET_SIZE

from ferro_backend import timeline as _backend_timeline
from ferro_backend.tracebacks import user_facing as _user_facing

from . import executors, tracing
from ._onecall import NOT_TAKEN

from ._onecall cimport barrier_now, one_call

#: a call in the background (:func:`.executors.submit`)
submit = executors.submit
cdef object _NOT_TAKEN = NOT_TAKEN
cdef object _general = executors.general
cdef object _abandon = executors.abandon
cdef object _traced = tracing.traced_call
# ferro_backend.timeline's state, read per call (one dict lookup): its events list while this
# process traces, else None. Read, not registered for: nothing below calls back up here.
cdef dict _timeline = _backend_timeline.__dict__


def run(coll, tensor, backend, arg=None, timeout=None, algorithm=None, out=None, span=0):
    """One call of ``coll`` (a record), now: its one-call path where it has one and the call
    is its case, else its plan on the executor chosen for it; its result. ``arg``: the
    collective's own argument (op, root or None); ``span``: the numbers the caller's whole call
    takes where this is its first collective (:class:`~.plan.Plan`'s; a compressed call's)."""
    try:
        if _timeline["_events"] is not None:
            return _traced(run_direct, coll, tensor, backend, arg, timeout, algorithm, out,
                           span)
        return _run(coll, tensor, backend, arg, timeout, algorithm, out, span)
    except Exception as exc:  # its traceback ends here (ferro_backend.tracebacks.user_facing)
        _abandon(backend, exc)  # a deadline passed: no peer completes the call without us
        raise _user_facing(exc)


def run_barrier(coll, backend, timeout=None):
    """:func:`run` of a barrier (``coll``: its record): its one-call path taken without the
    record's kind read or the other collectives' arguments passed (a barrier is all call and no
    data: those were a tenth of its time on one rank), else :func:`run`."""
    try:
        if _timeline["_events"] is None and barrier_now(backend, timeout):
            return None
    except Exception as exc:
        _abandon(backend, exc)
        raise _user_facing(exc)
    return run(coll, None, backend, None, timeout)


def run_direct(coll, tensor, backend, arg=None, timeout=None, algorithm=None, out=None,
               span=0):
    """:func:`run` untraced (what the tracer times)."""
    return _run(coll, tensor, backend, arg, timeout, algorithm, out, span)


cdef object _run(coll, tensor, backend, arg, timeout, algorithm, out, span):
    if algorithm is None:
        kind = <object>PyTuple_GET_ITEM(coll, 2) if PyTuple_Check(coll) and \
            PyTuple_GET_SIZE(coll) > 2 else None
        if kind is not None:
            done = one_call(<int>kind, tensor, backend, arg, timeout, out, <unsigned int>span)
            if done is not _NOT_TAKEN:
                return done
    return _general(coll, tensor, backend, arg, timeout, algorithm, out, span)
