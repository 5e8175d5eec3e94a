"""ferro-jax: ferro's collectives inside ``jax.jit`` on CPUs.

``ferro_jax.init()`` joins the job (as :func:`ferro_backend.init_from_env`); then
:func:`allreduce`, :func:`reduce_scatter`, :func:`all_gather`, :func:`broadcast`,
:func:`barrier`, :func:`all_to_all`, :func:`reduce`, :func:`send`, :func:`recv` and
:func:`sendrecv` work on jax arrays, inside and outside ``jax.jit``: XLA FFI calls that run the
same-host engine's door (``ferro/engine.h``) on the buffers XLA hands over, ordered by an ordered
effect (no tokens by hand), differentiable where the math is (``jax.grad``, ``jax.vjp``,
``jax.jvp``), batched exactly under ``jax.vmap`` (collectives). Point-to-point calls, and every
call on a backend without an engine (TCP, MPI, several nodes), go through ferro's Python from
inside XLA. The handlers are compiled at first use and cached (``ferro_jax._build``).
"""

from ferro_backend._version import version_getattr

from . import _ad  # noqa: F401 - the primitive's differentiation rules
from ._api import comm, default_backend, init
from ._build import BuildError, set_cache_dir
from ._primitive import EFFECT as EFFECT  # the ordered effect (not in __all__: internals)
from ._primitive import ferro_p as ferro_p
from .collectives import (
    all_gather,
    all_to_all,
    allreduce,
    barrier,
    broadcast,
    create_token,
    recv,
    reduce,
    reduce_scatter,
    send,
    sendrecv,
)
from .errors import translate, typed_errors

__all__ = [
    "BuildError",
    "all_gather",
    "all_to_all",
    "allreduce",
    "barrier",
    "broadcast",
    "comm",
    "create_token",
    "default_backend",
    "init",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
    "sendrecv",
    "set_cache_dir",
    "translate",
    "typed_errors",
]

__getattr__ = version_getattr(__name__, "ferro-jax")  # __version__, read when asked
