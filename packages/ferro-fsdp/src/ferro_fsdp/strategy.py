"""How :class:`~ferro_fsdp.FSDP` splits parameters, gradients and optimizer state across ranks."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ShardingStrategy(enum.Enum):
    """torch's ``ShardingStrategy``, with the same four members.

    FULL_SHARD
        ZeRO-3: each rank keeps one chunk of every parameter (and so of its gradient and optimizer
        state); ``forward``/``backward`` all-gather the full parameters and free them again.
    SHARD_GRAD_OP
        ZeRO-2: parameters stay full on every rank; ``sync_gradients`` reduce-scatters, so a rank's
        gradient is full-shape with only its chunk filled, and ``broadcast_updated_params``
        re-syncs the parameters after the optimizer step.
    NO_SHARD
        DDP: full parameters, gradients mean-allreduced.
    HYBRID_SHARD
        FULL_SHARD inside a node of ``intra_node_size`` ranks, replicated across nodes: intra-node
        all-gather / reduce-scatter, then an inter-node allreduce of the gradient shard.

    Parameters
    ----------
    value : str or ShardingStrategy
        ``ShardingStrategy("full_shard")`` is ``ShardingStrategy.FULL_SHARD`` (ValueError for an
        unknown value; :meth:`coerce` also takes names in any case).
    names, module, qualname, type, start, boundary
        :class:`enum.Enum`'s functional API; not used by ferro.
    """

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    HYBRID_SHARD = "hybrid_shard"

    @classmethod
    def coerce(cls, value: ShardingStrategy | str) -> ShardingStrategy:
        """A member, or its name / value in any case (``"full_shard"``, ``"FULL_SHARD"``).

        Parameters
        ----------
        value : ShardingStrategy or str
            A member, or a name or value (``-`` read as ``_``).

        Returns
        -------
        ShardingStrategy

        Raises
        ------
        ValueError
            Not a strategy.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().upper().replace("-", "_")
            if key in cls.__members__:
                return cls[key]
        names = ", ".join(m.name for m in cls)
        raise ValueError(f"ShardingStrategy: unknown strategy {value!r}, expected one of {names}")

    @property
    def spec(self) -> StrategySpec:
        """What this strategy does, as data (the table ``ferro_fsdp.strategy.SPECS``)."""
        return SPECS[self]

    @property
    def shards_params(self) -> bool:
        """True where a rank keeps only a chunk of each parameter between steps."""
        return SPECS[self].shards_params


@dataclass(frozen=True)
class StrategySpec:
    """Everything :class:`~ferro_fsdp.FSDP` does differently per strategy, in one place.

    Parameters
    ----------
    shards_params : bool
        A rank keeps only its chunk of each parameter between steps (gathered to run, then
        freed: torch's reshard_after_forward).
    shard_group : {"world", "intra"} or None
        The ranks a parameter's chunks are spread over: ``"world"``, ``"intra"`` (the ranks of
        this rank's node, HYBRID_SHARD) or None (no chunks: full parameters everywhere).
    grad_reduce : {"reduce_scatter", "allreduce"}
        How ``sync_gradients`` averages the flat gradient over ``shard_group``:
        ``"reduce_scatter"`` (each rank gets its chunk) or ``"allreduce"`` (everyone gets all).
    replicate_group : {"inter"} or None
        A group the gradient chunk is then mean-allreduced over (``"inter"``: the ranks with the
        same chunk on other nodes), or None.
    grad_form : {"chunk", "scattered", "full"}
        ``module.<p>.grad`` after the sync: ``"chunk"`` (this rank's padded chunk), ``"scattered"``
        (full shape, zero outside this rank's chunk) or ``"full"``.
    regather_after_step : bool
        Parameters stay full but were updated chunk-wise: ``broadcast_updated_params`` all-gathers
        them after the optimizer step.
    """

    shards_params: bool
    shard_group: str | None
    grad_reduce: str
    replicate_group: str | None
    grad_form: str
    regather_after_step: bool


SPECS: dict[ShardingStrategy, StrategySpec] = {
    ShardingStrategy.FULL_SHARD: StrategySpec(True, "world", "reduce_scatter", None, "chunk",
                                              False),
    ShardingStrategy.HYBRID_SHARD: StrategySpec(True, "intra", "reduce_scatter", "inter",
                                                "chunk", False),
    ShardingStrategy.SHARD_GRAD_OP: StrategySpec(False, "world", "reduce_scatter", None,
                                                 "scattered", True),
    ShardingStrategy.NO_SHARD: StrategySpec(False, None, "allreduce", None, "full", False),
}


__all__ = ["SPECS", "ShardingStrategy", "StrategySpec"]
