"""barrier: nobody leaves before every rank has called it.

The barrier is the collectives' header exchange with the barrier's header, so a rank that calls
another collective instead gets CollectiveMismatchError on every rank rather than a hang: one
engine step on a backend with an engine (the door's barrier), Bruck's all-gather of the headers
(``ceil(log2 n)`` rounds) over point-to-point messages, or node, cross and node barriers on a
multi-node job (:func:`stages`).
"""

from __future__ import annotations

from . import _onecall
from .arguments import check_backend
from .engine_group import EngineGroup, Step, door_calls
from .p2p import Ctx
from .per_backend import reserve
from .plan import Collective, Plan


def prepare(tensor, backend, arg, timeout, algorithm, out, seq: int | None = None) -> Plan:
    """The checked plan of one barrier (the header exchange is all of it)."""
    check_backend("barrier", backend)

    def python(ctx: Ctx) -> None:
        return None

    def engine(group: EngineGroup, call: Step, header: bytes) -> None:
        group.door(call, door_calls.BARRIER, None, None, 0)

    return Plan("barrier", backend, timeout, (None, ()), python, engine,
                lambda h: stages(h, timeout), algorithm, seq)


def stages(h, timeout):
    """Node, cross, node; returns ``run(execute)`` (with the mismatch check on, the first two
    carry the whole-call check: :mod:`.stage_check`)."""
    node, cross = h.node, h.cross
    s1, s3 = reserve(node, node)
    (s2,) = reserve(cross)

    def run(execute) -> None:
        execute(prepare(None, node, None, timeout, None, None, s1))
        execute(prepare(None, cross, None, timeout, None, None, s2))
        execute(prepare(None, node, None, timeout, None, None, s3))

    return run


BARRIER = Collective("barrier", prepare, _onecall.BARRIER, torch="barrier", jax="barrier")

__all__ = ["BARRIER", "prepare", "stages"]
