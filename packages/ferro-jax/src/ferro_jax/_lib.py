"""The handlers' library in this process: loaded once (built first if need be, :mod:`._build`),
its three FFI targets registered with XLA, and the communicators it knows (:class:`Comm`)."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import jax

from . import _build, _pypath

#: the FFI targets (ferro_jax/_handlers.cc)
DOOR, BARRIER, PYTHON = "ferro_jax_door", "ferro_jax_barrier", "ferro_jax_py"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_comms: dict[int, Comm] = {}
_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_pointer.restype, _pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def library() -> ctypes.CDLL:
    """The loaded library (built, loaded and registered with XLA on the first call)."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            lib = _build.load()
            for name in (DOOR, BARRIER, PYTHON):
                jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)),
                                            platform="cpu")
            lib.ferro_jax_set_python(ctypes.cast(_pypath.TRAMPOLINE, ctypes.c_void_p))
            lib.ferro_jax_set_abandon(ctypes.cast(_ABANDON, ctypes.c_void_p))
            _lib = lib
    return _lib


def _abandon(slot: int, message: bytes) -> None:
    """A door collective of ``slot`` timed out (the handler calls this from XLA's thread): as
    ferro's own collectives do (``ferro_collective.executors.abandon``), abort its backend, so
    that no peer completes the call with this rank's messages already sent."""
    try:
        from ferro_backend import CollectiveTimeoutError
        from ferro_collective.executors import abandon

        for comm in list(_comms.values()):
            if comm.slot == slot:
                abandon(comm.backend, CollectiveTimeoutError(message.decode(errors="replace")))
                return
    except Exception:  # (the timeout is the error the call raises)
        pass


_ABANDON = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_char_p)(_abandon)


class Comm:
    """One backend as ferro_jax's calls see it: its rank and size, and the slot of its engine's
    communicator in the library (None: no engine, every call takes the Python path). Hashed by
    identity: a jitted function traced for one backend is compiled for it."""

    __slots__ = ("backend", "slot", "rank", "world_size", "__weakref__")

    def __init__(self, backend: Any, slot: int | None) -> None:
        self.backend, self.slot = backend, slot
        self.rank, self.world_size = backend.rank, backend.world_size

    @property
    def door(self) -> bool:
        return self.slot is not None

    def __repr__(self) -> str:
        path = f"engine slot {self.slot}" if self.door else "Python path"
        return (f"<ferro_jax.Comm {type(self.backend).__name__} rank {self.rank} of "
                f"{self.world_size}, {path}>")


def bound_cores(backend: Any) -> list[int]:
    """The cores ferro bound this rank's thread to (``FERRO_SHM_BIND``), where this thread is
    the one it bound; empty otherwise."""
    engine = getattr(backend, "engine", None)
    cores = engine.bound_cores() if hasattr(engine, "bound_cores") else None
    return sorted(cores) if cores else []


def pin_xla_threads(backend: Any, lib: ctypes.CDLL) -> None:
    """Where ferro bound this rank to cores of its own, every XLA thread that runs one of the
    handlers takes them too (``_handlers.cc``: the engine's waits spin there, and XLA's threads
    made before the binding could run on the peer's core)."""
    cores = bound_cores(backend)
    if cores:
        lib.ferro_jax_pin_threads((ctypes.c_int * len(cores))(*cores), len(cores))


def comm_for(backend: Any, door: bool = True) -> Comm:
    """``backend``'s :class:`Comm`, made on first use: its engine's communicator is attached to
    the library (a reference held for the life of the process, since compiled executables name
    its slot) where it has one and ``door``."""
    key = (id(backend), door)
    comm = _comms.get(key)  # type: ignore[call-overload]
    if comm is not None:
        return comm
    lib = library()
    slot = None
    if door and getattr(backend, "engine", None) is not None:
        from ferro_backend.engine import CAPSULE_NAME, comm_capsule

        capsule = comm_capsule(backend)
        why = ctypes.create_string_buffer(512)
        slot = lib.ferro_jax_attach(_pointer(capsule, CAPSULE_NAME.encode()), why, 512)
        if slot < 0:
            raise RuntimeError(why.value.decode(errors="replace"))
        pin_xla_threads(backend, lib)
    comm = _comms[key] = Comm(backend, slot)  # type: ignore[index]
    return comm
