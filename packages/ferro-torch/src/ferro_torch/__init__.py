"""ferro-torch: the torch.distributed backend "ferro" (CPU tensors over ferro's transports).

``import ferro_torch`` registers it; then ``torch.distributed.init_process_group("ferro")``
under ferrorun or torchrun runs torch's collectives, DDP and FSDP2 on ferro: on the compiled
backend (C++, built against the installed torch at first use) where the group's ranks share a
host and it builds, else on the Python backend (:func:`backend_kind` says which).
"""


import torch.distributed as _dist

from ferro_backend._version import version_getattr

from .errors import FerroTorchError
from .process_group import (
    ProcessGroupFerro,
    backend_kind,
    create_process_group,
    monitored_barrier,
    python_group,
)

#: the name the backend is registered under
BACKEND_NAME = "ferro"


def _register() -> None:
    if BACKEND_NAME.upper() in _dist.Backend._plugins:  # imported again (e.g. reloaded)
        return
    _dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                   devices=["cpu"])


def ferro_backend(group=None):
    """The ferro transport (a :class:`ferro_backend.Backend`) under ``group`` (default: the
    default group), to run ferro's own collectives next to torch's on the same ranks.
    TypeError if the group is not a ferro group.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        A ferro group (default: the default group).

    Returns
    -------
    ferro_backend.Backend

    Raises
    ------
    TypeError
        ``group`` is not a ferro group.

    Examples
    --------
    >>> from ferro_collective import allreduce
    >>> allreduce(np.ones(4), ferro_backend())  # on the default group's ranks
    """
    pg = _dist.group.WORLD if group is None else group
    py = python_group(pg)
    if py is None:
        raise TypeError(f"ferro_backend: {pg!r} is not a 'ferro' process group")
    return py.ferro_backend


_register()

__all__ = [
    "BACKEND_NAME",
    "FerroTorchError",
    "ProcessGroupFerro",
    "backend_kind",
    "create_process_group",
    "ferro_backend",
    "monitored_barrier",
]


__getattr__ = version_getattr(__name__, "ferro-torch")  # __version__, read when asked
