"""``consolidate``: one full safetensors file from a sharded checkpoint, tensor by tensor."""

from __future__ import annotations

import os
from pathlib import Path

from .copy_plan import read_tensors
from .errors import CheckpointIOError, InvalidArgumentError, TensorError
from .layout import METADATA, fsync_dir, remove_quietly
from .load import open_checkpoint, shards_of
from .read_options import resolve_threads, resolve_verify
from .safetensors_io import code_dtype, write_safetensors


def consolidate(directory, output_file, *, verify: bool | None = None,
                threads: int | None = None) -> None:
    """Write every full tensor of the checkpoint in ``directory`` to ``output_file``.

    The result is a plain safetensors file any reader opens (``safetensors.numpy.load_file``,
    a Hugging Face loader). Tensors are assembled and written one at a time, so memory stays at
    about the largest tensor; the file appears atomically (temp file, fsync, rename).

    Every shard's header (save identity, shapes, dtypes) is checked before anything is written,
    and each tensor's checksums unless ``verify`` is off (as :func:`load_distributed`). Raises its
    errors (ShardMismatchError, ChecksumMismatchError...); ``output_file`` is then not created.

    Parameters
    ----------
    directory : str or os.PathLike
        The checkpoint directory (any world size).
    output_file : str or os.PathLike
        The safetensors file to write (replaced if it exists); its directory must exist.
    verify : bool, optional
        Check the checksums of every byte read: None (the default) or True; False skips it.
    threads : int, optional
        Kernel threads per tensor, as :func:`load_distributed`.

    Raises
    ------
    MetadataError
        No committed checkpoint in ``directory``, or a malformed metadata.json.
    MissingShardError
        ``directory`` or a shard file does not exist.
    ShardMismatchError
        A shard of another save (names the file and both identities).
    SerializationError
        A corrupt or truncated shard.
    ChecksumMismatchError
        A tensor's bytes do not match their checksum (names the file, tensor and bytes).
    TensorError
        A shard's tensors, shapes or dtypes differ from metadata.json's.
    InvalidArgumentError
        ``verify`` is not True, False or None.
    CheckpointIOError
        A shard cannot be read, or ``output_file`` cannot be written.

    Examples
    --------
    >>> consolidate("ckpt/step_100", "model.safetensors")
    >>> from safetensors.numpy import load_file
    >>> full = load_file("model.safetensors")  # every tensor whole
    """
    verify = resolve_verify(verify, "consolidate")
    threads = resolve_threads(threads, "consolidate")
    ckpt = open_checkpoint(directory)
    specs = ckpt.shard_metadata.tensor_specs
    names = sorted(specs)
    shards = shards_of(ckpt, verify)
    shards.open_all()  # every header checked against metadata.json before writing anything
    codes = {}
    for n in names:  # an old metadata.json may lack dtypes: the shards' headers have them
        found = {f.entries[n][0] for f in shards.files.values()}
        if specs[n].dtype is None and len(found) != 1:
            raise TensorError(f"consolidate: tensor {n!r} has dtypes {sorted(found)} in the "
                              f"shards of {ckpt.checkpoint_dir}, expected one")
        codes[n] = specs[n].dtype or found.pop()
        code_dtype(codes[n], f"{ckpt.checkpoint_dir / METADATA}: tensor {n!r}")
    out = Path(output_file)
    if not out.name or out.name in (".", ".."):  # (Path("") is "."; with_name would refuse it)
        raise InvalidArgumentError(f"consolidate: output_file {output_file!r} names no file")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        write_safetensors(tmp, [(n, codes[n], specs[n].full_shape) for n in names],
                          lambda n: read_tensors(shards, [n], 1, 0, threads=threads)[n],
                          {"format": "np", "ferro.checkpoint_id": ckpt.checkpoint_id},
                          checksums=False)
    except BaseException:
        remove_quietly(tmp)  # (an error of its own, EROFS say, must not replace this one)
        raise
    try:
        os.replace(tmp, out)
    except OSError as exc:  # (a directory there, say): the model-sized temp file goes too
        remove_quietly(tmp)
        raise CheckpointIOError(f"consolidate: cannot write {out}: {exc}") from exc
    try:
        fsync_dir(out.parent if str(out.parent) else Path("."))
    except OSError as exc:
        raise CheckpointIOError(f"consolidate: cannot write {out}: {exc}") from exc
