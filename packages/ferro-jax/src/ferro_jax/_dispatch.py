"""ferro's ordered effect inside a computation, and no runtime token between computations.

JAX runs any jitted computation whose jaxpr carries an ordered effect through its Python
dispatch path: the executable takes the effect's runtime token as an extra argument and
returns the next one (a ``device_put`` of the token, ``execute_sharded(with_tokens=True)``,
the token bookkeeping of ``dispatch.runtime_tokens``), and never through its C++ fast path.
Measured here (jax 0.10.2, a jitted ``x * 2`` on 16 floats): 4.4 us a call without an effect,
120-140 us with an *unordered* effect (the Python path alone), 230-350 us with an ordered one.

ferro_jax needs the ordered effect *inside* a computation: JAX threads its token through every
``ferro`` equation, through ``scan``/``while``/``cond``/``jit``/``remat``/``custom_vjp``, and keeps
them from being removed as dead code; XLA:CPU then runs the calls one at a time in program
order (its thunk executor otherwise runs independent custom calls concurrently, measured: two
at once on 2 cores). It does not need the token *between* computations: the PjRt CPU client
runs the executions of one device one after another in dispatch order (each waits for the
previous one's enqueue event; measured with independent executions of uneven lengths), which is
the order the runtime token gave. That holds for one device only: executions on *different*
devices of the CPU client (``jax_num_cpu_devices`` > 1) run concurrently, and only the runtime
token (moved to each computation's device) keeps them in dispatch order; so a process whose
client has more than one local device keeps the runtime tokens (measured: without them, a jitted
allreduce on device 1 dispatched after one on device 0 ran first, and the ranks paired the calls
crosswise).

So, where ferro's effect reaches the top of a computation, :func:`install` makes JAX lower it
as if it did not: the top-level jaxpr is handed to JAX's lowering with ferro's effect left out
of its effect set (only that set: every equation keeps it), and the ``main`` function makes the
effect's token itself (``stablehlo.create_token``) instead of taking it as an argument, so the
token is threaded through the whole computation exactly as before, while the executable has no
token argument, no token result and, if nothing else has an effect, JAX's C++ fast path.

Two JAX functions are wrapped (module attributes, looked up at call time): ``pxla.
_cached_lowering_to_hlo`` (the lowering of a top-level jaxpr; its cache is kept by lowering one
filtered copy per jaxpr) and ``mlir.jaxpr_subcomp`` (adds the token for ``main``). If either is
missing (another jax), nothing is wrapped and the runtime tokens stay (correct, slower);
``FERRO_JAX_RUNTIME_TOKENS=1`` keeps them too, and so does a client with several local
devices. Computations on several devices keep the effect
(JAX refuses ordered effects there, as before).
"""

from __future__ import annotations

import weakref
from typing import Any

from jax._src import core

from ferro_backend import settings

#: True once :func:`install` wrapped JAX's lowering (computations then carry no runtime token)
ACTIVE = False

_EFFECT_TYPE: type | None = None
_filtered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # jaxpr -> its filtered copy
_tops: weakref.WeakSet = weakref.WeakSet()  # filtered top-level jaxprs: main makes the token


def _filter(closed_jaxpr: Any) -> Any:
    """``closed_jaxpr`` with ferro's effect out of its top-level effect set (one copy per
    jaxpr, so JAX's lowering cache still hits)."""
    jaxpr = closed_jaxpr.jaxpr
    if not any(isinstance(e, _EFFECT_TYPE) for e in jaxpr.effects):
        return closed_jaxpr
    cached = _filtered.get(closed_jaxpr)
    if cached is None:
        inner = jaxpr.replace(effects={e for e in jaxpr.effects
                                       if not isinstance(e, _EFFECT_TYPE)})
        _tops.add(inner)
        cached = _filtered[closed_jaxpr] = core.ClosedJaxpr(inner, closed_jaxpr.consts)
    return cached


def _one_device(backend: Any) -> bool:
    """Whether ``backend`` (an XLA client) has one local device: the only case where its
    executions run one after another in dispatch order without a runtime token."""
    try:
        return int(backend.local_device_count()) == 1
    except Exception:  # pragma: no cover - an unknown client: keep the tokens
        return False


def install(effect_type: type) -> bool:
    """Wrap JAX's lowering so that computations with ``effect_type`` (an ordered effect) carry
    no runtime token; returns whether it did (idempotent)."""
    global ACTIVE, _EFFECT_TYPE
    if ACTIVE:
        return True
    if settings.JAX_RUNTIME_TOKENS.get():
        return False
    try:
        from jax._src.interpreters import mlir, pxla

        lower = pxla._cached_lowering_to_hlo
        subcomp = mlir.jaxpr_subcomp
        token_set, create_token = mlir.TokenSet, mlir.create_token
    except (ImportError, AttributeError):  # pragma: no cover - another jax: keep the tokens
        return False
    _EFFECT_TYPE = effect_type

    def _cached_lowering_to_hlo(closed_jaxpr, module_name, backend, num_const_args, in_avals,
                                semantic_in_shardings, semantic_out_shardings, in_layouts,
                                out_layouts, num_devices, *args, **kwargs):
        # several devices in the computation: JAX's own error about ordered effects; several
        # devices in the process: they run concurrently, and only the runtime token orders
        # computations on different devices (keep it)
        if num_devices == 1 and _one_device(backend):
            closed_jaxpr = _filter(closed_jaxpr)
        return lower(closed_jaxpr, module_name, backend, num_const_args, in_avals,
                     semantic_in_shardings, semantic_out_shardings, in_layouts, out_layouts,
                     num_devices, *args, **kwargs)

    def jaxpr_subcomp(ctx, jaxpr, name_stack, tokens, *args, **kwargs):
        if jaxpr in _tops:  # main of a filtered computation: the effect's token starts here
            missing = {e for eqn in jaxpr.eqns for e in eqn.effects
                       if isinstance(e, effect_type)} - tokens.effects()
            if missing:
                tokens = token_set({**dict(tokens.items()),
                                    **{e: create_token() for e in missing}})
        return subcomp(ctx, jaxpr, name_stack, tokens, *args, **kwargs)

    _cached_lowering_to_hlo.__wrapped__ = lower  # type: ignore[attr-defined]
    for name in ("cache_clear", "cache_info"):
        if hasattr(lower, name):
            setattr(_cached_lowering_to_hlo, name, getattr(lower, name))
    jaxpr_subcomp.__wrapped__ = subcomp  # type: ignore[attr-defined]
    pxla._cached_lowering_to_hlo = _cached_lowering_to_hlo
    mlir.jaxpr_subcomp = jaxpr_subcomp
    ACTIVE = True
    return True
