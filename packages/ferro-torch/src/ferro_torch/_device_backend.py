"""What torch asks of a group's per-device backend, answered by a ferro group for the CPU.

torch builds a group from C++ ``Backend`` objects registered per device (``_register_backend``);
torch 2.13 has no way to write such a ``Backend`` in Python (``torch._C._distributed_c10d.Backend``
has no constructor and no Python trampoline), and a backend creator that returns a
``ProcessGroup`` subclass is taken as the whole group (``_new_process_group_helper``: "If the type
is a subclass of ProcessGroup then return this process group immediately"). So a ferro group is
its own CPU backend: ``group._device_types`` is ``[cpu]``, ``group._get_backend(cpu)`` is the
group, and what torch's Python layer calls on a backend (coalescing, ``monitored_barrier``,
``supports_*``) is here.
"""

from __future__ import annotations

import datetime

import torch

from ._group_core import GroupCore
from ._monitored import monitored_barrier
from ._work import FerroWork, all_of

CPU = torch.device("cpu")


class DeviceBackend(GroupCore):
    """The CPU backend side of :class:`~ferro_torch.ProcessGroupFerro`."""

    #: torch splits only accelerator groups (``split_group`` needs one); ferro's subgroups
    #: come from ``new_group``/``new_subgroups``, which share the world's connections
    supports_splitting = False
    #: ``_start_coalescing``/``_end_coalescing`` group the operations issued between them
    supports_coalescing = True

    @property
    def _device_types(self) -> list[torch.device]:
        return [CPU]

    def _get_backend(self, device) -> DeviceBackend:
        kind = torch.device(device).type
        if kind != "cpu":
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    # -- coalescing (torch's _coalescing_manager with a device) --------------------------------
    def _start_coalescing(self, device) -> None:
        self._get_backend(device)
        if self._coalescing is not None:
            raise RuntimeError(f"ferro _start_coalescing: group {self._name!r} is already "
                               "coalescing")
        self._coalescing = []

    def _end_coalescing(self, device) -> FerroWork:
        """One Work over every operation issued since :meth:`_start_coalescing`."""
        self._get_backend(device)
        works, self._coalescing = self._coalescing, None
        if works is None:
            raise RuntimeError(f"ferro _end_coalescing: group {self._name!r} is not coalescing")
        if not works:
            done = FerroWork("coalesced", [])
            done._finish()
            return done
        return all_of("coalesced", works, self._b.timeout)

    # -- monitored_barrier ---------------------------------------------------------------------
    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False) -> None:
        """gloo's ``monitored_barrier``: rank 0 names the rank(s) that did not arrive within
        ``timeout`` (default: the group's timeout); ``wait_all_ranks`` names all of them.

        Parameters
        ----------
        timeout : datetime.timedelta or float, optional
        wait_all_ranks : bool, default False

        Raises
        ------
        FerroTorchError
            A rank did not arrive in time, or rank 0 did not release this one.
        """
        if timeout is None:
            secs = self._b.timeout
        elif isinstance(timeout, datetime.timedelta):
            secs = timeout.total_seconds()
        else:
            secs = float(timeout)
        monitored_barrier(self._b, max(secs, 0.0), wait_all_ranks)


__all__ = ["CPU", "DeviceBackend"]
