# The module's entry points (included at the end of _fastcall.pyx): the general path and the
# tracer it can be handed to, run (the public call's way in) and the one-call dispatch.

def set_general(general) -> None:
    """Take the general path :func:`run` falls back to: ``general(coll, tensor, backend, arg,
    timeout, algorithm, out)`` (the dispatcher's)."""
    global _general
    _general = general


cdef object _tracer = None


def set_tracer(tracer) -> None:
    """While tracing (``ferro_backend.timeline``), :func:`run` hands every call to
    ``tracer(coll, tensor, backend, arg, timeout, algorithm, out)``, which times
    :func:`run_direct`; None: no tracing (one pointer check per call)."""
    global _tracer
    _tracer = tracer


def run(coll, tensor, backend, arg=None, timeout=None, algorithm=None, out=None):
    """One call of ``coll`` (a ``dispatch.Collective``), now: its one-call path where it has one
    and the call is its case, else the general path (:func:`set_general`); its result."""
    try:
        if _tracer is not None:
            return _tracer(coll, tensor, backend, arg, timeout, algorithm, out)
        return _run(coll, tensor, backend, arg, timeout, algorithm, out)
    except Exception as exc:  # its traceback ends here (ferro_backend.tracebacks.user_facing)
        raise _user_facing(exc)


def run_direct(coll, tensor, backend, arg=None, timeout=None, algorithm=None, out=None):
    """:func:`run` without the tracer (what a tracer calls)."""
    return _run(coll, tensor, backend, arg, timeout, algorithm, out)


cdef object _run(coll, tensor, backend, arg, timeout, algorithm, out):
    if algorithm is None:
        kind = <object>PyTuple_GET_ITEM(coll, 2) if PyTuple_Check(coll) and \
            PyTuple_GET_SIZE(coll) > 2 else None
        if kind is not None:
            done = _one_call(<int>kind, tensor, backend, arg, timeout, out)
            if done is not _NOT_TAKEN:
                return done
    return _general(coll, tensor, backend, arg, timeout, algorithm, out)


cdef object _one_call(int kind, object tensor, object backend, object arg, object timeout,
                      object out):
    """Run a call of ``kind`` (``arg``: its op or root) whole on ``backend``'s engine door, or
    :data:`NOT_TAKEN`: no engine, no group yet (the general path makes it), or not the case."""
    engine = getattr(backend, "engine", None)
    if engine is None:
        return _NOT_TAKEN
    client = engine.client
    if not isinstance(client, Core):
        return _NOT_TAKEN
    cdef Core c = <Core>client
    if kind <= K_REDUCE_SCATTER:
        return c._fold_now(kind, tensor, out, arg, timeout)
    if kind == K_BROADCAST:
        if type(arg) is not int or not 0 <= arg < c.n:
            return _NOT_TAKEN
        return c._copy_now(K_BROADCAST, tensor, out, arg, <Py_ssize_t>arg, timeout)
    if kind == K_ALL_GATHER:
        return c._copy_now(K_ALL_GATHER, tensor, out, -1, -1, timeout)
    if kind == K_GATHER:
        if type(arg) is not int or not 0 <= arg < c.n:
            return _NOT_TAKEN
        return c._copy_now(K_GATHER, tensor, out, arg, <Py_ssize_t>arg, timeout)
    c._barrier_now(timeout)
    return None


cdef inline cnp.ndarray _array(object tensor):
    """``tensor`` when it is an ndarray (a Python or numpy scalar as a 0-d array), else None."""
    if cnp.PyArray_CheckExact(tensor):
        return <cnp.ndarray>tensor
    x = fast_array(tensor)
    return None if x is None else <cnp.ndarray>x
