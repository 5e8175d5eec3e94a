"""Peak memory of a 4 -> 8 reshard of a 256 MiB checkpoint stays under 2x the new shard."""

import tracemalloc

import numpy as np
import pytest

from ferro_checkpoint import ShardMetadata, TensorShardSpec, compute_shard_sizes, reshard, save_distributed


@pytest.mark.timeout(180)
def test_reshard_4_to_8_memory_is_bounded(tmp_path):
    n_tensors, rows, cols = 16, 1024, 4096  # 16 x 16 MiB float32 = 256 MiB
    spec = ShardMetadata(4, {f"t{i}": TensorShardSpec((rows, cols), 0,
                                                      compute_shard_sizes(rows, 4))
                             for i in range(n_tensors)})
    for r in range(4):
        sd = {f"t{i}": np.full((rows // 4, cols), i * 10 + r, np.float32)
              for i in range(n_tensors)}
        save_distributed(sd, tmp_path, r, 4, spec, checkpoint_id="mem")
        del sd
    new_shard_bytes = n_tensors * (rows // 8) * cols * 4  # 32 MiB
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out = reshard(tmp_path, 4, 8, 3)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert sum(v.nbytes for v in out.values()) == new_shard_bytes
    assert out["t5"][0, 0] == 51  # new rank 3 = second half of old rank 1
    assert peak < 2 * new_shard_bytes, f"peak {peak / 2**20:.1f} MiB"
    print(f"reshard 4->8 of 256 MiB: peak {peak / 2**20:.1f} MiB, new shard "
          f"{new_shard_bytes / 2**20:.0f} MiB")
