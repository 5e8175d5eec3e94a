"""ferro's errors through JAX.

An FFI call that fails returns an XLA error carrying ferro's message, marked with what failed:
``[ferro FERRO_MISMATCH] ...`` (a status of the engine's door) or ``[ferro PeerClosedError] ...``
(an exception of ferro's Python path), under an XLA error code that says the same
(DEADLINE_EXCEEDED for a timeout, UNAVAILABLE for a peer gone, FAILED_PRECONDITION for a
mismatch, INVALID_ARGUMENT, UNIMPLEMENTED...). JAX raises it as
:class:`jax.errors.JaxRuntimeError`. :func:`translate` gives ferro's own exception back
(:class:`~ferro_backend.CollectiveTimeoutError`, :class:`~ferro_backend.PeerClosedError`,
:class:`~ferro_backend.CollectiveMismatchError`, ValueError, TypeError...), the JAX error as its
``__cause__``; :func:`typed_errors` does it for a block or a function. ferro_jax's calls made
outside ``jax.jit`` raise ferro's exceptions directly.
"""

from __future__ import annotations

import builtins
import contextlib
import re
from collections.abc import Iterator

import ferro_backend.errors as _ferro_errors
from ferro_backend import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerClosedError,
)

try:
    from jax.errors import JaxRuntimeError
except ImportError:  # pragma: no cover - older jax
    from jaxlib.xla_extension import XlaRuntimeError as JaxRuntimeError

#: the door's statuses (ferro/engine.h) -> ferro's exceptions
STATUS_ERRORS: dict[str, type[BaseException]] = {
    "FERRO_TIMEOUT": CollectiveTimeoutError,
    "FERRO_FAILED": PeerClosedError,
    "FERRO_MISMATCH": CollectiveMismatchError,
    "FERRO_INVALID": ValueError,
    "FERRO_CLOSED": PeerClosedError,
    "FERRO_BUSY": RuntimeError,
    "FERRO_UNSUPPORTED": TypeError,
    "FERRO_NOMEM": MemoryError,
}
_MARK = re.compile(r"\[ferro (\w+)\] (.*)", re.S)


def _class(name: str) -> type[BaseException] | None:
    if name in STATUS_ERRORS:
        return STATUS_ERRORS[name]
    cls = getattr(_ferro_errors, name, None) or getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, BaseException):
        return cls
    return None


def translate(exc: BaseException) -> BaseException:
    """ferro's exception for a JAX error that an FFI call of ferro_jax raised.

    Parameters
    ----------
    exc : BaseException
        What JAX raised.

    Returns
    -------
    BaseException
        ferro's exception (its class and message, ``exc`` as ``__cause__``), or ``exc``
        itself where it did not come from ferro_jax.
    """
    if not isinstance(exc, (JaxRuntimeError, ValueError)):  # (a CANCELLED status: ValueError)
        return exc
    found = _MARK.search(str(exc))
    if found is None:
        return exc
    cls = _class(found.group(1))
    if cls is None:
        return exc
    message = found.group(2).strip()
    if cls is CollectiveMismatchError:
        message += differentiation_hint(message)
    try:
        typed = cls(message)
    except TypeError:  # a class whose constructor wants more: keep JAX's error
        return exc
    typed.__cause__ = exc
    return typed


_CALLED = re.compile(r"called (.+?) \(seq \d+\)")
_MARKED_DIM = re.compile(r"(?:, 1|(?<=\[)1)\]")


def differentiation_hint(message: str) -> str:
    """What to add to a mismatch's message where the ranks' calls differ only by the trailing
    dim of 1 that marks a call its rank differentiates (``_ad.py``): "" elsewhere."""
    called = _CALLED.findall(message)
    if not any(a != b and _MARKED_DIM.sub("]", a, count=1) == b for a in called for b in called):
        return ""
    return ("; the calls differ only in the trailing dim of 1 that marks a call whose rank "
            "differentiates it: JAX differentiates a call only on a rank whose input depends on "
            "the differentiated variables, and a rank that passes a constant (jnp.zeros_like(p), "
            "say) makes no derivative call; make every rank's input depend on them (x = p if "
            "rank == root else p * 0), or differentiate on every rank or on none")


@contextlib.contextmanager
def typed_errors() -> Iterator[None]:
    """Within the block (or the function it decorates), a JAX error from one of ferro_jax's
    FFI calls is raised as ferro's exception (:func:`translate`): ``with
    ferro_jax.typed_errors(): params, loss = step(params, batch)`` around a jitted step with
    ferro_jax calls in it.

    Yields
    ------
    None
        Nothing: the block runs as it is.
    """
    try:
        yield
    except (JaxRuntimeError, ValueError) as exc:
        typed = translate(exc)
        if typed is exc:
            raise
        _forget_failed_token()
        raise typed from exc


def _forget_failed_token() -> None:
    """Drop the runtime token of ferro's ordered effect that carries the failure: JAX would
    raise it again at every later wait on it (and once more at exit); the communicator refuses
    later calls by itself (a timeout or a dead peer breaks it)."""
    try:
        from jax._src import dispatch

        from ._primitive import EFFECT

        dispatch.runtime_tokens.current_tokens.pop(EFFECT, None)
        dispatch.runtime_tokens.output_runtime_tokens.clear()
    except (ImportError, AttributeError):  # pragma: no cover - jax's internals moved
        pass


__all__ = ["STATUS_ERRORS", "JaxRuntimeError", "translate", "typed_errors"]
