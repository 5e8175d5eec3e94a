"""ferro-backend: point-to-point transports for distributed training on numpy arrays."""


import os as _os

from . import (
    _wire,  # noqa: F401 - the compiled kernel, imported unconditionally: no Python fallback
    elastic,
    kernels,  # noqa: F401 - the reduction kernel, compiled on every platform
)
from ._version import version_getattr
from .base import DEFAULT_TIMEOUT, USER_TAG_LIMIT, Backend, Request
from .engine.shm import ShmBackend
from .errors import (
    AuthenticationError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistributedError,
    ForkedBackendError,
    InvalidRankError,
    InvalidWorldSizeError,
    LauncherError,
    PeerAbortedError,
    PeerClosedError,
    ProtocolError,
    RendezvousError,
    SettingError,
    SizeMismatchError,
)
from .joining.detect import Launcher, detect_launcher
from .joining.env import configure_logging, init_from_env
from .mesh.tcp import TcpBackend
from .mpi import MpiBackend
from .simulated import SimulatedBackend
from .sub import SubBackend
from .timeline import trace
from .wire import pack, packed_nbytes, unpack


def _is_ferrorun() -> bool:
    """Whether this process is ``ferrorun`` itself (the command, or ``python -m
    ferro_backend.launch``): it reports a bad ``FERRO_LOG_LEVEL`` as one line, and its
    ``--log-level`` replaces the variable's value (:mod:`.launch.ferrorun`)."""
    import sys

    argv = list(getattr(sys, "orig_argv", sys.argv))
    if _os.path.basename(sys.argv[0] if sys.argv else "") == "ferrorun":
        return True
    return any(a == "-m" and b in ("ferro_backend.launch", "ferro_backend.launch.ferrorun")
               for a, b in zip(argv, argv[1:]))


try:
    configure_logging()
except SettingError:
    if not _is_ferrorun():
        raise


def get_include() -> str:
    """The directory of ferro-backend's C headers and Cython declarations: ``ferro/engine.h``
    (the door into the same-host engine: a versioned C interface, callable without the GIL),
    ``ferro/engine_python.h`` (a communicator from the capsule
    ``ferro_backend.engine.comm_capsule()`` returns) and ``ferro/engine.pxd``; pass it to the
    compiler as ``-I``, as ``numpy.get_include()``.

    Returns
    -------
    str
        An absolute path inside the installed package.
    """
    return _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "include")


__all__ = [
    "DEFAULT_TIMEOUT",
    "USER_TAG_LIMIT",
    "AuthenticationError",
    "Backend",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DistributedError",
    "ForkedBackendError",
    "InvalidRankError",
    "InvalidWorldSizeError",
    "LauncherError",
    "Launcher",
    "MpiBackend",
    "PeerAbortedError",
    "PeerClosedError",
    "ProtocolError",
    "RendezvousError",
    "Request",
    "SettingError",
    "ShmBackend",
    "SimulatedBackend",
    "SizeMismatchError",
    "SubBackend",
    "TcpBackend",
    "detect_launcher",
    "elastic",
    "get_include",
    "init_from_env",
    "pack",
    "packed_nbytes",
    "trace",
    "unpack",
]


_version_getattr = version_getattr(__name__, "ferro-backend")  # __version__, read when asked


def __getattr__(name: str):
    """``ferro_backend.testing`` (the test kit) imported when first asked for, so that
    ``import ferro_backend`` alone pays nothing for it; ``__version__`` read when asked."""
    if name == "testing":  # (``from . import testing`` would ask this hook again: a loop)
        import importlib

        return importlib.import_module(f"{__name__}.testing")
    return _version_getattr(name)
