"""Differentiation of the ``ferro`` primitive: JVP and transpose rules.

The collectives that are linear maps of their input are differentiated in both modes (``jax.jvp``,
``jax.grad``, ``jax.vjp``, ``jax.linearize``); their transposes are collectives too, so a rank's
backward pass makes the same calls, in reverse order, as every other rank's:

========================  =====================================================
call                      transpose (the cotangent's collective)
========================  =====================================================
allreduce sum / mean      allreduce sum / mean
reduce_scatter sum/mean   all_gather (divided by the world size for mean)
all_gather                reduce_scatter sum
broadcast(root)           reduce sum to root (zeros on the other ranks)
reduce sum/mean (root)    broadcast from root (divided by the world size for mean)
all_to_all                all_to_all
sendrecv(src, dst)        sendrecv(src=dst, dst=src)
========================  =====================================================

A tangent is never skipped as a symbolic zero: every rank makes the tangent's call whether its
own tangent is zero or not (another rank's may not be). But JAX differentiates a call only on a
rank whose input depends on the differentiated variables: a rank whose input is a constant (a
broadcast's non-root passing ``jnp.zeros_like(p)``, say) makes no derivative call. So that this
fails at once instead of hanging, or pairing one rank's derivative call with another's next
call, a collective that its rank will differentiate is *marked* (:func:`._primitive.bind`): the
shape its header names gets a trailing dim of 1, and ranks that disagree raise
CollectiveMismatchError at that call, with a hint (:mod:`.errors`). sendrecv is not marked (a
point-to-point message has no header): there the waiting side times out.

Not differentiable (a clear error when a non-zero tangent reaches them): max, min, prod and the
bitwise reductions, send (use sendrecv), recv and barrier (no input to differentiate). Integer
inputs have no tangent.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax._src import ad_util
from jax._src.interpreters import ad

from ._primitive import SIDE_ONLY, bind, ferro_p

_LINEAR_OPS = ("sum", "mean")


def _differentiable(kind: str, op: str) -> bool:
    if kind in ("allreduce", "reduce", "reduce_scatter"):
        return op in _LINEAR_OPS
    return kind in ("all_gather", "broadcast", "all_to_all", "sendrecv")


def _jvp(primals, tangents, *, kind, **params):
    if kind in SIDE_ONLY:  # barrier, send: only the internal done flag comes out
        if any(type(t) is not ad.Zero for t in tangents):
            raise TypeError(f"ferro_jax.{kind} is not differentiable (a tangent reached it); "
                            "sendrecv is: it exchanges with both peers")
        return _primal_only(primals, kind, params)
    like = params["like"]  # (sendrecv's and recv's output, where given)
    if not jnp.issubdtype(primals[0].dtype if like is None else like.dtype, jnp.inexact):
        return _primal_only(primals, kind, params)
    if not _differentiable(kind, params["op"]) or (kind == "sendrecv" and
                                                    params["like"] is not None):
        if all(type(t) is ad.Zero for t in tangents):
            return _primal_only(primals, kind, params)
        what = f"{kind} with op={params['op']!r}" if kind in ("allreduce", "reduce",
                                                             "reduce_scatter") else kind
        raise TypeError(f"ferro_jax.{what} is not differentiable")
    # the derivative's call follows (the tangent's, or in reverse mode its transpose): marked
    outs = ferro_p.bind(*primals, kind=kind, **{**params, "marked": kind != "sendrecv"})
    t = ad.instantiate_zeros(tangents[0])  # every rank calls, whatever its own tangent
    return outs, ferro_p.bind(t, kind=kind, **params)


def _primal_only(primals, kind, params):
    outs = ferro_p.bind(*primals, kind=kind, **params)
    return outs, [ad_util.p2tz(o) for o in outs]


def _transpose(cts, x, *, kind, comm, op, root, src, dst, tag, timeout, like, marked):
    del like, marked
    (ct,) = cts
    ct = ad.instantiate_zeros(ct)
    common = dict(comm=comm, root=root, tag=tag, timeout=timeout)
    n = comm.world_size
    if kind == "allreduce":
        (r,) = bind(ct, kind="allreduce", op=op, **common)
    elif kind == "reduce":
        (r,) = bind(ct, kind="broadcast", **common)
        r = r / n if op == "mean" else r
    elif kind == "reduce_scatter":
        (r,) = bind(ct, kind="all_gather", **common)
        r = r / n if op == "mean" else r
    elif kind == "all_gather":
        aval = x.aval if ad.is_undefined_primal(x) else x
        (r,) = bind(ct, kind="reduce_scatter", op="sum", **common)
        r = r.reshape(aval.shape)  # a 0-d input gathered to (n,): its slice back to ()
    elif kind == "broadcast":
        (r,) = bind(ct, kind="reduce", op="sum", **common)
    elif kind == "all_to_all":
        (r,) = bind(ct, kind="all_to_all", **common)
    elif kind == "sendrecv":
        (r,) = bind(ct, kind="sendrecv", src=dst, dst=src, **common)
    else:  # pragma: no cover - _jvp refuses the others before a transpose is needed
        raise TypeError(f"ferro_jax.{kind} has no transpose")
    return [r]


ad.primitive_jvps[ferro_p] = _jvp
ad.primitive_transposes[ferro_p] = _transpose
