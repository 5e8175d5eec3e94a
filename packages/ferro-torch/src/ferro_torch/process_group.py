"""``ProcessGroupFerro``, torch's ProcessGroup on a ferro transport, and how torch makes one.

The group's operations live in ``_collectives.py`` (torch's collectives on ferro-collective)
and ``_point_to_point.py`` (send/recv); this module adds its identity and lifetime, and
:func:`create_process_group`, the creator torch calls for backend "ferro": the default group
builds the job's transport, and a subgroup of it shares that transport.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ferro_backend import Backend, CollectiveTimeoutError, PeerClosedError, SubBackend
from ferro_backend.engine import attach_engine

from . import _compiled
from ._collectives import Collectives
from ._connect import connect
from ._device_backend import DeviceBackend
from ._group_core import _OPEN
from ._point_to_point import TAG_LIMIT, PointToPoint
from .errors import as_torch_error


class ProcessGroupFerro(Collectives, PointToPoint, DeviceBackend):
    """A torch ProcessGroup whose operations run on a ferro :class:`~ferro_backend.Backend`.

    Made by ``torch.distributed.init_process_group("ferro")`` / ``new_group(backend="ferro")``
    through :func:`ferro_torch.create_process_group`, not by hand.

    Parameters
    ----------
    backend : ferro_backend.Backend
        The ferro transport the group's operations run on (its rank and size are the group's).
    group_name : str
        torch's name of the group (``DeviceMesh`` resolves groups by it).
    owns_transport : bool
        Whether shutting the group down closes ``backend`` (False for a
        :class:`~ferro_backend.SubBackend` of the default group's transport).
    """

    # -- identity ---------------------------------------------------------------------------
    @property
    def ferro_backend(self) -> Backend:
        """The ferro transport (a ShmBackend/TcpBackend, or a SubBackend of the world's)."""
        return self._b

    @property
    def group_name(self) -> str:
        """The group's name as torch knows it (``torch.distributed``'s group name)."""
        # torch sets the name on the C++ backends it registers, which a Python group has
        # none of; DeviceMesh resolves groups by this name.
        return self._name

    def getBackendName(self) -> str:
        """``"ferro"``: the backend's name, as torch's ``get_backend`` reports it."""
        return "ferro"

    def __repr__(self) -> str:
        return (f"<ProcessGroupFerro {self._name!r} rank={self.rank()} size={self.size()} "
                f"{type(self._b).__name__}>")

    # -- lifetime -----------------------------------------------------------------------------
    def _stop(self, end_transport: Callable[[], None]) -> None:
        """Once: stop the worker, then (when this group owns the transport) end it."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        self._runner.stop()
        # a receive still pending ends now, not at its deadline (a subgroup's transport goes
        # on: nothing else would end it)
        ended = PeerClosedError(f"ferro recv: process group {self._name!r} was destroyed while "
                                "this receive was pending")
        for work in list(self._receives):
            work._request.cancel(ended)
        if self._owns:
            _forget_root(self)
            end_transport()

    def _abandon(self, reason: str) -> None:
        """The compiled backend gave up on a collective (its deadline passed): as ferro's own
        collectives do (``ferro_collective.executors.abandon``), abort the transport (every
        peer's call, a late one's included, raises instead of completing the call with this
        rank's messages already sent) or, on a subgroup, close the view."""
        from ferro_collective.executors import abandon

        abandon(self._b, CollectiveTimeoutError(reason))

    def shutdown(self) -> None:
        """Stop the worker; close the transport if this group owns it."""
        self._stop(self._b.close)

    def abort(self) -> None:
        """Abort: every peer's pending operations fail (with ferro's PeerAbortedError)."""
        self._stop(lambda: self._b.abort("torch.distributed aborted the process group"))


#: the world's ferro group, if any (a subgroup of it is a SubBackend of its transport)
_root: weakref.ref | None = None
_root_lock = threading.Lock()


def _forget_root(pg: ProcessGroupFerro) -> None:
    global _root
    with _root_lock:
        if _root is not None and _root() is pg:
            _root = None


def _world_group() -> ProcessGroupFerro | None:
    """The default group's Python group when it is a live ferro group (on either backend)."""
    with _root_lock:
        pg = _root() if _root is not None else None
    if pg is None or pg._closed:
        return None
    try:
        if python_group(dist.group.WORLD) is not pg:
            return None
    except Exception:
        return None
    return pg


_CPU = torch.device("cpu")


def compiled_backend(group):
    """``group``'s compiled backend (torch's CPU backend of a ferro group that runs on the
    compiled one), else None."""
    if group is None or isinstance(group, ProcessGroupFerro):
        return None
    try:
        backend = group._get_backend(_CPU)
    except (RuntimeError, AttributeError):
        return None
    return backend if type(backend).__name__ == "FerroBackend" else None


def python_group(group) -> ProcessGroupFerro | None:
    """The :class:`ProcessGroupFerro` of a ferro group: the group itself on the Python backend,
    the one under its compiled backend; None for any other group."""
    if isinstance(group, ProcessGroupFerro):
        return group
    backend = compiled_backend(group)
    return None if backend is None else backend.python_group


def create_process_group(opts, backend_options=None):
    """torch's creator for backend "ferro" (``register_backend(..., extended_api=True)``).

    The default group builds the job's ferro transport through torch's store; a subgroup of a
    ferro default group is a :class:`~ferro_backend.SubBackend` of it (no new connections); a
    ferro group under another default backend builds a transport of its own.

    Parameters
    ----------
    opts : torch.distributed.Backend.Options
        torch's options of the new group (``store``, ``group_rank``, ``group_size``,
        ``timeout``, ``group_id``, ``global_ranks_in_group``).
    backend_options : object, optional
        The ``pg_options`` given to ``init_process_group``/``new_group``; ignored.

    Returns
    -------
    FerroProcessGroup or ProcessGroupFerro
        torch's group (a ``c10d::ProcessGroup`` named "ferro") with the compiled backend (a
        ``c10d::Backend``) as its CPU backend where the group's transport has the same-host
        engine and the backend builds (``FERRO_TORCH_BACKEND``), else the Python group.

    Raises
    ------
    FerroTorchError
        The ranks could not join the group (the ferro error, e.g. ``RendezvousError``, is its
        ``__cause__``).
    RuntimeError
        torch's and ferro's rank numbering of a subgroup disagree.

    Examples
    --------
    >>> import torch.distributed as dist
    >>> import ferro_torch  # registers "ferro", whose creator this is
    >>> dist.init_process_group("ferro")  # under ferrorun or torchrun
    >>> sub = dist.new_group([0, 1], backend="ferro")
    """
    global _root
    timeout = opts.timeout.total_seconds() if isinstance(opts.timeout, timedelta) else float(
        opts.timeout)
    ranks = list(opts.global_ranks_in_group)
    world = _world_group() if ranks else None
    if world is not None and all(0 <= r < world.size() for r in ranks):
        sub = SubBackend(world.ferro_backend, ranks, name=str(opts.group_id))
        sub.timeout = timeout
        if sub.rank != opts.group_rank or sub.world_size != opts.group_size:
            raise RuntimeError(f"ferro new_group: torch made this rank {opts.group_rank} of "
                               f"{opts.group_size}, ferro {sub.rank} of {sub.world_size}")
        pg = ProcessGroupFerro(sub, opts.group_id, owns_transport=False)
        if (len(ranks) > 1 and _same_host_engine(world.ferro_backend)
                and _compiled.choice() != "python" and _compiled.module() is not None):
            # a subgroup of a same-host job: an engine of its own (collective over its
            # members, who all run this), and the compiled backend on it
            try:
                attach_engine(sub)
            except BaseException as exc:
                raise as_torch_error(exc, f"ferro new_group: rank {opts.group_rank} of "
                                          f"{opts.group_size} could not set up its engine") from exc
        return _backend_of(pg, timeout, opts.store)
    try:
        transport = connect(opts.store, opts.group_rank, opts.group_size, timeout)
    except BaseException as exc:
        raise as_torch_error(exc, f"ferro: rank {opts.group_rank} of {opts.group_size} could "
                                  "not join the group") from exc
    pg = ProcessGroupFerro(transport, opts.group_id, owns_transport=True)
    if not ranks:
        with _root_lock:
            _root = weakref.ref(pg)
    return _backend_of(pg, timeout, opts.store)


def _same_host_engine(transport: Backend) -> bool:
    return getattr(transport, "engine", None) is not None


def _backend_of(pg: ProcessGroupFerro, timeout: float, store):
    """What torch gets for ``pg``: torch's group on the compiled backend on its engine where
    there is one and it builds (``FERRO_TORCH_BACKEND``), else ``pg`` itself (the Python
    backend). A transport
    without the engine (TCP across hosts, a group of one rank) runs on the Python backend
    whatever the setting says: the compiled backend is the engine's."""
    group = None
    if _compiled.choice() != "python" and _same_host_engine(pg.ferro_backend):
        group = _compiled.make(pg, timeout, store)
    _same_kind_everywhere(store, pg.rank(), pg.size(), "python" if group is None else "compiled")
    return pg if group is None else group


def _same_kind_everywhere(store, rank: int, size: int, kind: str) -> None:
    """Every rank of a group runs it on the same kind of backend (the compiled backend's
    messages travel on the door's rings, the Python backend's on its own): a rank where the
    compiled backend did not build, among ranks where it did, is an error here, naming them,
    not a message that never arrives."""
    if size == 1:
        return
    store.set(f"ferro_torch/kind/{rank}", kind)
    kinds = {r: store.get(f"ferro_torch/kind/{r}").decode() for r in range(size)}
    if len(set(kinds.values())) > 1:
        # every rank sees the same keys and raises; the store's host (rank 0) last: the others
        # say they are done with the store first, so none is left waiting on a store that is
        # gone when rank 0's process ends
        store.set(f"ferro_torch/kind_done/{rank}", "1")
        if rank == 0:
            store.wait([f"ferro_torch/kind_done/{r}" for r in range(size)])
        by_kind: dict[str, list[int]] = {}
        for r, k in kinds.items():
            by_kind.setdefault(k, []).append(r)
        raise RuntimeError("ferro: the ranks of a group run different backends ("
                           + "; ".join(f"{k}: ranks {v}" for k, v in sorted(by_kind.items()))
                           + "); set FERRO_TORCH_BACKEND alike on every rank (a rank falls "
                           "back to python where the compiled backend does not build)")


def backend_kind(group=None) -> str:
    """Which backend runs ``group`` (default: the default group): ``"compiled"`` (the C++
    c10d backend on ferro's engine) or ``"python"`` (:class:`ProcessGroupFerro`). With no
    default group yet: the kind a same-host group would get now (building the compiled backend
    if ``FERRO_TORCH_BACKEND`` allows and it is not built yet).

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        A group of backend "ferro" (default: the default group).

    Returns
    -------
    str
        ``"compiled"`` or ``"python"``.

    Raises
    ------
    TypeError
        ``group`` is not a ferro group.
    """
    if group is None and not dist.is_initialized():
        return "compiled" if _compiled.module() is not None else "python"
    pg = dist.group.WORLD if group is None else group
    if compiled_backend(pg) is not None:
        return "compiled"
    if isinstance(pg, ProcessGroupFerro):
        return "python"
    raise TypeError(f"backend_kind: {pg!r} is not a 'ferro' process group")


_torch_monitored_barrier = dist.monitored_barrier


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """``torch.distributed.monitored_barrier`` for ferro groups (and any other group).

    torch's function refuses every backend but one by its name ("monitored_barrier is only
    implemented for GLOO backend"); this is the same function without that check: on a ferro
    group (default: the default group) it runs the group's ``monitored_barrier`` (gloo's
    behaviour: rank 0 names the ranks that did not arrive within ``timeout``, all of them with
    ``wait_all_ranks``), on any other group it calls torch's. A rank outside ``group`` returns.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        Default: the default group.
    timeout : datetime.timedelta or float, optional
        Seconds (or a timedelta) rank 0 waits for the others (default: the group's timeout).
    wait_all_ranks : bool, default False
        Name every rank that did not arrive, not only the first.

    Returns
    -------
    None

    Raises
    ------
    FerroTorchError
        A rank did not arrive within ``timeout`` (on rank 0), or rank 0 did not release this
        rank (on the others).
    """
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return
    pg = python_group(dist.group.WORLD if group is None else group)
    if pg is None:
        return _torch_monitored_barrier(group, timeout, wait_all_ranks)
    if isinstance(timeout, int | float):
        timeout = timedelta(seconds=timeout)
    return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


__all__ = ["TAG_LIMIT", "ProcessGroupFerro", "backend_kind", "compiled_backend",
           "create_process_group", "monitored_barrier", "python_group"]
