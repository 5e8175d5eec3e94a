"""The handlers' library, built at first use and cached.

``_handlers.cc`` is compiled with the C++ compiler (``$CXX``, else ``g++``/``c++``) against the
installed jaxlib's FFI headers (:func:`jax.ffi.include_dir`) and ferro-backend's engine header
(:func:`ferro_backend.get_include`), into a cache directory keyed by everything the binary
depends on: jax and jaxlib versions, the door's ABI, the source and the compiler command. Every
rank of a job may build at once: one builds under a file lock, the others wait for it and load
its result; the library is written to a temporary name and renamed into place, so a reader never
sees half a file. Cache directory: :func:`set_cache_dir`'s, else ``$XDG_CACHE_HOME/ferro-jax``,
else ``~/.cache/ferro-jax``.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jaxlib

import ferro_backend
from ferro_backend.engine import ABI_VERSION

SOURCE = Path(__file__).with_name("_handlers.cc")
LIBRARY = "ferro_jax_ffi.so"
FLAGS = ["-O2", "-std=c++17", "-shared", "-fPIC", "-Wall"]


class BuildError(RuntimeError):
    """The handlers could not be compiled (no C++ compiler, or it failed): the message has the
    command and the compiler's output."""


_cache_dir: Path | None = None


def set_cache_dir(path: str | os.PathLike | None) -> None:
    """Build and look for the handlers' library under ``path`` (before the first call).

    Parameters
    ----------
    path : str or os.PathLike or None
        A directory (made if missing); None: the default, ``$XDG_CACHE_HOME/ferro-jax`` or
        ``~/.cache/ferro-jax``.
    """
    global _cache_dir
    _cache_dir = None if path is None else Path(path)


def cache_root() -> Path:
    if _cache_dir is not None:
        return _cache_dir
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ferro-jax"


def compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)  # type: ignore[return-value]
    raise BuildError("ferro_jax: no C++ compiler found (set CXX, or install g++): the XLA FFI "
                     "handlers are compiled at first use against the installed jaxlib")


def command(out: str) -> list[str]:
    return [compiler(), *FLAGS, "-I", jax.ffi.include_dir(), "-I", ferro_backend.get_include(),
            "-o", out, str(SOURCE)]


def key() -> str:
    """What the binary depends on, hashed: a change of any rebuilds it."""
    h = hashlib.sha256()
    header = Path(ferro_backend.get_include(), "ferro", "engine.h").read_text()
    for part in (jax.__version__, jaxlib.__version__, repr(ABI_VERSION), sys.platform,
                 " ".join(command("OUT")), SOURCE.read_text(), header):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def library_path() -> Path:
    return cache_root() / f"{key()}-{LIBRARY}"


def build(timeout: float = 300.0) -> Path:
    """The library's path, compiled first if the cache has none (under a lock: one build)."""
    path = library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_suffix(".lock")
    with open(lock, "a") as held:
        deadline = time.monotonic() + timeout
        while True:  # a waiting rank gives up after timeout (a build stuck elsewhere)
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildError(f"ferro_jax: waited {timeout:g}s for another process's "
                                     f"build of {path} (lock {lock})") from None
                time.sleep(0.05)
        try:
            if path.exists():  # built by another process while this one waited
                return path
            fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=path.parent)
            os.close(fd)
            try:
                cmd = command(tmp)
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                if r.returncode != 0:
                    raise BuildError(f"ferro_jax: building the XLA FFI handlers failed "
                                     f"(exit {r.returncode}):\n{' '.join(cmd)}\n{r.stderr}")
                os.chmod(tmp, 0o755)
                os.replace(tmp, path)  # atomic: a reader sees no file or the whole one
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    return path


def load() -> ctypes.CDLL:
    """The built library, loaded, with its C functions' signatures declared."""
    lib = ctypes.CDLL(str(build()))
    lib.ferro_jax_attach.restype = ctypes.c_int64
    lib.ferro_jax_attach.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.ferro_jax_rank.argtypes = [ctypes.c_int64]
    lib.ferro_jax_world_size.argtypes = [ctypes.c_int64]
    lib.ferro_jax_set_python.argtypes = [ctypes.c_void_p]
    lib.ferro_jax_c_allreduce.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                          ctypes.c_int]
    return lib
