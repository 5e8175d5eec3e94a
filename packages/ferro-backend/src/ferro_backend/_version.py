"""``__version__`` for ferro's packages, read from the installed metadata when first asked for:
importing importlib.metadata costs every process that imports a package about 60 ms."""

from __future__ import annotations

import sys
from collections.abc import Callable


def version_getattr(module: str, dist: str) -> Callable[[str], str]:
    """A module-level ``__getattr__`` for ``module`` (its ``__name__``) giving ``__version__``,
    the version of the installed distribution ``dist``."""

    def __getattr__(name: str) -> str:
        if name == "__version__":
            from importlib.metadata import version

            value = version(dist)
            sys.modules[module].__version__ = value
            return value
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
