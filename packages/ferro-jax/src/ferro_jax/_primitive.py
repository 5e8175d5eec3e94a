"""The primitive every ferro_jax call binds: ``ferro``, with an ordered effect.

Each call is one ``ferro`` equation (``kind``: allreduce, reduce, reduce_scatter, all_gather,
broadcast, all_to_all, barrier, send, recv, sendrecv). Its effect, :data:`EFFECT`, is an
*ordered* effect: JAX threads one token through every ``ferro`` equation of a computation
(through ``scan``, ``while``, ``cond``, nested ``jit``, ``remat``), and the lowering passes that
token into the FFI call and takes the call's token back, so XLA runs a rank's calls in program
order, never reordered nor concurrent. Two ranks whose programs send and receive in matching
order therefore never deadlock, without tokens by hand. Between computations no token is passed
(:mod:`._dispatch`: the token starts inside each computation, so JAX dispatches it on its C++
fast path; the CPU client runs one device's executions in dispatch order).

Lowering: a call the engine's door runs (a collective on a backend with an engine, on an element
type it knows) becomes the FFI target ``ferro_jax_door`` (or ``ferro_jax_barrier``) with the
communicator's slot and the call's signature as attributes; anything else becomes
``ferro_jax_py``, which calls back into Python (:mod:`._pypath`). barrier and send have one
internal output, a uint8 "done" flag the handler writes (the public calls drop it): a call
outside jit waits for it, and a token passed by hand is tied to it.

Batching (``vmap``): the collectives are batched exactly (the mapped axis moved to just after
dim 0, where the calls that split or join along dim 0 leave it alone); point-to-point calls
and barrier under ``vmap`` raise NotImplementedError (recv and barrier too, which have no batched
input: the rule is JAX's ``fancy_primitive_batchers``, called for every equation under
``vmap``). Differentiation: :mod:`._ad`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax._src import core, dispatch, effects
from jax._src.interpreters import batching, mlir

from ferro_collective.header import dtype_code

from . import _dispatch, _lib, _pypath

#: the door's kinds (_handlers.cc) and ops (ferro/engine.h)
DOOR_KINDS = {"allreduce": 1, "reduce": 2, "reduce_scatter": 3, "all_gather": 4,
              "broadcast": 5, "all_to_all": 6}
DOOR_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "band": 4, "bor": 5, "bxor": 6, "mean": 7}
KINDS = (*DOOR_KINDS, "barrier", "send", "recv", "sendrecv")
#: the kinds whose only output is the internal "done" flag
SIDE_ONLY = ("barrier", "send")
DONE = core.ShapedArray((), np.dtype(np.uint8))
_REDUCING = ("allreduce", "reduce", "reduce_scatter")
#: element types the door reduces (others move as bytes, or take the Python path)
_DOOR_REDUCES = {np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8,
                                       np.uint16, np.uint32, np.uint64, np.float16, np.float32,
                                       np.float64, np.complex64, np.complex128,
                                       jax.numpy.bfloat16)}


class FerroEffect(effects.Effect):
    """ferro's calls: ordered (one token through them all, program order on every rank)."""

    def __str__(self) -> str:
        return "ferro"


EFFECT = FerroEffect()
for _set in (effects.lowerable_effects, effects.ordered_effects,
             effects.control_flow_allowed_effects, effects.custom_derivatives_allowed_effects,
             effects.remat_allowed_effects):
    _set.add_type(FerroEffect)
_dispatch.install(FerroEffect)  # no runtime token between computations (JAX's fast path)

ferro_p = core.Primitive("ferro")
ferro_p.multiple_results = True
ferro_p.def_impl(functools.partial(dispatch.apply_primitive, ferro_p))


def bind(*args: Any, kind: str, comm: _lib.Comm, op: str = "sum", root: int = 0,
         src: int = -1, dst: int = -1, tag: int = 0, timeout: float = 0.0,
         like: core.ShapedArray | None = None, marked: bool = False) -> list[Any]:
    """One ``ferro`` equation; its outputs (a list: empty for barrier and send). ``marked``: a
    collective whose rank makes its derivative's call later (:mod:`._ad`); its header names
    the shape with a trailing dim of 1 (:data:`MARK`), so that ranks that disagree on it fail
    at this call with a mismatch instead of hanging or pairing the derivative's call with
    another."""
    return ferro_p.bind(*args, kind=kind, comm=comm, op=op, root=root, src=src, dst=dst,
                        tag=tag, timeout=float(timeout), like=like, marked=marked)


#: dtypes XLA packs below a byte a value (ml_dtypes' int4...): the door and the Python path
#: would read and write a byte a value, past the buffers' ends
SUB_BYTE = frozenset({"int2", "uint2", "int4", "uint4", "float4_e2m1fn"})


def out_avals(avals, kind: str, comm: _lib.Comm, like) -> list[core.ShapedArray]:
    """What a call of ``kind`` returns, from its inputs' avals (ValueError if it cannot run);
    barrier and send: the internal done flag."""
    n = comm.world_size
    for a in (*avals, *([like] if like is not None else [])):
        if np.dtype(a.dtype).name in SUB_BYTE:
            raise TypeError(
                f"ferro_jax.{kind}: dtype {np.dtype(a.dtype).name} packs several values in a byte "
                "of XLA's buffers, which ferro reads a whole byte a value: cast it (to int8, "
                "say) first")
    if kind in SIDE_ONLY:
        return [DONE]
    if kind == "recv":
        return [like]
    (x,) = avals
    if kind == "sendrecv":
        return [like if like is not None else x.update(weak_type=False)]
    if kind == "all_gather":
        shape = (n,) if x.ndim == 0 else (n * x.shape[0], *x.shape[1:])
        return [core.ShapedArray(shape, x.dtype)]
    if kind in ("reduce_scatter", "all_to_all"):
        if x.ndim == 0 or x.shape[0] % n:
            raise ValueError(f"ferro_jax.{kind}: dim 0 of shape {x.shape} is not divisible by "
                             f"the world size {n}")
        if kind == "reduce_scatter":
            return [core.ShapedArray((x.shape[0] // n, *x.shape[1:]), x.dtype)]
    return [core.ShapedArray(x.shape, x.dtype)]


@ferro_p.def_effectful_abstract_eval
def _abstract_eval(*avals, kind, comm, like, **_):
    return out_avals(avals, kind, comm, like), {EFFECT}


# ---------------------------------------------------------------- lowering
def _door_runs(kind: str, comm: _lib.Comm, avals) -> bool:
    if not comm.door or kind not in DOOR_KINDS:
        return False
    return kind not in _REDUCING or np.dtype(avals[0].dtype) in _DOOR_REDUCES


def _python_call(kind, comm, avals_in, avals_out, params) -> int:
    """The number of the Python path's function for this call (one per distinct call: its
    kind, communicator, arrays and parameters; a retrace reuses it, :func:`_pypath.register`)."""
    timeout = params["timeout"] or None
    extra = {k: params[k] for k in ("op", "root", "src", "dst", "tag")}
    mark = (1,) if params["marked"] else ()  # the collective's arrays as (*shape, 1)

    x_shape = avals_in[0].shape if avals_in else ()
    if mark and kind == "all_gather" and not x_shape:
        x_shape = (1,)  # a 0-d input gathers to (world_size,): as (1, 1) to (world_size, 1)
    x_spec = ((*x_shape, *mark), np.dtype(avals_in[0].dtype)) if avals_in else None
    y_spec = ((*avals_out[0].shape, *mark), np.dtype(avals_out[0].dtype))

    def make():
        x_at = _pypath.Views(*x_spec) if x_spec is not None else None
        y_at = _pypath.Views(*y_spec)

        def call(ins: list[int], outs: list[int]) -> None:
            x = x_at(ins[0]) if x_at is not None else None
            y = y_at(outs[0])
            _pypath.run(kind, comm.backend, x, None if kind in SIDE_ONLY else y,
                        timeout=timeout, **extra)
            if kind in SIDE_ONLY:
                y[...] = 1  # done

        return call

    # (the Comm: hashed by identity, and held by _lib for the life of the process)
    key = (kind, comm, x_spec, y_spec, timeout, tuple(sorted(extra.items())))
    return _pypath.register(key, make)


def header_type(dtype) -> str:
    """The dtype the door's header names for a type it moves as bytes (float8...):
    ferro-collective's code for it (``ferro_collective.header.dtype_code``), so that ranks whose
    dtypes differ (float8_e4m3fn against float8_e5m2: the same width) get a mismatch, as the
    Python path's calls do. The handler ignores it for the door's own types."""
    return dtype_code(np.dtype(dtype)).decode("ascii")


def _lowering(ctx: mlir.LoweringRuleContext, *args, kind, comm, op, root, timeout, marked,
              **params):
    token = ctx.tokens_in.get(EFFECT)
    if kind == "barrier" and comm.door:
        target, attrs = _lib.BARRIER, {"slot": np.int64(comm.slot),
                                       "timeout": np.float64(timeout)}
    elif _door_runs(kind, comm, ctx.avals_in):
        target, attrs = _lib.DOOR, {"slot": np.int64(comm.slot),
                                    "kind": np.int32(DOOR_KINDS[kind]),
                                    "op": np.int32(DOOR_OPS[op]), "root": np.int32(root),
                                    "timeout": np.float64(timeout),
                                    "marked": np.int32(marked),
                                    "type_name": header_type(ctx.avals_in[0].dtype)}
    else:
        call = _python_call(kind, comm, ctx.avals_in, ctx.avals_out,
                            dict(op=op, root=root, timeout=timeout, marked=marked, **params))
        target, attrs = _lib.PYTHON, {"call": np.int64(call)}
    sub = dataclasses.replace(ctx, avals_in=[core.abstract_token, *ctx.avals_in],
                              avals_out=[core.abstract_token, *ctx.avals_out])
    result = jax.ffi.build_ffi_lowering_function(target, has_side_effect=True)(
        sub, token, *args, **attrs)
    token, *outs = result.results
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({EFFECT: token})))
    return outs


mlir.register_lowering(ferro_p, _lowering, platform="cpu")


# ---------------------------------------------------------------- vmap
def _refuse_under_vmap(kind: str) -> None:
    if kind in ("send", "recv", "sendrecv", "barrier"):
        what = "a barrier" if kind == "barrier" else "a point-to-point call"
        raise NotImplementedError(
            f"ferro_jax.{kind} under jax.vmap: {what} has no batched form "
            "(call it on the whole batch outside vmap)")


def _batching(args, dims, *, kind, **params):
    _refuse_under_vmap(kind)
    (x,), (d,) = args, dims
    if kind in ("allreduce", "reduce", "broadcast"):  # element-wise: any axis stays put
        return bind(x, kind=kind, **params), [d]
    # all_gather, reduce_scatter, all_to_all join or split dim 0: the batch goes after it
    if x.ndim == 1:  # a batch of 0-d values
        if kind != "all_gather":
            raise ValueError(f"ferro_jax.{kind}: a 0-d input has no dim 0 to split")
        (y,) = bind(x, kind=kind, **params)  # (n * B,): rank r's B values at r * B
        return [y.reshape(params["comm"].world_size, x.shape[0])], [1]
    x = batching.moveaxis(x, d, 1)
    return bind(x, kind=kind, **params), [1]


def _batching_any(axis_data, args, dims, *, kind, **params):
    """The rule JAX calls for every ``ferro`` equation under ``vmap``, batched inputs or not
    (its ``primitive_batchers`` rule is skipped where none is batched: recv and barrier, whose
    inputs never are, would run once for the whole batch instead of refusing)."""
    del axis_data
    _refuse_under_vmap(kind)
    if all(d is None for d in dims):  # nothing batched (an allreduce of a constant): as is
        outs = bind(*args, kind=kind, **params)
        return outs, [None] * len(outs)
    return _batching(args, dims, kind=kind, **params)


if hasattr(batching, "fancy_primitive_batchers"):
    batching.fancy_primitive_batchers[ferro_p] = _batching_any
else:  # pragma: no cover - an older jax: recv and barrier run unbatched under vmap
    batching.primitive_batchers[ferro_p] = _batching
