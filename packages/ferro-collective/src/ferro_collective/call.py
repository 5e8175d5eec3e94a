"""One prepared collective call: argument checks, sequencing, and where it runs.

A :class:`Call` is validated and numbered when it is made (so an async call keeps its place in
the order of calls), and runs either with the Python algorithms over point-to-point messages
(``body``) or on the same-host engine (``fast``, see :mod:`.fastpath`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ferro_backend import Backend, SizeMismatchError

from . import algorithms as alg
from . import costmodel, engine_group
from ._state import state, tag_base
from .header import encode, mismatch_check_enabled
from .work import Work

#: allreduce messages up to this size use recursive doubling (latency), larger ones the ring
SMALL_MESSAGE_BYTES = 256 << 10

ALGORITHMS = {
    "allreduce": ("auto", "ring", "recursive_doubling", "star"),
    "broadcast": ("auto", "tree", "star"),
    "all_gather": ("auto", "ring", "star"),
    "reduce_scatter": ("auto", "ring", "star"),
    # the collectives added in 0.2 choose by size alone (no algorithm= argument)
    "reduce": ("auto", "tree", "ring"),
    "gather": ("auto", "tree", "star"),
    "scatter": ("auto", "tree", "star"),
    "all_gather_v": ("auto", "ring"),
    "all_to_all": ("auto", "pairwise"),
}


def choose(name: str, algorithm: str | None, nbytes: int, n: int, backend=None) -> str:
    """The algorithm to run: the one asked for, or for "auto" the measured thresholds up to 4
    ranks and beyond that the cost model's best for ``backend``'s network (its simulated
    network, else its node layout on a typical cluster: :func:`costmodel.params_for`)."""
    algorithm = algorithm or "auto"
    if algorithm not in ALGORITHMS[name]:
        raise ValueError(f"{name}: unknown algorithm {algorithm!r}; expected one of "
                         f"{ALGORITHMS[name]}")
    if algorithm != "auto":
        return algorithm
    if n > 4 and name in costmodel.ALGORITHMS_MODELLED:
        # beyond the world sizes the thresholds below were measured at: the cost model
        return costmodel.choose_auto(name, nbytes, n, costmodel.params_for(backend))
    if name == "allreduce":
        return "recursive_doubling" if nbytes <= SMALL_MESSAGE_BYTES or n <= 2 and \
            nbytes <= 4 * SMALL_MESSAGE_BYTES else "ring"
    if name == "reduce":  # binomial tree; reduce-scatter + gather (bandwidth) when large
        return "tree" if nbytes <= SMALL_MESSAGE_BYTES or n <= 2 else "ring"
    if name in ("gather", "scatter"):  # nbytes: one rank's block
        return "tree" if nbytes <= SMALL_MESSAGE_BYTES // 4 else "star"
    if name == "all_to_all":
        return "pairwise"
    return "tree" if name == "broadcast" else "ring"


def as_array(name: str, tensor, backend) -> np.ndarray:
    if not isinstance(backend, Backend):
        raise TypeError(f"{name}: backend must be a ferro_backend.Backend, got "
                        f"{type(backend).__name__}")
    x = np.asarray(tensor)
    if x.dtype.hasobject or x.dtype.itemsize == 0:
        raise TypeError(f"{name}: dtype {x.dtype} cannot be sent")
    return x


def check_out(name: str, out, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
    """``out=`` checked: a writable C-contiguous ndarray of the result's shape and dtype."""
    if out is None:
        return None
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name}: out must be a numpy array, got {type(out).__name__}")
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise SizeMismatchError(f"{name}: out is {out.dtype}{list(out.shape)}, the result is "
                                f"{np.dtype(dtype)}{list(shape)}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name}: out must be writable and C-contiguous")
    return out


def prefer_hierarchical(name: str, header: tuple, backend, h) -> bool:
    """Whether "auto" runs ``name`` as the hierarchy ``h``'s stages.

    Real nodes (an engine in each) always do: every rank then takes the same path whatever
    its arguments, so a mismatched call still fails as a mismatch on every rank, and the
    engine's cost across real nodes has not been measured yet. A simulated network's
    hierarchy follows the cost model (:func:`costmodel.choose_hierarchical` on its links and
    layout; a layout the model does not describe keeps the stages): the same answer on every
    rank for the same size, world size and layout (ranks that pass different sizes may then
    take different paths and time out instead of reporting the mismatch)."""
    if getattr(h.node, "engine", None) is not None:
        return True
    p = costmodel.params_for(backend)
    if p.ranks_per_node != h.local_world or len(h.members) * h.local_world != backend.world_size:
        return True
    dtype, shape = header[0], header[1]
    nbytes = 0 if dtype is None else int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return costmodel.choose_hierarchical(name, nbytes, backend.world_size, p)


class Call:
    """One prepared collective: validated, sequenced, ready to run (now or in the background).

    ``body(ctx)`` runs it with the Python algorithms over point-to-point messages; ``fast(group,
    step, header)``, where given, runs it on the same-host engine (``fastpath``), which every
    call on a backend with an engine goes through (in issue order) unless an algorithm was
    forced.
    """

    def __init__(self, name: str, backend: Backend, timeout: float | None, header: tuple,
                 body: Callable[[alg.Ctx], np.ndarray], fast=None,
                 algorithm: str | None = None, seq: int | None = None, hier=None) -> None:
        self.name = name
        self.backend = backend
        self.timeout = backend.resolve_timeout(timeout, f"{name}: timeout")
        self.seq = state(backend).next_seq() if seq is None else seq
        self.header = header
        self.body = body
        self.fast = fast if algorithm in (None, "auto") else None
        self.group = engine_group.group_for(backend)
        # several nodes: ``hier(hierarchy)`` plans the call's node and cross stages now (their
        # sequence numbers in issue order) and returns what runs them (ferro_collective.hierarchical)
        # where the cost model rates them faster than the flat algorithm
        self.staged = None
        if hier is not None and algorithm in (None, "auto") and self.group is None \
                and getattr(backend, "hierarchy", None) is not None:
            from . import hierarchical

            h = hierarchical.hierarchy_of(backend)
            if h is not None and prefer_hierarchical(name, header, backend, h):
                self.staged = hier(h)

    def _python(self, _step=None) -> np.ndarray:
        ctx = alg.Ctx(self.backend, self.name, self.seq, tag_base(self.seq), self.timeout)
        if ctx.n > 1 and (mismatch_check_enabled() or self.name == "barrier"):
            # the header exchange; for a barrier it is the whole barrier
            alg.header_exchange(ctx, encode(self.name, *self.header, seq=self.seq))
        return self.body(ctx)

    def __call__(self) -> np.ndarray:
        if self.staged is not None:
            return self.staged()
        if self.group is None:
            return self._python()
        fn = self._python
        if self.fast is not None:
            header = encode(self.name, *self.header, seq=self.seq)
            fn = lambda step: self.fast(self.group, step, header)
        return self.group.run(self.name, self.seq, self.timeout, fn)

    def run(self) -> np.ndarray:
        return self()

    def submit(self) -> Work:
        return Work(self.name, self.seq, state(self.backend).submit(self))



def finish(result: np.ndarray, dtype: np.dtype, out: np.ndarray | None) -> np.ndarray:
    """``result`` in ``dtype``, in ``out`` when given (no copy when it already is ``out``)."""
    if out is None:
        return result if result.dtype == dtype else result.astype(dtype)
    if not np.may_share_memory(result, out):
        np.copyto(out, result, casting="unsafe")
    return out
