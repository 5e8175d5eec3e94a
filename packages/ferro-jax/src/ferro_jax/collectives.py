"""The calls: ferro's collectives and point-to-point messages on jax arrays.

Every rank of the backend makes the same collectives in the same order (as with
ferro_collective). Each call works inside ``jax.jit`` (an XLA FFI call, ordered after the
previous ferro_jax call of the program) and outside it (run at once). Common keywords:

backend : ferro_backend.Backend, optional
    Default: the one :func:`ferro_jax.init` made.
timeout : float, optional
    Seconds before CollectiveTimeoutError (default: the backend's timeout).
token : jax array, optional
    For programs written with tokens (as mpi4jax's): the call's inputs wait for it, and the call
    returns ``(result, token)`` with the token ready after the call. ferro_jax orders its calls
    without tokens; a token only adds this data dependency.

Errors: inside jit, JAX raises :class:`jax.errors.JaxRuntimeError` (a cancelled call, on a
closed backend: ValueError) with ferro's message (:func:`ferro_jax.typed_errors` turns it into
ferro's exception); outside jit, ferro's exception.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax._src import core

from ._api import _op, _rank, _run, _tag, _timeout, comm


def allreduce(x: Any, op: Any = "sum", *, backend: Any = None, timeout: float | None = None,
              token: Any = None) -> Any:
    """Reduce ``x`` element-wise across the ranks; every rank gets the same bits.

    ``op``: "sum", "mean", "max", "min", "prod" (floats, integers, complex: sum and mean),
    "band", "bor", "bxor" (integers and bool; max/min on bool are bor/band). float16 and
    bfloat16 are folded in float32 and rounded once, in rank order. Differentiable for sum
    and mean (the cotangent's allreduce).

    Parameters
    ----------
    x : jax.Array or array_like
        This rank's contribution.
    op : str or ferro_collective.ReduceOp, default "sum"
        The reduction.
    backend : ferro_backend.Backend, optional
        Default: the one :func:`ferro_jax.init` made.
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: the backend's timeout).
    token : jax.Array, optional
        Orders the call after the token (see the module); the call then returns a pair.

    Returns
    -------
    jax.Array or tuple
        The reduction, of ``x``'s shape and dtype, on every rank;
        ``(result, token)`` where a token was passed.
    """
    x = jnp.asarray(x)
    c = comm(backend)
    return _run("allreduce", (x,), token, comm=c, op=_op(op, x.dtype, "allreduce"),
                timeout=_timeout(timeout))


def reduce(x: Any, root: int = 0, op: Any = "sum", *, backend: Any = None,
           timeout: float | None = None, token: Any = None) -> Any:
    """The reduction of ``x`` on ``root``; zeros of ``x``'s shape on the other ranks.
    Differentiable for sum and mean (a broadcast from root).

    Parameters
    ----------
    x : jax.Array or array_like
        This rank's contribution.
    root : int, default 0
        The rank that gets the reduction.
    op : str or ferro_collective.ReduceOp, default "sum"
        The reduction.
    backend : ferro_backend.Backend, optional
        Default: the one :func:`ferro_jax.init` made.
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: the backend's timeout).
    token : jax.Array, optional
        Orders the call after the token (see the module); the call then returns a pair.

    Returns
    -------
    jax.Array or tuple
        The reduction on root, zeros elsewhere;
        ``(result, token)`` where a token was passed.
    """
    x = jnp.asarray(x)
    c = comm(backend)
    return _run("reduce", (x,), token, comm=c, op=_op(op, x.dtype, "reduce"),
                root=_rank(root, c, "reduce"), timeout=_timeout(timeout))


def reduce_scatter(x: Any, op: Any = "sum", *, backend: Any = None,
                   timeout: float | None = None, token: Any = None) -> Any:
    """Reduce ``x`` across the ranks; rank ``r`` keeps the ``r``-th of ``world_size`` equal
    slices along dim 0 (dim 0 divisible by the world size). Differentiable for sum and mean
    (an all_gather).

    Parameters
    ----------
    x : jax.Array or array_like
        This rank's contribution (dim 0 divisible by the world size).
    op : str or ferro_collective.ReduceOp, default "sum"
        The reduction.
    backend : ferro_backend.Backend, optional
        Default: the one :func:`ferro_jax.init` made.
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: the backend's timeout).
    token : jax.Array, optional
        Orders the call after the token (see the module); the call then returns a pair.

    Returns
    -------
    jax.Array or tuple
        This rank's slice of the reduction;
        ``(result, token)`` where a token was passed.
    """
    x = jnp.asarray(x)
    c = comm(backend)
    return _run("reduce_scatter", (x,), token, comm=c, op=_op(op, x.dtype, "reduce_scatter"),
                timeout=_timeout(timeout))


def all_gather(x: Any, *, backend: Any = None, timeout: float | None = None,
               token: Any = None) -> Any:
    """Every rank's ``x`` concatenated along dim 0 in rank order (a 0-d ``x``: shape
    ``(world_size,)``), as ferro_collective.all_gather. Differentiable (a reduce_scatter).

    Parameters
    ----------
    x : jax.Array or array_like
        This rank's block.
    backend : ferro_backend.Backend, optional
        Default: the one :func:`ferro_jax.init` made.
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: the backend's timeout).
    token : jax.Array, optional
        Orders the call after the token (see the module); the call then returns a pair.

    Returns
    -------
    jax.Array or tuple
        The blocks concatenated along dim 0;
        ``(result, token)`` where a token was passed.
    """
    x = jnp.asarray(x)
    return _run("all_gather", (x,), token, comm=comm(backend), timeout=_timeout(timeout))


def broadcast(x: Any, root: int = 0, *, backend: Any = None, timeout: float | None = None,
              token: Any = None) -> Any:
    """``root``'s ``x`` on every rank (the others pass an array of its shape and dtype).
    Differentiable (the cotangents summed on root): under ``jax.grad`` every rank's ``x`` must
    depend on the differentiated variables (``p * 0`` on the others, not ``jnp.zeros_like(p)``),
    or the ranks raise CollectiveMismatchError (see the README's Differentiation).

    Parameters
    ----------
    x : jax.Array or array_like
        On root the array to send; elsewhere one of its shape and dtype.
    root : int, default 0
        The rank whose ``x`` every rank returns.
    backend : ferro_backend.Backend, optional
        Default: the one :func:`ferro_jax.init` made.
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: the backend's timeout).
    token : jax.Array, optional
        Orders the call after the token (see the module); the call then returns a pair.

    Returns
    -------
    jax.Array or tuple
        ``root``'s ``x``;
        ``(result, token)`` where a token was passed.
    """
    x = jnp.asarray(x)
    c = comm(backend)
    return _run("broadcast", (x,), token, comm=c, root=_rank(root, c, "broadcast"),
                timeout=_timeout(timeout))


def all_to_all(x: Any, *, backend: Any = None, timeout: float | None = None,
               token: Any = None) -> Any:
    """Split ``x`` along dim 0 into ``world_size`` equal blocks, send block ``r`` to rank ``r``;
    the result's block ``r`` came from rank ``r``. Differentiable (its own transpose).

    Parameters
    ----------
    x : jax.Array or array_like
        ``world_size`` blocks along dim 0, block ``r`` for rank ``r``.
    backend : ferro_backend.Backend, optional
        Default: the one :func:`ferro_jax.init` made.
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: the backend's timeout).
    token : jax.Array, optional
        Orders the call after the token (see the module); the call then returns a pair.

    Returns
    -------
    jax.Array or tuple
        Block ``r`` from rank ``r``;
        ``(result, token)`` where a token was passed.
    """
    x = jnp.asarray(x)
    return _run("all_to_all", (x,), token, comm=comm(backend), timeout=_timeout(timeout))


def barrier(*, backend: Any = None, timeout: float | None = None, token: Any = None) -> Any:
    """Wait until every rank has called barrier (returns None, or ``(None, token)``).

    Parameters
    ----------
    backend : ferro_backend.Backend, optional
        Default: the one :func:`ferro_jax.init` made.
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: the backend's timeout).
    token : jax.Array, optional
        Orders the call after the token (see the module); the call then returns a pair.

    Returns
    -------
    None or tuple
        None; ``(None, token)`` where a token was passed (the token after the call).
    """
    return _run("barrier", (), token, comm=comm(backend), timeout=_timeout(timeout))


def send(x: Any, dst: int, tag: int = 0, *, backend: Any = None, token: Any = None) -> Any:
    """Send ``x`` to rank ``dst`` on stream ``tag`` (returns None, or ``(None, token)``).

    Sends never wait for the receiver. Not differentiable (use :func:`sendrecv`).

    Parameters
    ----------
    x : jax.Array or array_like
        What to send.
    dst : int
        The receiving rank.
    tag : int, default 0
        The stream the message travels on.
    backend : ferro_backend.Backend, optional
        Default: the one :func:`ferro_jax.init` made.
    token : jax.Array, optional
        Orders the call after the token (see the module); the call then returns a pair.

    Returns
    -------
    None or tuple
        None; ``(None, token)`` where a token was passed (the token after the call).
    """
    x = jnp.asarray(x)
    c = comm(backend)
    return _run("send", (x,), token, comm=c, dst=_rank(dst, c, "send", self_ok=False),
                tag=_tag(tag, "send"))


def recv(like: Any, src: int, tag: int = 0, *, backend: Any = None,
         timeout: float | None = None, token: Any = None) -> Any:
    """The next array from rank ``src`` on stream ``tag``, of ``like``'s shape and dtype
    (``like``: an array or a ``jax.ShapeDtypeStruct``; SizeMismatchError if the message's
    size differs).

    Parameters
    ----------
    like : jax.Array or jax.ShapeDtypeStruct
        The shape and dtype of the message.
    src : int
        The sending rank.
    tag : int, default 0
        The stream the message travels on.
    backend : ferro_backend.Backend, optional
        Default: the one :func:`ferro_jax.init` made.
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: the backend's timeout).
    token : jax.Array, optional
        Orders the call after the token (see the module); the call then returns a pair.

    Returns
    -------
    jax.Array or tuple
        The message;
        ``(result, token)`` where a token was passed.
    """
    c = comm(backend)
    aval = core.ShapedArray(tuple(like.shape), jnp.dtype(like.dtype))
    return _run("recv", (), token, comm=c, src=_rank(src, c, "recv", self_ok=False),
                tag=_tag(tag, "recv"), like=aval, timeout=_timeout(timeout))


def sendrecv(x: Any, dst: int, src: int, tag: int = 0, *, like: Any = None,
             backend: Any = None, timeout: float | None = None, token: Any = None) -> Any:
    """Send ``x`` to ``dst`` and receive from ``src`` at once (no deadlock in a ring of
    ranks); the received array has ``like``'s shape and dtype (default: ``x``'s).
    Differentiable where ``like`` is None: the cotangent travels back, from ``dst`` to
    ``src``.

    Parameters
    ----------
    x : jax.Array or array_like
        What to send to ``dst``.
    dst : int
        The rank ``x`` goes to.
    src : int
        The rank the result comes from.
    tag : int, default 0
        The stream both messages travel on.
    like : jax.Array or jax.ShapeDtypeStruct, optional
        The received array's shape and dtype (default: ``x``'s).
    backend : ferro_backend.Backend, optional
        Default: the one :func:`ferro_jax.init` made.
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: the backend's timeout).
    token : jax.Array, optional
        Orders the call after the token (see the module); the call then returns a pair.

    Returns
    -------
    jax.Array or tuple
        What ``src`` sent;
        ``(result, token)`` where a token was passed.
    """
    x = jnp.asarray(x)
    c = comm(backend)
    aval = None
    if like is not None:
        aval = core.ShapedArray(tuple(like.shape), jnp.dtype(like.dtype))
    return _run("sendrecv", (x,), token, comm=c, dst=_rank(dst, c, "sendrecv", self_ok=False),
                src=_rank(src, c, "sendrecv", self_ok=False), tag=_tag(tag, "sendrecv"),
                like=aval, timeout=_timeout(timeout))


def create_token() -> Any:
    """A fresh token for the calls' ``token=``.

    Returns
    -------
    jax.Array
        A 0-d int32 array (any jax array serves as a token).
    """
    return jnp.zeros((), jnp.int32)


__all__ = ["all_gather", "all_to_all", "allreduce", "barrier", "broadcast",
           "create_token", "recv", "reduce", "reduce_scatter", "send", "sendrecv"]
