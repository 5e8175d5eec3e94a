"""ferro_jax's public calls on jax arrays, inside and outside ``jax.jit``.

Every call binds the ``ferro`` primitive (:mod:`._primitive`); outside jit it runs at once and
waits for its result (so it is done before the next Python statement, as ferro's numpy calls
are, and its errors are ferro's own exceptions).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core

import ferro_backend
from ferro_backend import USER_TAG_LIMIT, InvalidRankError

from . import _lib, errors
from ._primitive import SIDE_ONLY, bind

_default: Any = None
_OP_NAMES = {"sum": "sum", "add": "sum", "mean": "mean", "avg": "mean", "average": "mean",
             "max": "max", "min": "min", "prod": "prod", "product": "prod", "band": "band",
             "bor": "bor", "bxor": "bxor"}


def init(backend: Any = None, **kwargs: Any) -> Any:
    """Join the job and make its backend the default of every ferro_jax call.

    Without ``backend``: :func:`ferro_backend.init_from_env` (``kwargs`` passed on) finds the
    launcher (ferrorun, torchrun, mpirun, srun; alone: one rank) and returns its backend: a
    ShmBackend on one host, whose engine's door the calls inside jit use. With ``backend``:
    that one. Where it replaces an earlier default (after its ``close()``, say), JAX's caches
    are cleared: functions jitted before trace their calls again, for this backend. Where
    ``jax.distributed`` was initialized too, ferro's rank must be JAX's process index (the
    same numbering): RuntimeError otherwise. The handlers are built (or loaded from the cache)
    here.

    Parameters
    ----------
    backend : ferro_backend.Backend, optional
        The backend to use (default: join the launcher's job).
    **kwargs
        Passed to :func:`ferro_backend.init_from_env`.

    Returns
    -------
    ferro_backend.Backend
        The default backend of every call from now on.
    """
    global _default
    if backend is None:
        backend = ferro_backend.init_from_env(**kwargs)
    _check_numbering(backend)
    _lib.comm_for(backend)
    if _default is not None and backend is not _default:
        # a function jitted before traced its calls for the old backend (its communicator is
        # in the compiled call, and JAX caches it by the function and its inputs alone): it
        # is traced again, for this one
        jax.clear_caches()
    _default = backend
    return backend


def _check_numbering(backend: Any) -> None:
    try:
        from jax._src import distributed

        client = distributed.global_state.client
    except (ImportError, AttributeError):  # pragma: no cover - jax's internals moved
        return
    if client is None:
        return
    index, count = jax.process_index(), jax.process_count()
    if (index, count) != (backend.rank, backend.world_size):
        raise RuntimeError(f"ferro_jax.init: ferro's rank {backend.rank} of "
                           f"{backend.world_size} is not jax.distributed's process {index} of "
                           f"{count}: start both from the same launcher variables")


def default_backend() -> Any:
    """The backend :func:`init` made.

    Returns
    -------
    ferro_backend.Backend or None
        None before :func:`init`.
    """
    return _default


def comm(backend: Any = None) -> _lib.Comm:
    """``backend`` as the calls see it: its rank, size and whether the door runs its calls.

    Parameters
    ----------
    backend : ferro_backend.Backend, optional
        Default: :func:`init`'s.

    Returns
    -------
    ferro_jax._lib.Comm
        Its ``door`` is True where the engine's door runs the collectives inside jit.
    """
    backend = _default if backend is None else backend
    if backend is None:
        raise RuntimeError("ferro_jax: call ferro_jax.init() first, or pass backend=")
    return _lib.comm_for(backend)


def _op(op: Any, dtype: Any, what: str) -> str:
    name = _OP_NAMES.get(str(getattr(op, "value", op)).lower())
    if name is None:
        raise ValueError(f"ferro_jax.{what}: unknown op {op!r} (sum, mean, max, min, prod, "
                         "band, bor, bxor)")
    dt = np.dtype(dtype)
    if dt == np.bool_:
        name = {"max": "bor", "min": "band"}.get(name, name)
        if name not in ("band", "bor", "bxor"):
            raise TypeError(f"ferro_jax.{what}: op {op!r} on bool (band, bor, bxor, max, min)")
    elif name in ("band", "bor", "bxor") and dt.kind not in "iu":
        raise TypeError(f"ferro_jax.{what}: bitwise op {op!r} on {dt} (integers and bool only)")
    elif name == "mean" and not jnp.issubdtype(dt, jnp.inexact):
        raise TypeError(f"ferro_jax.{what}: op 'mean' on {dt} (float and complex only)")
    elif dt.kind == "c" and name not in ("sum", "mean"):
        raise TypeError(f"ferro_jax.{what}: op {op!r} on {dt} (sum and mean only)")
    return name


def _rank(value: int, c: _lib.Comm, what: str, self_ok: bool = True) -> int:
    value = int(value)
    if not 0 <= value < c.world_size or (not self_ok and value == c.rank):
        raise InvalidRankError(f"ferro_jax.{what}: rank {value} is not a peer of rank {c.rank} "
                               f"of {c.world_size}")
    return value


def _tag(tag: int, what: str) -> int:
    if not 0 <= int(tag) < USER_TAG_LIMIT:
        raise ValueError(f"ferro_jax.{what}: tag {tag} not in [0, 2**31)")
    return int(tag)


def _timeout(timeout: float | None) -> float:
    if timeout is None:
        return 0.0
    if not timeout > 0:
        raise ValueError(f"ferro_jax: timeout {timeout!r} is not a positive number of seconds")
    return float(timeout)


def _run(kind: str, args: tuple, token: Any, **params: Any) -> Any:
    """Bind one call; the user's token (if any) orders its inputs after it and is returned
    after its outputs; outside jit, wait for the result (ferro's exceptions). barrier and send
    return None (their internal done flag is what a call outside jit waits for, and what a
    returned token is tied to)."""
    if token is not None:
        args, token = lax.optimization_barrier((args, token))
    with errors.typed_errors():  # outside jit, the call runs (and fails) here
        outs = bind(*args, kind=kind, **params)
        if not isinstance(outs[0], core.Tracer):
            jax.block_until_ready(outs)
    if token is not None:
        outs[0], token = lax.optimization_barrier((outs[0], token))
    result = None if kind in SIDE_ONLY else outs[0]
    return result if token is None else (result, token)
