"""The training state of an elastic job, kept equal on every member across membership changes.

:class:`ElasticState` sits on a :class:`ferro_backend.elastic.ElasticJob`. The training loop
calls :meth:`~ElasticState.commit` after each optimizer step and
:meth:`~ElasticState.recover` when a collective failed because a member is gone::

    try:
        job = ferro_backend.elastic.join()
    except ferro_backend.elastic.JobFinishedError:  # a replacement that came after the end
        sys.exit(0)                                # (the job succeeded: nothing to do)
    state = ElasticState(job, capture=lambda: {...arrays...}, restore=load_them)
    state.sync()                                   # every member starts from one state
                                                   # (a member lost here: as in recover)
    while state.step < total:
        try:
            train_one_step(job.backend)            # forward, backward, optimizer step
            changed = state.commit(state.step + 1) # right after the optimizer step
        except RECOVERABLE as exc:
            state.recover(exc)                     # next generation, state copied in
            changed = True
        if changed:
            rebuild_what_holds_the_old_backend(job.backend)

* ``commit`` records the completed step and asks every member, with one 4-byte allreduce,
  whether a newcomer waits; if any member saw one, all of them move to the next generation at
  this same step and the newcomer receives the state;
* ``recover`` leaves the broken generation (aborting its backend, so blocked peers wake),
  waits for the coordinator's next one and copies the state from the member with the most
  advanced step (``job.source``): the survivors continue from their memory, nobody restarts,
  no checkpoint is read. It retries while members keep failing during the change itself.

Every collective of a step must come before its optimizer step (gradients, the loss for
logging): a failure then leaves each rank's state at the step it last committed, which is what
it reports. The state is whatever ``capture()`` returns: nested dicts, lists and tuples of
numpy arrays (0-d ones too) and picklable scalars (a model's parameters, an optimizer's
``state_dict()``); namedtuples (an optimizer's ``AdamState(count, mu, nu)``) and other
subclasses come back as their own type. ``restore``
receives the copy. Arrays travel as one broadcast per dtype.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ferro_backend import CollectiveTimeoutError, PeerClosedError
from ferro_backend.elastic import ElasticJob

from .api import allreduce, broadcast
from .api_uneven import broadcast_object
from .ops import ReduceOp

#: the errors that end a generation (a member died, aborted, or went silent): ``recover``
RECOVERABLE = (PeerClosedError, CollectiveTimeoutError)


class _Slot:
    """Where an array of the captured state sits in the skeleton that travels as an object."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self):
        return (_Slot, (self.index,))


def _walk(tree: Any, is_leaf: Callable[[Any], bool], leaf: Callable[[Any], Any]) -> Any:
    """``tree`` with each leaf replaced by ``leaf(it)``, through dicts, lists and tuples."""
    if is_leaf(tree):
        return leaf(tree)
    if isinstance(tree, dict):
        items = {k: _walk(v, is_leaf, leaf) for k, v in tree.items()}
        return items if type(tree) is dict else _rebuild(tree, items)
    if isinstance(tree, (list, tuple)):
        parts = [_walk(v, is_leaf, leaf) for v in tree]
        if type(tree) is list:
            return parts
        return tuple(parts) if type(tree) is tuple else _rebuild(tree, parts)
    return tree


def _rebuild(tree: Any, parts: Any) -> Any:
    """A container of ``tree``'s own type (a namedtuple such as an optimizer's
    ``AdamState(count, mu, nu)``, another tuple, list or dict subclass) holding ``parts``."""
    kind = type(tree)
    try:
        if isinstance(tree, tuple) and hasattr(kind, "_fields"):  # a namedtuple
            return kind(*parts)
        if isinstance(tree, dict):  # (a copy keeps what the constructor needs: defaultdict)
            new = copy.copy(tree)
            new.clear()
            new.update(parts)
            return new
        return kind(parts)
    except Exception as exc:
        raise TypeError(f"ElasticState: cannot rebuild a {kind.__module__}.{kind.__qualname__} "
                        f"of the captured state from its {len(parts)} items ({exc}): capture "
                        "plain dicts, lists, tuples or namedtuples") from exc


def _split(tree: Any, arrays: list[np.ndarray]) -> Any:
    """The skeleton of ``tree`` with each array replaced by a :class:`_Slot` (appended to
    ``arrays``)."""
    def slot(a: np.ndarray) -> _Slot:
        # (ascontiguousarray makes a 0-d array 1-d: its shape is put back)
        arrays.append(np.ascontiguousarray(a).reshape(a.shape))
        return _Slot(len(arrays) - 1)

    return _walk(tree, lambda x: isinstance(x, np.ndarray), slot)


def _fill(skeleton: Any, arrays: list[np.ndarray]) -> Any:
    return _walk(skeleton, lambda x: isinstance(x, _Slot), lambda s: arrays[s.index])


class ElasticState:
    """The state every member of an elastic job holds, and the step it stands at.

    Parameters
    ----------
    job : ferro_backend.elastic.ElasticJob
        This rank's membership (``ferro_backend.elastic.join()``).
    capture : callable
        Returns the state: nested dicts/lists/tuples of numpy arrays and picklable values.
    restore : callable
        Takes such a state (copied from another member) and installs it.
    step : int
        The step this rank stands at (0 for a fresh start).
    before_join : callable, optional
        Called with the old generation's backend on every member (collectively) when the
        members have agreed to take a newcomer in, before they leave it: a sharded (FSDP) job
        saves its checkpoint there, so taking a newcomer in loses no step.

    Attributes
    ----------
    step : int
        The last step every member of the current generation completed.
    changes : list of dict
        One entry per membership change this rank lived through: ``step`` (where the new
        generation continued), ``world_size``, ``generation``, ``reason``, ``seconds`` (from
        the failure, or the agreement, to the state being in place).
    """

    def __init__(self, job: ElasticJob, capture: Callable[[], Any],
                 restore: Callable[[Any], None], *, step: int = 0,
                 before_join: Callable[[Any], None] | None = None) -> None:
        self.job = job
        self._before_join = before_join
        self._capture, self._restore = capture, restore
        # a replacement that joined a running job holds no state until the first sync
        self._has_state = not job.history or job.history[-1]["reason"] == "start"
        self.step = step if self._has_state else -1
        self.changes: list[dict[str, Any]] = []

    @property
    def backend(self):
        """The current generation's backend."""
        return self.job.backend

    def sync(self) -> None:
        """Copy the state from the generation's source (``job.source``; rank 0 of a fresh job)
        to every member. Collective over the current generation.

        A member lost during it (one of :data:`RECOVERABLE`) is handled as :meth:`recover`
        handles one during a step: this rank moves to the next generation and the state is
        copied there, so ``job.backend`` may be a new one afterwards (build what holds it
        after the first ``sync``).

        Raises
        ------
        ferro_backend.elastic.ElasticError
            The job cannot go on (fewer members than its minimum).
        """
        try:
            self._sync()
        except RECOVERABLE as exc:  # e.g. a member that died right after joining
            self._change(exc)

    def _sync(self) -> None:
        """One attempt of :meth:`sync` on the current generation."""
        backend = self.job.backend
        source = self.job.source if self.job.source is not None else 0
        arrays: list[np.ndarray] = []
        head = None
        if backend.rank == source:
            skeleton = _split(self._capture(), arrays)
            # (the dtypes themselves: their .str names bfloat16, float8 and int4 alike, '<V1')
            head = (self.step, skeleton, [(a.shape, a.dtype) for a in arrays])
        step, skeleton, specs = broadcast_object(head, backend, source)
        if backend.rank != source:
            arrays = [np.empty(shape, dt) for shape, dt in specs]
        for key in sorted({repr(dt) for _, dt in specs}):
            members = [i for i, (_, d) in enumerate(specs) if repr(d) == key]
            flat = np.empty(sum(arrays[i].size for i in members), specs[members[0]][1])
            if backend.rank == source:
                np.concatenate([arrays[i].ravel() for i in members], out=flat)
            if flat.size:
                broadcast(flat, backend, source, out=flat)
            if backend.rank != source:
                offset = 0
                for i in members:
                    n = arrays[i].size
                    arrays[i][...] = flat[offset:offset + n].reshape(arrays[i].shape)
                    offset += n
        if backend.rank != source:
            self._restore(_fill(skeleton, arrays))
        # step -1: no member held state (every one was lost): rank 0's initial state, step 0
        self.step, self._has_state = max(int(step), 0), True

    def commit(self, step: int) -> bool:
        """Record ``step`` as completed (call right after the optimizer step, before any other
        collective); True when the members agreed to take a waiting newcomer in, in which case
        every member is now in the next generation with the state in place. Collective.

        Parameters
        ----------
        step : int
            The training step just completed (a newcomer resumes after it).

        Returns
        -------
        bool
            True when a newcomer joined (the generation changed), False otherwise.
        """
        self.step = step
        flag = np.array([1 if self.job.pending() else 0], np.int32)
        if not allreduce(flag, self.job.backend, ReduceOp.MAX)[0]:
            return False
        if self._before_join is not None:
            self._before_join(self.job.backend)
        self._change(None)
        return True

    def recover(self, error: BaseException) -> None:
        """After ``error`` (one of :data:`RECOVERABLE`) ended the generation: move to the
        next one and copy the state in. Raises :class:`ferro_backend.elastic.ElasticError`
        when the job cannot go on (fewer members than its minimum).

        Parameters
        ----------
        error : BaseException
            The error that ended the generation (PeerClosedError, CollectiveTimeoutError...).
        """
        self._change(error)

    def _change(self, error: BaseException | None) -> None:
        t0 = time.perf_counter()
        reason = None if error is None else f"{type(error).__name__}: {error}"
        while True:
            self.job.rebuild(self.step if self._has_state else -1, reason)
            try:
                self._sync()
                break
            except RECOVERABLE as exc:  # another member failed during the change
                reason = f"{type(exc).__name__}: {exc}"
        last = self.job.history[-1]
        self.changes.append({"step": self.step, "world_size": self.job.world_size,
                             "generation": self.job.generation, "reason": last["reason"],
                             "seconds": time.perf_counter() - t0})


__all__ = ["RECOVERABLE", "ElasticState"]
