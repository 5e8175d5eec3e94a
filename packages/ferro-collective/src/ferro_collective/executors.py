"""The executors of a planned call, and the choice among them: below the dispatcher
(:mod:`.dispatch`, which tries the compiled one-call path first and hands every other call to
:func:`general`).

:func:`general` checks a call with its record's ``prepare`` (the :class:`~.plan.Plan`) and runs
the plan on the executor :func:`executor` picks for it when it is issued (so that an async call,
:func:`submit`, keeps its place in the order of calls):

1. **hierarchical stages**, on a multi-node backend without an engine of its own, where the
   cost model (:func:`prefer_hierarchical`) rates them faster than the flat call;
2. **the engine**, on a backend with one, in its issue order (the plan's engine body, or its
   Python body where it has none);
3. **Python**: the plan's algorithms over point-to-point messages.

The stages of a hierarchical call are plans of their own, on the node and cross groups, which
the stages hand back to :data:`execute` (``execute(plan)``; ``execute.prepare(name, ...)``
makes a stage's plan of another collective from its record): a collective's module never calls
back up, nor imports another collective's module to call it.

A call whose own arguments are wrong (``prepare`` raised TypeError or ValueError) is refused
(:class:`Refusal`): the rank still takes the call's place in the order and publishes a header
saying so, with its reason, where its peers compare headers, so that they raise at once
(:class:`~ferro_backend.CollectiveMismatchError` naming the rank and the reason) instead of
waiting for their deadline; it raises its own error at once, the refusal published in the
background.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ferro_backend import Backend, CollectiveTimeoutError, DistributedError, SubBackend
from ferro_backend.tracebacks import user_facing

from . import costmodel, records, tracing
from .engine_group import group_of
from .header import mismatch_check_enabled, refusal
from .per_backend import state
from .plan import Collective, Plan, choose
from .stage_check import Check, Refused, StageSet
from .work import Work

#: a call's own argument errors: the rank that makes one refuses the call (:class:`Refusal`)
ARGUMENT_ERRORS = (TypeError, ValueError)


def _prepare(coll: Collective, tensor, backend, arg, timeout, algorithm, out,
             span: int = 0) -> Plan:
    """``coll``'s plan for this call (``span``: :class:`~.plan.Plan`'s); where its own
    arguments are wrong, the call is refused (:class:`Refusal`, published in the background,
    with the same span) and the argument error raised."""
    try:
        plan = coll.prepare(tensor, backend, arg, timeout, algorithm, out)
    except ARGUMENT_ERRORS as exc:
        refused = Refusal.of(coll.name, backend, timeout, exc)
        if refused is not None:
            refused.span = span
            refused.start()
        raise
    plan.span = span
    return plan


def prepared(coll: Collective, tensor, backend, arg, timeout,
             out=None, span: int = 0) -> tuple[int, Callable[[], Any]]:
    """A call of ``coll`` checked and numbered now (its place in the backend's order of calls
    taken) and its executor, to run later, once: ``(seq, run)``. ``tensor`` is the buffer it
    will send, which may be filled until ``run()`` (:mod:`.compressed`'s background calls).
    ``span``: the numbers the caller's whole call takes (:class:`~.plan.Plan`'s)."""
    plan = _prepare(coll, tensor, backend, arg, timeout, None, out, span)
    go = executor(plan)
    return plan.seq, go


def general(coll: Collective, tensor, backend, arg, timeout, algorithm, out, span: int = 0):
    """A call the one-call path did not take: its plan, on the executor chosen now
    (``span``: :class:`~.plan.Plan`'s)."""
    return executor(_prepare(coll, tensor, backend, arg, timeout, algorithm, out, span))()


#: the start of an error message that names one of a compressed call's collectives
#: (``name (seq N) on rank R: ...`` over messages, ``name: rank R <-> P: ...`` on the engine)
_INTERNAL = re.compile(r"(all_to_all_single|all_gather|allreduce|reduce_scatter)( \(seq \d+\)|(?=: ))")
#: the user's call this thread's collectives are part of (:func:`calling`)
_CALLING = threading.local()


def in_call(error: BaseException, call: str) -> BaseException:
    """``error``, met by one of a compressed call's collectives, in the name of the user's call
    ``call`` (``allreduce[bf16]``) where its message starts with that collective's (a timeout,
    a peer gone or aborted: ``all_to_all_single (seq 3) on rank 0: ...`` becomes
    ``allreduce[bf16] (seq 3) on rank 0: ...``; on the engine ``all_to_all_single: rank 0 <->
    2: ...``, ``allreduce[bf16]: rank 0 <-> 2: ...``), renamed in place as
    :meth:`.p2p.Ctx.name_failure` names a call (its type and attributes kept; each is made
    for the call that met it). Any other error is returned as it is."""
    text = error.args[0] if error.args and isinstance(error.args[0], str) else None
    m = _INTERNAL.match(text) if text is not None else None
    if m is not None:
        error.args = (f"{call}{m.group(2)}{text[m.end():]}",) + error.args[1:]
    return error


@contextlib.contextmanager
def calling(call: str):
    """Inside, this thread's collectives are parts of the user's call ``call``: one it gives
    up on (:func:`abandon`) is named ``call`` in its error and in the reason its peers read."""
    outer = getattr(_CALLING, "name", None)
    _CALLING.name = call
    try:
        yield
    finally:
        _CALLING.name = outer


def abandon(backend: Backend, exc: BaseException) -> None:
    """This rank gave up on a collective (``exc``: its deadline passed): abort ``backend``,
    so that no peer completes the call without it. Its messages are already on their way (a
    header, data): a late peer would otherwise take them for a live call and return a result
    built from an abandoned one, while this rank raised. Its peers' calls, the late one's
    included, raise PeerAbortedError naming this rank and the call; its own later calls
    PeerClosedError (as after ``abort``). On a subgroup, the subgroup alone ends
    (:meth:`~ferro_backend.SubBackend.abort_group`: its members' calls on it raise
    PeerAbortedError, the parent and other groups go on, as torch's groups end one at a time).
    Nothing if ``exc`` is no collective's timeout."""
    if not isinstance(exc, CollectiveTimeoutError) or backend is None:
        return
    call = getattr(_CALLING, "name", None)
    if call is not None:  # (a compressed call's collective: the user's call, to the peers too)
        in_call(exc, call)
    try:
        if isinstance(backend, SubBackend):
            backend.abort_group(f"it gave up on a collective: {exc}")
        else:
            backend.abort(f"it gave up on a collective: {exc}")
    except Exception:  # (the timeout is the error to raise; a failed abort adds nothing)
        pass


def abandoning(job: Callable[[], Any], backend: Backend) -> Callable[[], Any]:
    """``job`` (a collective on ``backend``, run later: a background call's), which ends
    ``backend`` (:func:`abandon`) where it raises a collective's timeout."""
    def run():
        try:
            return job()
        except CollectiveTimeoutError as exc:
            abandon(backend, exc)
            raise

    return run


def submit(coll: Collective, tensor, backend, arg=None, timeout=None, algorithm=None,
           out=None) -> Work:
    """One call of ``coll``, in the background (its place in the order of calls taken now)."""
    try:
        plan = _prepare(coll, tensor, backend, arg, timeout, algorithm, out)
    except Exception as exc:
        raise user_facing(exc)  # noqa: B904 (the same error, its traceback cut here)
    job = tracing.traced_job(plan.name, abandoning(executor(plan), backend), tensor, backend,
                             algorithm)
    return Work(plan.name, plan.seq, state(plan.backend).submit(job))


class Refusal(Check):
    """A call this rank refused because its arguments were wrong (``exc``): it takes the
    call's place in the order and publishes, where the call's header would be, a header saying
    so with ``exc``'s type and message (:func:`.header.refusal`); its peers' header check then
    raises :class:`~ferro_backend.CollectiveMismatchError` naming this rank and the reason, in
    the same call."""

    __slots__ = ("exc",)

    def __init__(self, name: str, backend: Backend, timeout: float | None,
                 exc: BaseException) -> None:
        super().__init__(name, backend, timeout, self._encode)
        self.exc = exc

    @classmethod
    def of(cls, name: str, backend, timeout, exc: BaseException) -> Refusal | Refused | None:
        """The refusal of a call of ``name`` on ``backend`` that raised ``exc``, or None where
        the peers could not learn of it: no backend (or one rank), a closed one (closed means
        closed: nothing is published), no header exchange (the mismatch check off without an
        engine), or a multi-node job's collective whose peers may run it flat or staged (a job
        that learned its network, a simulated one). On real nodes a collective with stages is
        refused in its whole-call check's places (:class:`.stage_check.Refused`)."""
        if not isinstance(backend, Backend) or backend.world_size < 2 or \
                backend.peer_failure(name, backend.rank) is not None:
            return None
        if group_of(backend) is None and not mismatch_check_enabled():
            return None
        h = usable_hierarchy(backend) if group_of(backend) is None else None
        staged = h is not None and name in costmodel.HIERARCHICAL
        if staged and (h.node.engine is None or costmodel.learned(backend) is not None):
            return None
        try:
            return Refused(name, backend, h, timeout, exc) if staged else \
                cls(name, backend, timeout, exc)
        except ARGUMENT_ERRORS:  # the timeout was the wrong argument: the backend's
            return Refused(name, backend, h, None, exc) if staged else \
                cls(name, backend, None, exc)

    def _encode(self, seq: int) -> bytes:
        return refusal(self.name, seq, self.exc, self.span)

    def start(self) -> None:
        """Take the call's place in the order now and publish the refusal in the background,
        so that the caller raises its own error at once, whether or not its peers ever make the
        call: on a daemon thread of its own (refusals are rare), which waits for the peers
        (their headers) at most until the call's deadline and never holds up the
        interpreter's exit. The thread is registered with the backend
        (:meth:`~ferro_backend.Backend.publish_before_close`): closing or aborting it (the
        caller's script ending on its error) first waits a short while for the refusal to go
        out, so that the peers still learn why instead of seeing this rank gone."""
        thread = threading.Thread(target=self.publish, args=(executor(self),), daemon=True,
                                  name=f"ferro-refusal-{self.name}-{self.seq}")
        thread.start()
        self.backend.publish_before_close(thread)

    @staticmethod
    def publish(run: Callable[[], Any]) -> None:
        """Run the refusal (``executor(refusal)``): the peers' error is the header check's;
        this rank's own stays the argument error its caller raises (a mismatch, a timeout or a
        closed peer here changes nothing for it)."""
        try:
            run()
        except DistributedError:
            pass


class _Execute:
    """What a hierarchical call's stages are handed (:data:`execute`)."""

    __slots__ = ()

    def __call__(self, plan: Plan) -> Any:
        """Run ``plan`` on its executor now."""
        return executor(plan)()

    @staticmethod
    def prepare(name: str, *args) -> Plan:
        """A stage's plan of collective ``name``: its record's ``prepare(*args)`` (allreduce's
        node stage is a reduce_scatter, whose module builds on allreduce's)."""
        return records.BY_NAME[name].prepare(*args)


#: ``execute(plan)`` runs a hierarchical stage's plan; ``execute.prepare(name, ...)`` makes one
execute = _Execute()


def executor(plan: Plan) -> Callable[[], Any]:
    """What runs ``plan`` (see the module docstring), chosen now; numbers the call."""
    backend = plan.backend
    if plan.seq is None:
        plan.seq = state(backend).next_seq()
    group = group_of(backend)
    if group is not None:
        return functools.partial(group.run, plan)
    if plan.stages is not None:
        h = usable_hierarchy(backend)
        if h is not None and prefer_hierarchical(plan.name, plan.header, backend, h):
            if mismatch_check_enabled():  # the whole call checked first, numbered now
                return StageSet(plan, h, execute)
            stages = plan.stages(h)  # reserves the stages' sequence numbers now, in order
            return functools.partial(stages, execute)
    return plan.run_python


def usable_hierarchy(backend) -> Any:
    """The backend's Hierarchy when it has a usable one: several nodes, an engine in each, or
    one built on a simulated network (``Hierarchy.simulated``: no engine, the node stages run
    the point-to-point algorithms over the modelled intra-node links)."""
    h = getattr(backend, "hierarchy", None)
    if h is None or (h.node.engine is None and not h.simulated):
        return None
    return h


def prefer_hierarchical(name: str, header: tuple, backend, h) -> bool:
    """Whether "auto" runs ``name`` as the hierarchy ``h``'s stages.

    Real nodes (an engine in each) always do, unless the job learned its network
    (:func:`ferro_collective.learn_network`): every rank then takes the same path whatever
    its arguments, so a mismatched call still fails as a mismatch on every rank. A job that
    learned its network, and a simulated network's
    hierarchy follows the cost model (:func:`costmodel.choose_hierarchical` on its links and
    layout; a layout the model does not describe keeps the stages): the same answer on every
    rank for the same size, world size and layout (ranks that pass different sizes may then
    take different paths and time out instead of reporting the mismatch)."""
    learned = costmodel.learned(backend)
    if h.node.engine is not None and learned is None:
        return True
    p = learned or costmodel.params_for(backend)
    if p.ranks_per_node != h.local_world or len(h.members) * h.local_world != backend.world_size:
        return True
    dtype, shape = header[0], header[1]
    nbytes = 0 if dtype is None else int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return costmodel.choose_hierarchical(name, nbytes, backend.world_size, p,
                                         engine=h.node.engine is not None)


def auto_algorithm(name: str, nbytes: int, backend) -> str:
    """What ``algorithm="auto"`` runs for a call of ``name`` on ``nbytes`` bytes on a backend
    without an engine of its own: "hierarchical" (the stages) or the flat algorithm."""
    h = usable_hierarchy(backend)
    if h is not None and name in costmodel.HIERARCHICAL and prefer_hierarchical(
            name, (np.dtype(np.uint8), (nbytes,)), backend, h):
        return "hierarchical"
    return choose(records.BY_NAME[name], "auto", nbytes, backend.world_size, backend)


__all__ = ["ARGUMENT_ERRORS", "Refusal", "auto_algorithm", "execute", "executor", "general",
           "prefer_hierarchical", "submit", "usable_hierarchy"]
