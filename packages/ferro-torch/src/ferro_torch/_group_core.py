"""The core every operation of a ferro process group stands on: its transport, the runner that
keeps its operations in issue order, and the argument checks they all make."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ferro_backend import Backend
from ferro_collective.background import runs_in_background

from ._convert import check_cpu
from ._work import DoneWork, FerroWork, Runner, seconds

#: this process's ferro groups not shut down: an asynchronous operation is deferred (run in a
#: thread that claims it, FERRO_BACKGROUND's auto) only while its group is the only one (with
#: two, a rank may issue an async call on one and then a call on the other while its peer does
#: the reverse: run at once, each waits for the other, where gloo completes the program)
_OPEN: weakref.WeakSet = weakref.WeakSet()


class GroupCore(dist.ProcessGroup):
    """A torch ProcessGroup over the ferro transport ``backend``: the base of
    :class:`~ferro_torch.ProcessGroupFerro`, whose operations run through :meth:`_run`."""

    def __init__(self, backend: Backend, group_name: str, *, owns_transport: bool) -> None:
        super().__init__(backend.rank, backend.world_size)
        self._b = backend
        self._name = str(group_name)
        self._owns = owns_transport
        self._runner = Runner(self._name)
        #: asynchronous collectives are deferred, to run in the thread that claims them
        #: (FERRO_BACKGROUND: auto does so when this host's ranks fill its cores, where a worker
        #: thread would time-slice the caller's core; _work.py's top)
        self._inline_async = not runs_in_background(backend, None)
        _OPEN.add(self)
        #: the Work of every synchronous operation without outputs that ran at once
        self._done = DoneWork("operation", [])
        self._closed = False
        #: the Works issued since torch's ``_start_coalescing`` (None: not coalescing)
        self._coalescing: list[FerroWork] | None = None
        #: this group's receives, while they may be pending (ended when the group ends)
        self._receives: weakref.WeakSet = weakref.WeakSet()

    def _run(self, name: str, outputs: list[torch.Tensor], opts, fn: Callable[[], None]
             ) -> FerroWork | DoneWork:
        if self._closed:
            raise RuntimeError(f"ferro {name}: process group {self._name!r} was shut down")
        synchronous = not getattr(opts, "asyncOp", True)
        if self._runner._deferred:  # run first (the group's operations keep their order)
            if len(_OPEN) == 1:
                self._runner.run_deferred()
            else:  # (an asynchronous call goes to the worker too then)
                self._runner.hand_over()
        if (synchronous and self._coalescing is None
                and self._runner.run_now(name,  # nothing pending: it ran here, now
                                         lambda: self._deadline(opts), fn)):
            # torch's wait() has nothing left to do (one shared Work where there is no output)
            return DoneWork(name, outputs) if outputs else self._done
        work = FerroWork(name, outputs, self._deadline(opts))
        if not synchronous and self._inline_async and len(_OPEN) == 1:
            # deferred: run in the thread that claims it (_work.py's top), as fast as at once
            # for DDP (its hooks ask the future at once), and no deadlock for a program that
            # sends before it waits (gloo runs it on a thread of its own meanwhile)
            return self._issued(self._runner.defer(work, fn))
        return self._issued(self._runner.submit(work, fn, inline=synchronous))

    def _deadline(self, opts) -> float:
        """An operation's deadline in seconds: its options' timeout, else the transport's."""
        return self._timeout(opts) or self._b.timeout

    def _issued(self, work: FerroWork) -> FerroWork:
        """``work``, noted as part of the coalesced block torch has open, if any."""
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    @staticmethod
    def _timeout(opts) -> float | None:
        return seconds(getattr(opts, "timeout", None))

    @staticmethod
    def _check(name: str, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            check_cpu(name, t)


__all__ = ["GroupCore"]
