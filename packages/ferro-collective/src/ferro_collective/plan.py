"""A collective call, checked and planned: what every rank must agree on, and how it runs.

A :class:`Plan` is what a collective's module makes of one call (its ``prepare``): validated
arguments, the header every rank compares (name, dtype, shape, op, root), and one body per
executor: ``python(ctx)`` over point-to-point messages (the algorithms of :mod:`.p2p` and the
collective's own), ``engine(group, call, header)`` on the same-host engine, ``stages(h)`` as
hierarchical stages on a multi-node job. The dispatcher (:mod:`.dispatch`) chooses which one
runs, once, and numbers the call. :func:`choose` is the algorithm a Python body runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from ferro_backend import Backend, PeerClosedError

from . import costmodel, gathered
from .header import encode, mismatch_check_enabled
from .p2p import Ctx, header_exchange
from .per_backend import tag_base


class Collective(NamedTuple):
    """A collective's record, declared in its own module and read by the dispatcher: its
    ``name`` (what its header and errors say); ``prepare(tensor, backend, arg, timeout,
    algorithm, out, seq=None)``, which checks a call and returns its :class:`Plan` (``arg``:
    its own argument, the op, the root or None); ``kind``, its compiled one-call path on the
    engine (one of ``_onecall``'s ALLREDUCE..ALL_TO_ALL_SINGLE), or None; the ``algorithms`` its
    ``algorithm=`` takes ("auto" first; empty: it has no such argument); and the names of its
    bindings, ``torch`` (the ``torch.distributed`` call ferro-torch's backend serves with it)
    and ``jax`` (ferro-jax's function), where there is one. :mod:`.records` lists them all."""

    name: str
    prepare: Callable[..., Plan]
    kind: int | None = None
    algorithms: tuple[str, ...] = ()
    torch: str | None = None
    jax: str | None = None


def choose(coll: Collective, algorithm: str | None, nbytes: int, n: int, backend=None) -> str:
    """The algorithm of ``coll`` to run: the one asked for, or for "auto" the measured
    thresholds up to 4 ranks and beyond that the cost model's best for ``backend``'s network
    (its simulated network, else its node layout on a typical cluster:
    :func:`costmodel.params_for`)."""
    algorithm = algorithm or "auto"
    name = coll.name
    if algorithm not in coll.algorithms:
        raise ValueError(f"{name}: unknown algorithm {algorithm!r}; expected one of "
                         f"{coll.algorithms}")
    if algorithm != "auto":
        return algorithm
    if backend is not None and n > 1 and name in costmodel.ALGORITHMS_MODELLED:
        p = costmodel.learned(backend)  # learned on this job: the model at every world size
        if p is not None:
            return costmodel.choose_auto(name, nbytes, n, p)
    params = costmodel.params_for(backend) if n > 4 and backend is not None else None
    return costmodel.auto_pick(name, nbytes, n, params)


class Plan:
    """One checked call (see the module docstring). ``header``: ``(dtype, shape, op, root)``;
    ``seq``: its sequence number when the caller reserved one (a hierarchical stage), else the
    dispatcher takes the backend's next. A forced ``algorithm`` keeps the call on the Python
    body (the engine and the stages run "auto" only). ``span``: the sequence numbers the
    caller's whole call takes where this is its first collective (a compressed call's block; 0:
    one), which its header publishes (:func:`.header.owed`). ``checked``: a stage of a
    hierarchical call whose whole-call check passed (:mod:`.stage_check`): its Python body
    skips its own header exchange (a barrier's is the barrier: it keeps it). ``whole``: a
    hierarchical call's first stage on a group publishes the whole call's header in its own
    place, the door's or its own exchange's (:class:`.stage_check.Whole`), else None.
    ``pair(ctx, header)``: the body that sends the call's data with its header (two ranks:
    :mod:`.pair`; more: :mod:`.gathered`), where the collective has one for this call ("auto"
    only)."""

    __slots__ = ("name", "backend", "timeout", "header", "python", "engine", "stages", "seq",
                 "span", "checked", "whole", "pair")

    def __init__(self, name: str, backend: Backend, timeout: float | None, header: tuple,
                 python: Callable[[Ctx], Any], engine: Callable | None = None,
                 stages: Callable | None = None, algorithm: str | None = None,
                 seq: int | None = None, pair: Callable[[Ctx, bytes], Any] | None = None
                 ) -> None:
        self.name = name
        self.backend = backend
        self.timeout = backend.resolve_timeout(timeout, f"{name}: timeout")
        self.header = header
        self.python = python
        auto = algorithm in (None, "auto")
        self.engine = engine if auto else None
        self.stages = stages if auto else None
        self.pair = pair if auto else None
        self.seq = seq
        self.span = 0
        self.checked = False
        self.whole = None

    def encoded(self) -> bytes:
        """The header every rank compares, with this call's sequence number (a stage that
        publishes its whole call's, :attr:`whole`: that one's)."""
        if self.whole is not None:
            return self.whole.header(self.seq)
        return encode(self.name, *self.header, seq=self.seq, span=self.span)

    def context(self) -> Ctx:
        """This call's point-to-point context (tags from its sequence number, deadlines)."""
        return Ctx(self.backend, self.name, self.seq, tag_base(self.seq), self.timeout)

    def run_python(self) -> Any:
        """Over point-to-point messages: the header exchange (the mismatch check; for a barrier
        the whole barrier), then the body; where the call has one, the body that sends its data
        with its header (:attr:`pair`)."""
        ctx = self.context()
        try:
            if ctx.n > 1 and (self.name == "barrier" or
                              (mismatch_check_enabled() and not self.checked)):
                if self.pair is not None:
                    result = self.pair(ctx, self.encoded())
                    ctx.release()
                    return result
                header_exchange(ctx, self.encoded())
            result = self.python(ctx)
        except PeerClosedError as exc:
            ctx.name_failure(exc)
            raise
        ctx.release()  # its working arrays, for the next call (not after a failure)
        return result

    def run_engine(self, group, call) -> Any:
        """On the engine, in its issue order: the engine body, or the Python one where there
        is none (a forced algorithm, a collective without an engine path)."""
        if self.engine is None:
            return self.run_python()
        return self.engine(group, call, self.encoded())


def gathered_or_first(name: str, nbytes: int, n: int, backend, body: Callable,
                      python: Callable) -> Callable | None:
    """The :attr:`Plan.pair` of a small call of ``n`` > 2 ranks (``nbytes`` a rank, at most
    :data:`.gathered.GATHER_MAX` gathered): ``body(ctx, header)`` (the call gathered in the
    header exchange's rounds, :mod:`.gathered`) where the cost model rates ``name`` (an
    allreduce, all_gather, reduce_scatter or broadcast: a reduce is rated as the allreduce it
    gathers like, a gather as the all_gather) faster on ``backend``'s links, decided when the call runs
    over point-to-point messages (never on the engine's path), else the header exchange and
    ``python(ctx)``; None for larger calls."""
    if not 0 < gathered.gathered_bytes(name, nbytes, n) <= gathered.GATHER_MAX:
        return None

    def run(ctx: Ctx, header: bytes) -> Any:
        if gathers_now(name, nbytes, n, backend):
            return body(ctx, header)
        header_exchange(ctx, header)
        return python(ctx)

    return run


def gathers_now(name: str, nbytes: int, n: int, backend) -> bool:
    """The decision :func:`gathered_or_first`'s plan takes when it runs (the cost model on
    ``backend``'s links, :func:`.costmodel.gathers`), which a broadcast's non-root that passed
    None takes again once it knows the root's size (:class:`.broadcast.FromRoot`)."""
    return costmodel.gathers(name, nbytes, n, costmodel.params_for(backend))


__all__ = ["Collective", "Plan", "choose", "gathered_or_first", "gathers_now"]
