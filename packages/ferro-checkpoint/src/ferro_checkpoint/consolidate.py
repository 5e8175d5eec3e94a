"""``consolidate``: one full safetensors file from a sharded checkpoint, tensor by tensor."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CheckpointIOError
from .layout import METADATA, fsync_dir
from .load import VerifiedShards, assemble, open_checkpoint
from .safetensors_io import code_dtype, write_safetensors


def consolidate(directory, output_file) -> None:
    """Write every full tensor of the checkpoint in ``directory`` to ``output_file``.

    The result is a plain safetensors file any reader opens (``safetensors.numpy.load_file``,
    a Hugging Face loader). Tensors are assembled and written one at a time, so memory stays at
    about the largest tensor; the file appears atomically (temp file, fsync, rename).
    """
    ckpt = open_checkpoint(directory)
    specs = ckpt.shard_metadata.tensor_specs
    names = sorted(specs)
    shards = VerifiedShards(ckpt)
    shards.open_all()  # every header checked against metadata.json before writing anything
    for n in names:
        code_dtype(specs[n].dtype, f"{ckpt.checkpoint_dir / METADATA}: tensor {n!r}")
    out = Path(output_file)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        write_safetensors(tmp, [(n, specs[n].dtype, specs[n].full_shape) for n in names],
                          lambda n: assemble(shards, n, 1, 0),
                          {"format": "np", "ferro.checkpoint_id": ckpt.checkpoint_id})
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        os.replace(tmp, out)
        fsync_dir(out.parent if str(out.parent) else Path("."))
    except OSError as exc:
        raise CheckpointIOError(f"consolidate: cannot write {out}: {exc}") from exc
