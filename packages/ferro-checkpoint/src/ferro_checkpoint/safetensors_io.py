"""Reading and writing safetensors files, streamed and durable (no safetensors library).

The writer produces standard safetensors (8-byte little-endian header length, JSON header with
``dtype``/``shape``/``data_offsets`` and string ``__metadata__``, then the tensors' bytes), readable
unchanged by ``safetensors.numpy.load_file``; it writes tensor by tensor (no whole-state-dict
buffer) and, in the same pass, checksums each chunk of each tensor (``_copy_crc.write_chunks``:
a chunk is checksummed, then written while it is in the cache). The checksums go into the
header, which is written first with placeholders of the same length and rewritten in place
before the fsync. The reader validates the header against the file size and maps the file, so
tensors are zero-copy views and a reshard reads only the rows it needs. The package README says
why this is hand-written rather than built on the safetensors library.

This module also names ferro's header keys (``ferro.*`` in ``__metadata__``); ``checksums.py``
says what the checksum keys mean to a load.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from . import _copy_crc
from .errors import CheckpointIOError, SerializationError, TensorError

try:
    import ml_dtypes as _ml

    _BF16: np.dtype | None = np.dtype(_ml.bfloat16)
except ImportError:  # pragma: no cover
    _BF16 = None

_CODES = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.float64): "F64",
          np.dtype(np.int8): "I8", np.dtype(np.int16): "I16", np.dtype(np.int32): "I32",
          np.dtype(np.int64): "I64", np.dtype(np.uint8): "U8", np.dtype(np.uint16): "U16",
          np.dtype(np.uint32): "U32", np.dtype(np.uint64): "U64", np.dtype(np.bool_): "BOOL"}
if _BF16 is not None:
    _CODES[_BF16] = "BF16"
_DTYPES = {v: k for k, v in _CODES.items()}
MAX_HEADER = 100 << 20
EXTRA_KEY = "ferro.extra"  # header ``__metadata__`` key of a rank's JSON ``extra`` (optional)
EXTRA_CRC_KEY = "ferro.extra_crc32"  # its CRC-32 (hex), where ``extra`` is saved


def extra_crc(text: str) -> str:
    """The checksum ``EXTRA_CRC_KEY`` holds for an ``extra``'s JSON text: the tensors' CRCs do
    not cover the header, and a flipped bit there (an RNG state, a data position) was returned
    by ``restore()`` as it was."""
    return format(zlib.crc32(text.encode()), "08x")
CHECKPOINT_ID_KEY = "ferro.checkpoint_id"  # the save's id, shared by its ranks
SHARD_ID_KEY = "ferro.shard_id"  # the random id of this shard of this save (metadata shard_ids)
CHUNK = 1 << 20  # bytes per checksummed chunk of a tensor (format 2)
SCHEME_KEY = "ferro.checksum"  # format 2: "crc32c/<chunk>" (checksums.py)
CRC32C_PREFIX = "ferro.crc32c."  # format 2: each chunk's CRC-32C, 8 hex digits each
CRC32_PREFIX = "ferro.crc32."  # format 1: zlib crc32 of the whole tensor


def dtype_code(dtype: np.dtype, name: str = "") -> str:
    dtype = np.dtype(dtype).newbyteorder("=") if np.dtype(dtype).byteorder in "<>" else \
        np.dtype(dtype)
    try:
        return _CODES[dtype]
    except KeyError:
        raise TensorError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors "
                          f"(supported: {sorted(_CODES.values())})") from None


def code_dtype(code: str, where: str) -> np.dtype:
    try:
        return _DTYPES[code]
    except KeyError:
        hint = " (install ml_dtypes for BF16)" if code == "BF16" else ""
        raise TensorError(f"{where}: dtype {code!r} is not supported here{hint}") from None


def little_endian(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not np.little_endian):
        a = a.astype(a.dtype.newbyteorder("<"))
    return a


def num_chunks(nbytes: int, chunk: int) -> int:
    """Checksummed chunks of a tensor of ``nbytes`` bytes (an empty tensor has one, empty)."""
    return max(1, -(-nbytes // chunk))


def to_hex(crcs: np.ndarray) -> str:
    """Chunk checksums as a header stores them: 8 hex digits each, in order."""
    return np.asarray(crcs, dtype=">u4").tobytes().hex()


def tensor_bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, as a flat uint8 view."""
    return a.reshape(-1).view(np.uint8)


def _header(entries, metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, code, shape in entries:
        nbytes = math.prod(shape) * code_dtype(code, name).itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset,
                                                                               offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _write_all(fd: int, data: bytes, offset: int | None = None) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        view = view[n:]
        if offset is not None:
            offset += n


def write_safetensors(path: Path, entries: Iterable[tuple[str, str, tuple[int, ...]]],
                      produce, metadata: dict[str, str] | None = None, *,
                      checksums: bool = True) -> None:
    """Write ``path`` durably. ``entries`` lists (name, dtype code, shape) in file order;
    ``produce(name)`` returns each tensor's array when its turn comes (tensor by tensor).
    With ``checksums`` (the default) the header records the format-2 checksums of every
    :data:`CHUNK` bytes, computed in the pass that writes them (not for a consolidated file)."""
    entries = list(entries)
    crc_chunk = CHUNK if checksums else 0
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    sizes = {name: math.prod(shape) * code_dtype(code, name).itemsize
             for name, code, shape in entries}
    if crc_chunk:
        meta[SCHEME_KEY] = f"crc32c/{crc_chunk}"
        for name, _, _ in entries:  # placeholders, as long as the checksums will be
            meta[CRC32C_PREFIX + name] = "0" * 8 * num_chunks(sizes[name], crc_chunk)
    raw = _header(entries, meta)
    if len(raw) > MAX_HEADER:  # (no reader would open it: refused before a byte is written)
        big = max(meta.items(), key=lambda kv: len(kv[1]))
        raise SerializationError(f"{path}: its header would be {len(raw)} bytes, over the "
                                 f"{MAX_HEADER}-byte limit of safetensors readers ({len(entries)} "
                                 f"tensors; the largest metadata entry, {big[0]!r}, is "
                                 f"{len(big[1])} characters: a large extra= belongs in a "
                                 "tensor)")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                     0o666)
    except OSError as exc:
        raise CheckpointIOError(f"writing {path}: {exc}") from exc
    try:
        _write_all(fd, struct.pack("<Q", len(raw)) + raw)
        for name, code, shape in entries:
            a = little_endian(np.asarray(produce(name)))
            if tuple(a.shape) != tuple(shape) or dtype_code(a.dtype, name) != code:
                raise TensorError(f"{path}: tensor {name!r} is {a.dtype}{a.shape}, the "
                                  f"header says {code}{tuple(shape)}")
            crcs = np.empty(num_chunks(sizes[name], crc_chunk) if crc_chunk else 0, np.uint32)
            err = _copy_crc.write_chunks(fd, tensor_bytes(a), crcs, crc_chunk or CHUNK)
            if err:
                raise OSError(err, os.strerror(err))
            if crc_chunk:
                meta[CRC32C_PREFIX + name] = to_hex(crcs)
        if crc_chunk:
            final = _header(entries, meta)
            if len(final) != len(raw):  # pragma: no cover - hex digits replace hex digits
                raise SerializationError(f"{path}: the header changed length when its "
                                         "checksums were filled in")
            _write_all(fd, final, 8)
        os.fsync(fd)
    except OSError as exc:
        raise CheckpointIOError(f"writing {path}: {exc}") from exc
    finally:
        os.close(fd)


class SafetensorsFile:
    """A validated, memory-mapped safetensors file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise CheckpointIOError(f"opening {self.path}: {exc}") from exc
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise SerializationError(f"{self.path}: truncated: {size} bytes, not even a "
                                         "safetensors header length")
            (hlen,) = struct.unpack("<Q", f.read(8))
            if hlen > min(size - 8, MAX_HEADER):
                raise SerializationError(f"{self.path}: header claims {hlen} bytes, the file "
                                         f"has {size} (truncated or not safetensors)")
            try:
                header = json.loads(f.read(hlen))
            except (ValueError, UnicodeDecodeError, RecursionError) as exc:
                raise SerializationError(f"{self.path}: corrupt header: {exc}") from exc
            if not isinstance(header, dict):
                raise SerializationError(f"{self.path}: corrupt header: a JSON "
                                         f"{type(header).__name__}, not an object")
            meta = header.pop("__metadata__", None) or {}
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise SerializationError(f"{self.path}: corrupt header: __metadata__ must map "
                                         "strings to strings")
            self.metadata: dict[str, str] = meta
            self.data_start = 8 + hlen
            self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {
                name: self._entry(name, e) for name, e in header.items()}
            end = 0
            for name, (_, _, s, t) in sorted(self.entries.items(), key=lambda kv: kv[1][2:]):
                if s < end and s < t:
                    raise SerializationError(f"{self.path}: tensor {name!r}'s bytes [{s}, {t}) "
                                             f"overlap another tensor's (which end at {end})")
                end = max(end, t)
            if self.data_start + end > size:
                raise SerializationError(f"{self.path}: truncated: tensors need "
                                         f"{self.data_start + end} bytes, the file has {size}")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def _entry(self, name: str, e) -> tuple[str, tuple[int, ...], int, int]:
        """One header entry, checked: dtype a string, shape and offsets non-negative ints,
        ``begin <= end``, and (for a known dtype) exactly the bytes the shape needs."""
        def ints(v) -> bool:
            return isinstance(v, list) and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)

        if not isinstance(e, dict):
            raise SerializationError(f"{self.path}: corrupt header entry {name!r}: {e!r:.80}")
        code, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(code, str) or not ints(shape) or not ints(offsets) \
                or len(offsets) != 2 or offsets[0] > offsets[1]:
            raise SerializationError(
                f"{self.path}: corrupt header entry {name!r}: dtype {code!r:.40}, shape "
                f"{shape!r:.80}, data_offsets {offsets!r:.80} (need a dtype string, non-negative "
                "integer dims and offsets [begin, end] with begin <= end)")
        s, t = offsets
        dtype = _DTYPES.get(code)
        if dtype is not None and t - s != math.prod(shape) * dtype.itemsize:
            raise SerializationError(f"{self.path}: tensor {name!r} has {t - s} bytes for "
                                     f"shape {tuple(shape)} of {code}")
        return code, tuple(shape), s, t

    def tensor(self, name: str) -> np.ndarray:
        """A zero-copy read-only view of tensor ``name``."""
        try:
            code, shape, s, t = self.entries[name]
        except KeyError:
            raise TensorError(f"{self.path}: no tensor {name!r}") from None
        dtype = code_dtype(code, f"{self.path}: tensor {name!r}")
        count = math.prod(shape)
        if (t - s) != count * dtype.itemsize:
            raise SerializationError(f"{self.path}: tensor {name!r} has {t - s} bytes for "
                                     f"shape {shape} of {code}")
        if count == 0:
            return np.empty(shape, dtype=dtype)
        wire = dtype if np.little_endian else dtype.newbyteorder("<")
        return np.frombuffer(self._map, dtype=wire, count=count,
                             offset=self.data_start + s).reshape(shape)

    def raw(self, name: str) -> np.ndarray:
        """The bytes of tensor ``name`` (a name in :attr:`entries`) in the file: a read-only
        zero-copy uint8 view."""
        _, _, s, t = self.entries[name]
        if t == s:
            return np.empty(0, np.uint8)
        return np.frombuffer(self._map, np.uint8, t - s, self.data_start + s)
