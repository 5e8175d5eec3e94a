"""The ``DistributedError`` family: every failure of a ferro transport or collective.

Each class also subclasses the closest builtin, so ``except TimeoutError`` or
``except ConnectionError`` keeps working for callers that do not know ferro.
Messages name the ranks, sizes, tags and addresses involved.
"""

from __future__ import annotations


class DistributedError(RuntimeError):
    """Base class of every ferro distributed error."""


class InvalidRankError(DistributedError, ValueError):
    """A rank outside ``[0, world_size)``, or a rank that is not where it must be."""


class InvalidWorldSizeError(DistributedError, ValueError):
    """A world size that the operation cannot work with (zero, too small, not divisible...)."""


class SizeMismatchError(DistributedError, ValueError):
    """A message whose length differs from the receive buffer's, or arrays of mismatched sizes."""


class CollectiveTimeoutError(DistributedError, TimeoutError):
    """A blocking call did not complete within its timeout."""


class PeerClosedError(DistributedError, ConnectionError):
    """A peer closed its end or died while this rank was talking to it. ``clean``: the peer
    closed its backend in order (often after an error of its own), rather than dying.

    Parameters
    ----------
    message : str
        The error message (names the ranks and the operation).
    peer : int, optional
        The peer's rank, kept as the ``peer`` attribute (None: not known).
    clean : bool, default False
        Kept as the ``clean`` attribute.
    """

    def __init__(self, message: str, *, peer: int | None = None, clean: bool = False) -> None:
        super().__init__(message)
        self.peer = peer
        self.clean = clean


class PeerAbortedError(PeerClosedError):
    """A peer called ``Backend.abort(reason)``: the job is failing, stop waiting.

    Parameters
    ----------
    message : str
        The error message.
    peer : int, optional
        The aborting rank, kept as the ``peer`` attribute.
    reason : str, default ""
        The ``reason`` the peer gave, kept as the ``reason`` attribute.
    """

    def __init__(self, message: str, *, peer: int | None = None, reason: str = "") -> None:
        super().__init__(message, peer=peer)
        self.reason = reason


class ForkedBackendError(PeerClosedError):
    """A backend used in a forked child of the process that made it: its sockets, shared
    memory and order of calls are the parent's, so every operation in the child raises this
    (the parent's job goes on untouched) and ``close()`` in the child drops the child's copies
    only. Make a backend in the child instead.

    Parameters
    ----------
    message : str
        The error message (names both processes).
    made_pid : int
        The process that made the backend, kept as the ``made_pid`` attribute.
    pid : int
        The forked process that used it, kept as the ``pid`` attribute.
    rank : int, optional
        The backend's rank, kept as the ``peer`` attribute.
    """

    def __init__(self, message: str, *, made_pid: int, pid: int,
                 rank: int | None = None) -> None:
        super().__init__(message, peer=rank)
        self.made_pid = made_pid
        self.pid = pid


class CollectiveMismatchError(DistributedError):
    """Ranks called different collectives, or the same one with other dtypes or shapes."""


class ProtocolError(DistributedError):
    """Bytes on the wire that do not follow the ferro protocol (bad magic, version, frame)."""


class AuthenticationError(DistributedError, PermissionError):
    """The peer does not know the job's token (or this process does not)."""


class RendezvousError(DistributedError, ConnectionError):
    """The job could not be set up: a port in use, a rank 0 that never came up, a bad table."""


class LauncherError(DistributedError):
    """The launcher's environment cannot start this rank: variables that disagree (``RANK``
    vs ``SLURM_PROCID``...), a value that is not a number, or a dependency the launcher needs
    (mpi4py under mpirun) that is missing. The message names the variables it saw."""


class SettingError(LauncherError, ValueError):
    """A ``FERRO_*`` variable has a value ferro cannot use (``ferro_backend.settings``);
    the message names the variable, the value and what was expected."""
