"""How :class:`~ferro_fsdp.FSDP` splits parameters, gradients and optimizer state across ranks."""

from __future__ import annotations

import enum


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
    """

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    HYBRID_SHARD = "hybrid_shard"

    @classmethod
    def coerce(cls, value: ShardingStrategy | str) -> ShardingStrategy:
        """A member, or its name / value in any case (``"full_shard"``, ``"FULL_SHARD"``)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().upper().replace("-", "_")
            if key in cls.__members__:
                return cls[key]
        names = ", ".join(m.name for m in cls)
        raise ValueError(f"ShardingStrategy: unknown strategy {value!r}, expected one of {names}")

    @property
    def shards_params(self) -> bool:
        """True where a rank keeps only a chunk of each parameter between steps."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


__all__ = ["ShardingStrategy"]
