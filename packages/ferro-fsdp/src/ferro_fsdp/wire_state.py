"""``grads_wire``'s error feedback in FSDP's sharded state dicts, so a resumed run goes on with
the bits an unbroken one would have.

With ``grads_wire="int8"`` or ``"int4"`` each rank keeps, per unit and per array it reduces,
what its last encoding rounded away (``Unit.errors``) and adds it to the next step's gradient;
for an allreduce (NO_SHARD's, HYBRID_SHARD's across the replicas), also what its encoding of
the chunk it folded rounded away (``Unit.feedbacks``: a
:class:`~ferro_collective.wire.Feedback` a series of calls). They are this rank's own residuals
(of its own batch's gradient, at its own place in the group), so each is saved as a piece per
rank: ``wire_error.<unit>.<k>`` (a reduce-scatter's array ``k``) or
``wire_error.<unit>.<series>-sent`` and ``-folded`` of full shape ``(world * n,)``, rank
``r``'s ``n`` elements at ``r * n``, and ``wire_error.world``, the world it was saved on (one
int64 per rank). It loads back on the same world size (from the pieces, or from the full
tensors on every rank); saved on another world size, or not saved at all, the feedback starts
afresh (zeros), with a warning in the first case. A loaded residual that this configuration's
steps do not feed back (``Unit.feeds_back``: of another strategy or wrap policy, an array or
series its unit does not reduce, an empty unit's, a unit it does not have, or of another
size) is dropped on loading, with a warning, as a fresh one would be: kept, it would be re-saved
unchanged by every later checkpoint, and a resume of such a one on the configuration that
feeds it back would add a residual many steps old. A load checks everything (:func:`prepare`)
before it changes any residual (:func:`apply`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferro_collective.wire import Feedback

PREFIX = "wire_error."
#: a Feedback's residuals: this rank's contribution's, its folded chunk's
_PARTS = ("sent", "folded")
WORLD_KEY = PREFIX + "world"


@dataclass
class Loaded:
    """:func:`prepare`'s result: ``(unit, k, this rank's piece)`` of each residual to load, and
    the warnings to give once it is loaded."""

    residuals: list[tuple[Any, str, np.ndarray]]
    warnings: list[str]


def _name(unit: Any) -> str:
    return unit.name or "root"


def save(units: list[Any], world: int) -> tuple[dict[str, np.ndarray], dict[str, tuple]]:
    """This rank's residuals of every unit, and their specs (none when there are none)."""
    tensors: dict[str, np.ndarray] = {}
    specs: dict[str, tuple] = {}
    for unit in units:
        arrays = [(str(k), error) for k, error in sorted((unit.errors or {}).items())]
        for series, fb in sorted((getattr(unit, "feedbacks", None) or {}).items()):
            arrays += [(f"{series}-{part}", getattr(fb, part)) for part in _PARTS
                       if getattr(fb, part) is not None]
        for k, error in arrays:
            key = f"{PREFIX}{_name(unit)}.{k}"
            tensors[key] = np.array(error, copy=True).reshape(-1)
            n = tensors[key].size
            specs[key] = ((world * n,), 0, (n,) * world)
    if tensors:
        tensors[WORLD_KEY] = np.array([world], np.int64)
        specs[WORLD_KEY] = ((world,), 0, (1,) * world)
    return tensors, specs


def split(tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the rest, the error feedback's)`` of a state dict's tensors."""
    rest = {k: v for k, v in tensors.items() if not k.startswith(PREFIX)}
    return rest, {k: v for k, v in tensors.items() if k.startswith(PREFIX)}


def prepare(units: list[Any], saved: dict[str, Any], world: int, rank: int) -> Loaded:
    """What :func:`apply` will set (``saved``: the ``wire_error.*`` tensors :func:`split` took
    out; empty: every unit starts afresh), touching no unit: a load checks everything before it
    changes anything. Raises ValueError for keys without the world mark, a key that names no
    residual, or a piece that does not fit the world."""
    if not saved:
        return Loaded([], [])
    if WORLD_KEY not in saved:
        raise ValueError(f"load_sharded_state_dict: error feedback keys without {WORLD_KEY!r}")
    marks = np.asarray(saved[WORLD_KEY]).reshape(-1)
    full = marks.size == world and world > 1  # the full tensors on every rank, not pieces
    if marks.size not in (1, world) or int(marks[0]) != world:
        # (resharded to another world, a rank's piece of the mark may be empty)
        was = f"{int(marks[0])} ranks" if marks.size else "another number of ranks"
        return Loaded([], [f"load_sharded_state_dict: grads_wire's error feedback was saved on "
                           f"{was}, this job has {world}: it starts afresh"])
    by_name = {_name(u): u for u in units}
    residuals: list[tuple[Any, str, np.ndarray]] = []
    dropped = []
    for key, value in saved.items():
        if key == WORLD_KEY:
            continue
        name, _, k = key[len(PREFIX):].rpartition(".")
        series, _, part = k.rpartition("-")
        if not name or not (k.isdigit() or (series and part in _PARTS)):
            raise ValueError(f"load_sharded_state_dict: {key!r} names no error feedback "
                             f"residual ('{PREFIX}<unit>.<k>' or '.<series>-sent' / "
                             f"'-folded')")
        unit = by_name.get(name)
        if unit is None:  # a unit of another wrap policy
            dropped.append(key)
            continue
        piece = np.asarray(value).reshape(-1)
        if full:
            if piece.size % world:
                raise ValueError(f"load_sharded_state_dict: {key!r} has {piece.size} elements, "
                                 f"not a piece for each of {world} ranks")
            n = piece.size // world
            piece = piece[rank * n:(rank + 1) * n]
        if not unit.feeds_back(k, piece.size):
            dropped.append(key)
            continue
        residuals.append((unit, k, piece))
    said = []
    if dropped:
        said.append(f"load_sharded_state_dict: grads_wire's error feedback {sorted(dropped)} "
                    f"is of another strategy or wrap policy (this model's steps feed none such "
                    f"back): it is dropped, the feedback starts afresh")
    return Loaded(residuals, said)


def apply(units: list[Any], loaded: Loaded) -> None:
    """Replace every unit's residuals with what :func:`prepare` found (and warn what it
    dropped)."""
    for unit in units:
        unit.errors = unit.feedbacks = None
    for unit, k, piece in loaded.residuals:
        if not k.isdigit():
            series, _, part = k.rpartition("-")
            if unit.feedbacks is None:
                unit.feedbacks = {}
            setattr(unit.feedbacks.setdefault(series, Feedback()), part,
                    np.array(piece, dtype=np.float32, copy=True))
            continue
        if unit.errors is None:
            unit.errors = {}
        unit.errors[int(k)] = np.array(piece, dtype=unit.dtype, copy=True)
    for message in loaded.warnings:
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def load(units: list[Any], saved: dict[str, Any], world: int, rank: int) -> None:
    """Replace every unit's residuals with the saved ones: :func:`prepare`, then :func:`apply`
    (nothing is changed when it raises)."""
    apply(units, prepare(units, saved, world, rank))


__all__ = ["PREFIX", "WORLD_KEY", "Loaded", "apply", "load", "prepare", "save", "split"]
