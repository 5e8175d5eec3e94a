"""Allreduce of sparse COO tensors with gloo's result.

gloo coalesces each rank's tensor, gathers every rank's indices and values to every rank and
adds them up; so does this, over ferro's all_gather: first each rank's shape and number of
nonzeros (the shapes must agree), then the indices and the values padded to the largest count.
The tensor is replaced in place by the coalesced sum, as gloo replaces it.
"""

from __future__ import annotations

import numpy as np
import torch

import ferro_collective as fc
from ferro_backend import Backend

from ._convert import BFLOAT16, flat


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The numpy array ``a`` (ferro's view of a ``dtype`` tensor) as a torch tensor."""
    if a.dtype == BFLOAT16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a).to(dtype)


def sparse_allreduce(t: torch.Tensor, b: Backend, timeout: float | None) -> None:
    """Sum the sparse COO tensor ``t`` over the ranks of ``b``, in place."""
    x = t.detach().coalesce()
    n = b.world_size
    sparse_dim, dense_shape = x.sparse_dim(), tuple(x.shape[x.sparse_dim():])
    meta = np.array([x._nnz(), sparse_dim, *x.shape], dtype=np.int64)
    metas = fc.all_gather(meta, b, timeout=timeout).reshape(n, -1)
    if (metas[:, 1:] != meta[1:]).any():
        shapes = [f"rank {r}: {list(m[2:])} ({m[1]} sparse dims)" for r, m in enumerate(metas)]
        raise ValueError(f"allreduce: sparse tensors of different shapes: {', '.join(shapes)}")
    counts = [int(c) for c in metas[:, 0]]
    most = max(counts)
    idx = torch.zeros((sparse_dim, most), dtype=torch.int64)
    idx[:, :counts[b.rank]] = x.indices()
    vals = torch.zeros((most, *dense_shape), dtype=x.dtype)
    vals[:counts[b.rank]] = x.values()
    all_idx = _tensor(fc.all_gather(flat(idx), b, timeout=timeout), torch.int64)
    all_vals = _tensor(fc.all_gather(flat(vals), b, timeout=timeout), x.dtype)
    all_idx = all_idx.reshape(n, sparse_dim, most)
    all_vals = all_vals.reshape(n, most, *dense_shape)
    indices = torch.cat([all_idx[r, :, :c] for r, c in enumerate(counts)], dim=1)
    values = torch.cat([all_vals[r, :c] for r, c in enumerate(counts)])
    total = torch.sparse_coo_tensor(indices, values, x.shape, dtype=x.dtype).coalesce()
    with torch.no_grad():
        t.copy_(total)


__all__ = ["sparse_allreduce"]
