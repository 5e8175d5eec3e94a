"""Bus bandwidth as nccl-tests defines it: the one home of the factors every benchmark uses.

allreduce moves ``S * 2(n-1)/n`` bytes per rank, all_gather and reduce_scatter ``S * (n-1)/n``
(S the gathered/reduced total), broadcast ``S``; a barrier moves nothing.
"""

from __future__ import annotations


def busbw_factor(op: str, n: int) -> float:
    """Bytes each rank moves per byte of the collective's size, for ``n`` ranks."""
    ring = (n - 1) / n
    factors = {"allreduce": 2 * ring, "all_gather": ring, "reduce_scatter": ring,
               "broadcast": 1.0, "barrier": 0.0}
    if op not in factors:
        raise ValueError(f"busbw_factor: unknown collective {op!r}; expected one of "
                         f"{sorted(factors)}")
    return factors[op]


def busbw(op: str, nbytes: int, n: int, seconds: float) -> float:
    """Bus bandwidth in GB/s of one call of ``op`` on ``nbytes`` that took ``seconds``."""
    return nbytes * busbw_factor(op, n) / seconds / 1e9 if seconds > 0 else 0.0
