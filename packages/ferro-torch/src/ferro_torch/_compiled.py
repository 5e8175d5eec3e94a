"""The compiled backend: ``csrc/`` built against the installed torch at first use, and the
choice between it and the Python backend.

Built with ``torch.utils.cpp_extension.load`` (JIT) the first time a process needs it, into
torch's extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``),
under a name that encodes the torch version, the door's ABI and a hash of the sources and of
ferro's engine headers, so a cache built from other sources, another torch or another door is
never loaded; later processes load it from the cache in well under a second. torch's own file
lock in the build directory makes the ranks of a job that start at once build it once (the
first builds, the others wait and load).

Why at first use and not at install time: ferro-torch installs as pure Python against whatever
torch the environment has (and may get later); a C++ extension built at install time is bound
to the C++ ABI of the torch present then, and silently breaks (or refuses to import) when torch
is upgraded. Built at first use it always matches the torch that is imported.

``FERRO_TORCH_BACKEND`` (``auto``, ``compiled`` or ``python``) chooses: ``auto`` builds and
uses the compiled backend where it can and otherwise warns once (one line naming why) and runs
the Python backend; ``compiled`` raises where it cannot build; ``python`` never builds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed

import ferro_backend
from ferro_backend import settings

from .errors import FerroTorchError

#: the C++ sources of the backend: its parts, built as one translation unit (UNIT includes
#: them in this order: torch's headers are parsed once)
CSRC = Path(__file__).with_name("csrc")
SOURCES = ("work.cpp", "backend.cpp", "collectives.cpp", "p2p.cpp", "python.cpp")
UNIT = "ferro_c10d.cpp"
HEADERS = ("ferro_c10d.hpp",)
#: the oldest torch the sources build against (tried: 2.7 lacks the options' asyncOp, 2.8
#: Backend's getBackendOptions and setTimeout; 2.9.1 builds and passes)
OLDEST_TORCH = (2, 9)

BACKEND = settings.Setting(
    settings.PREFIX + "TORCH_BACKEND", "auto, compiled or python", "auto", "ferro-torch",
    "which torch backend \"ferro\" runs: `compiled` (the C++ c10d backend on the engine, built "
    "against the installed torch at first use; an error if it cannot build), `python` (the "
    "Python backend), `auto` (the compiled one where it builds and the group has the engine, "
    "else the Python one with one warning line)",
    settings._choice("auto", "compiled", "python"))

_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None  # why the build failed (once per process)
_warned = False


class BuildError(RuntimeError):
    """The compiled backend cannot be built or loaded here (the message says why)."""


def choice() -> str:
    """``FERRO_TORCH_BACKEND``'s value: "auto", "compiled" or "python"."""
    return BACKEND.get()


def _torch_version() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def extension_name() -> str:
    """The cache name: torch's version, the door's ABI, a hash of every source and header."""
    h = hashlib.sha256()
    inc = Path(ferro_backend.get_include()) / "ferro"
    for p in [*(CSRC / s for s in (*HEADERS, *SOURCES, UNIT)), inc / "engine.h",
              inc / "engine_python.h"]:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(torch.__version__.encode())
    # the build's commands name the headers' directory: installs elsewhere build apart
    h.update(str(inc.resolve()).encode())
    tv = "".join(c if c.isalnum() else "_" for c in torch.__version__)
    major, minor = _abi()
    return f"ferro_torch_c10d_t{tv}_door{major}_{minor}_{h.hexdigest()[:12]}"


def _abi() -> tuple[int, int]:
    text = (Path(ferro_backend.get_include()) / "ferro" / "engine.h").read_text()
    found = {}
    for key in ("MAJOR", "MINOR"):
        line = next(ln for ln in text.splitlines()
                    if ln.startswith(f"#define FERRO_ENGINE_ABI_{key} "))
        found[key] = int(line.split()[-1].rstrip("uU"))
    return found["MAJOR"], found["MINOR"]


def _preflight() -> None:
    """What a build needs, checked first so that its absence is named in one line."""
    if _torch_version() < OLDEST_TORCH:
        raise BuildError(f"torch {torch.__version__} is older than "
                         f"{'.'.join(map(str, OLDEST_TORCH))}, the oldest the compiled backend "
                         "builds against")
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise BuildError(f"no C++ compiler ({cxx!r} is not on PATH; set CXX)")
    if not cpp_extension.is_ninja_available():
        raise BuildError("ninja is not installed (pip install ninja)")


def _failure_record(name: str) -> Path:
    """Where a failed build of ``name`` is recorded: beside torch's extension cache."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"{name}.failed"


def _build() -> ModuleType:
    """Build (or load from the cache) the module; BuildError naming why not. A failed build of
    these sources against this torch is recorded, and later processes under ``auto`` fall back
    at once with its reason instead of trying again (tens of seconds each, every rank of every
    job); ``FERRO_TORCH_BACKEND=compiled`` always tries again."""
    _preflight()
    from torch.utils import cpp_extension

    def load() -> ModuleType:
        return cpp_extension.load(
            name=name, sources=[str(CSRC / UNIT)],
            extra_include_paths=[ferro_backend.get_include(), str(CSRC)],
            extra_cflags=["-O2", "-fvisibility=hidden"], verbose=False)

    name = extension_name()
    _wait_for_build_lock(name)
    record = _failure_record(name)
    if choice() == "auto" and record.is_file():
        raise BuildError(f"{record.read_text().strip()} (an earlier build; delete {record}, or "
                         "set FERRO_TORCH_BACKEND=compiled, to build again)")
    try:
        try:
            built = load()
        except ImportError as exc:
            if "No such file" not in str(exc):  # it is there and does not load
                raise
            # another rank held torch's build lock and its build failed, leaving nothing to
            # import: build here (torch's versioner forgets this name), for the compiler's words
            cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
            built = load()
    except ImportError as exc:  # built, but the module does not load against this torch
        why = (f"the module built against torch {torch.__version__} does not load (a C++ ABI "
               f"mismatch?): {_first_line(exc)}")
        _record(record, why)
        raise BuildError(why) from exc
    except Exception as exc:  # the compiler's, ninja's or torch's error
        why = f"building it against torch {torch.__version__} failed: {_first_line(exc)}"
        _record(record, why)
        raise BuildError(why) from exc
    record.unlink(missing_ok=True)
    return built


#: a build lock older than this was left by a build that was killed (one takes about a minute)
STALE_LOCK_S = 600.0


def _wait_for_build_lock(name: str) -> None:
    """Wait while another process builds ``name`` (torch's lock file in its build directory);
    a lock older than :data:`STALE_LOCK_S` was left by a killed build and is removed, with a
    warning (torch's own wait would last for ever)."""
    lock = _build_dir(name) / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:
            return  # no lock: nobody builds it
        if age > STALE_LOCK_S:
            warnings.warn(f"ferro-torch: removing the stale build lock {lock} ({age:.0f} s old: "
                          "a build was killed)", RuntimeWarning, stacklevel=3)
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.2)


def _build_dir(name: str) -> Path:
    """torch's build directory of extension ``name`` (its private helper where it has one)."""
    from torch.utils import cpp_extension

    where = getattr(cpp_extension, "_get_build_directory", None)
    if where is not None:
        return Path(where(name, verbose=False))
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / name


def _record(path: Path, why: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(why + "\n")
    except OSError:  # a read-only cache: every process tries again, as before
        pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors = [ln.strip() for ln in lines if "error:" in ln]  # the compiler's first
    return (errors[0] if errors else lines[0] if lines else type(exc).__name__)[:300]


def module() -> ModuleType | None:
    """The compiled module (built or loaded once per process), or None where
    ``FERRO_TORCH_BACKEND`` says python or (auto) it cannot be built, with one warning line
    naming why. BuildError under ``FERRO_TORCH_BACKEND=compiled``."""
    global _module, _failure
    kind = choice()
    if kind == "python":
        return None
    with _lock:
        if _module is None and _failure is None:
            try:
                _module = _build()
            except BuildError as exc:
                _failure = str(exc)
        if _module is not None:
            return _module
    if kind == "compiled":
        raise BuildError(f"ferro-torch: FERRO_TORCH_BACKEND=compiled, but the compiled backend "
                         f"is not available: {_failure}")
    fall_back(_failure)
    return None


def fall_back(why: str) -> None:
    """Warn once per process (one line) that the Python backend runs, and why."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"ferro-torch: using the Python backend: {why}", RuntimeWarning,
                      stacklevel=2)


def make(pg, timeout: float, store):
    """torch's group on the compiled backend of the Python group ``pg`` (a ProcessGroupFerro
    whose transport has the engine): a ``FerroProcessGroup`` (a ``c10d::ProcessGroup`` named
    "ferro") with a ``FerroBackend`` as its CPU backend; None (the Python backend; warned)
    where it cannot be had."""
    mod = module()
    if mod is None:
        return None
    from ferro_backend.engine import comm_capsule

    try:
        capsule = comm_capsule(pg.ferro_backend)
        # (the size of the engine's point-to-point rings: which sends fit one entry)
        ring_bytes = int(getattr(pg.ferro_backend.engine, "ring_bytes", 0) or 0)
        backend = mod.FerroBackend(capsule, pg, pg.rank(), pg.size(), timeout,
                                   pg._inline_async, ring_bytes)
    except RuntimeError as exc:  # no engine, or an engine of another door ABI
        if choice() == "compiled":
            raise FerroTorchError(f"ferro-torch: FERRO_TORCH_BACKEND=compiled, but {exc}") from exc
        fall_back(str(exc))
        return None
    # what torch does for a registered C++ backend, with a group that says "ferro"
    group = mod.FerroProcessGroup(store, pg.rank(), pg.size())
    custom = torch.distributed.ProcessGroup.BackendType.CUSTOM
    group._set_default_backend(custom)
    group._register_backend(torch.device("cpu"), custom, backend)
    return group


__all__ = ["BACKEND", "BuildError", "choice", "extension_name", "fall_back", "make", "module"]
