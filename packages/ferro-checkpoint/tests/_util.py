import numpy as np

from ferro_checkpoint import ShardMetadata, TensorShardSpec, compute_shard_sizes, save_distributed


def spec_for(full: dict, world: int, dims: dict | None = None) -> ShardMetadata:
    dims = dims or {}
    return ShardMetadata(world, {
        k: TensorShardSpec(v.shape, dims.get(k, 0),
                           compute_shard_sizes(v.shape[dims.get(k, 0)], world))
        for k, v in full.items()})


def shards_of(full: dict, spec: ShardMetadata, rank: int) -> dict:
    out = {}
    for k, v in full.items():
        s = spec.tensor_specs[k]
        idx = [slice(None)] * v.ndim
        idx[s.shard_dim] = slice(s.start(rank), s.start(rank) + s.shard_sizes[rank])
        out[k] = np.ascontiguousarray(v[tuple(idx)])
    return out


def save_all(full: dict, directory, world: int, dims=None, **kwargs) -> ShardMetadata:
    spec = spec_for(full, world, dims)
    for r in range(world):
        save_distributed(shards_of(full, spec, r), directory, r, world, spec, **kwargs)
    return spec
