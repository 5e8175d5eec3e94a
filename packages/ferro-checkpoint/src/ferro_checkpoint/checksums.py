"""Checksums of the tensors in a shard: the schemes a shard header can record, and what a load
checks against.

Schemes, by the keys of the shard's safetensors ``__metadata__``:

- **format 2** (written since 0.2): ``"ferro.checksum": "crc32c/<chunk>"``. The bytes of every
  tensor are cut into chunks of ``<chunk>`` bytes (1 MiB; the last one shorter, an empty
  tensor has one empty chunk) and ``"ferro.crc32c.<name>"`` holds each chunk's CRC-32C
  (Castagnoli, RFC 3720's) as 8 hex digits, concatenated in order. A load reads each chunk once:
  the same pass folds it into its checksum and copies the bytes a rank needs (``_copy_crc``), and
  a reshard reads only the chunks that hold the rows it needs.
- **format 1**: ``"ferro.crc32.<name>"``: zlib's crc32 of the whole tensor, 8 hex digits; still
  verified (with zlib, over whole tensors).
- **before checksums**: neither, and no shard id: such a shard loads unchecked.

A format-2 checkpoint (``metadata.json`` ``format_version`` 2) accepts only format-2 shards, so
a shard cannot lose its checksums to a downgrade; a shard with a shard id or any checksum key
must have one for every tensor it holds.
"""

from __future__ import annotations

import re
import zlib

import numpy as np

from .errors import ChecksumMismatchError
from .safetensors_io import (
    CRC32_PREFIX,
    CRC32C_PREFIX,
    SCHEME_KEY,
    SHARD_ID_KEY,
    num_chunks,
)

_SCHEME_RE = re.compile(r"crc32c/([1-9][0-9]{0,11})")
_HEX_RE = re.compile(r"[0-9a-f]*")


def from_hex(text: str) -> np.ndarray:
    """Chunk checksums from their stored form (8 hex digits each; the caller checked it)."""
    return np.frombuffer(bytes.fromhex(text), dtype=">u4").astype(np.uint32)


class ShardChecksums:
    """What one shard's header records: ``kind`` is ``"crc32c"`` (format 2, per chunk of
    ``chunk`` bytes), ``"crc32"`` (format 1, per tensor) or None (a shard from before checksums).

    Parameters
    ----------
    path : str or os.PathLike
        The shard file (named in errors).
    metadata : dict of str to str
        Its header's ``__metadata__``.
    require_crc32c : bool
        The checkpoint is format 2: anything but the format-2 scheme is refused.

    Raises
    ------
    ChecksumMismatchError
        A malformed ``ferro.checksum``, or a format-2 checkpoint's shard without it.
    """

    def __init__(self, path, metadata: dict[str, str], require_crc32c: bool) -> None:
        self.path = path
        self.metadata = metadata
        self.chunk = 0
        value = metadata.get(SCHEME_KEY)
        if value is not None:
            m = _SCHEME_RE.fullmatch(value)
            if m is None:
                raise ChecksumMismatchError(f"{path}: checksum scheme {value!r:.60} is not "
                                            "supported (this reads crc32c/<chunk bytes>)")
            self.kind: str | None = "crc32c"
            self.chunk = int(m.group(1))
        elif require_crc32c:
            raise ChecksumMismatchError(f"{path}: the shard records no crc32c checksums "
                                        f"({SCHEME_KEY} missing), though metadata.json is "
                                        "format 2; refusing it")
        elif SHARD_ID_KEY in metadata or any(k.startswith(CRC32_PREFIX) for k in metadata):
            self.kind = "crc32"
        else:
            self.kind = None

    def _missing(self, name: str) -> ChecksumMismatchError:
        return ChecksumMismatchError(f"{self.path}: tensor {name!r} has no checksum, though the "
                                     "shard records checksums")

    def chunk_crcs(self, name: str, nbytes: int) -> np.ndarray:
        """The recorded CRC-32C of each chunk of tensor ``name`` (``nbytes`` long); format 2."""
        text = self.metadata.get(CRC32C_PREFIX + name)
        if text is None:
            raise self._missing(name)
        n = num_chunks(nbytes, self.chunk)
        if len(text) != 8 * n or not _HEX_RE.fullmatch(text):
            raise ChecksumMismatchError(
                f"{self.path}: tensor {name!r}'s checksums are malformed: {len(text)} "
                f"characters, expected {8 * n} hex digits ({n} chunks of {self.chunk} bytes)")
        return from_hex(text)

    def check_crc32(self, name: str, data: np.ndarray) -> None:
        """Format 1: raise unless zlib's crc32 of ``data`` (the whole tensor, bytes) matches."""
        want = self.metadata.get(CRC32_PREFIX + name)
        if want is None:
            raise self._missing(name)
        got = f"{zlib.crc32(memoryview(data)):08x}"
        if got != want:
            raise ChecksumMismatchError(f"{self.path}: tensor {name!r} is corrupt (crc32 {got}, "
                                        f"expected {want})")

    def mismatch(self, name: str, nbytes: int, first: int, got: np.ndarray,
                 want: np.ndarray) -> None:
        """Raise unless ``got`` equals ``want``: the CRC-32C of chunks ``first``,
        ``first + 1``... of tensor ``name``; the error names the first bad chunk's bytes."""
        bad = np.flatnonzero(got != want)
        if bad.size == 0:
            return
        i = int(bad[0])
        lo = (first + i) * self.chunk
        hi = min(lo + self.chunk, nbytes)
        raise ChecksumMismatchError(
            f"{self.path}: tensor {name!r} is corrupt: bytes [{lo}, {hi}) (chunk {first + i} "
            f"of {num_chunks(nbytes, self.chunk)}) have crc32c {int(got[i]):08x}, expected "
            f"{int(want[i]):08x}" + (f" ({bad.size} chunks differ)" if bad.size > 1 else ""))
