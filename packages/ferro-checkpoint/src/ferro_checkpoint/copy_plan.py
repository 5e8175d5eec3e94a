"""Reading tensors out of shard files: the bytes each new tensor needs, read once (copied, or
mapped) and checked in the same pass, spread over a few threads.

A new rank's shard of a tensor takes rows ``[lo, hi)`` along ``shard_dim``; old shard ``r`` holds
some of them, as ``outer`` runs of bytes (one run when ``shard_dim`` is 0, or when the whole old
shard is read). A :class:`Part` is those runs in one shard file. Reading it is one call of the
``_copy_crc`` kernel on a window of whole checksummed chunks (format 2): every byte of the window
is folded into its chunk's CRC-32C and the needed ones are copied in the same pass. A reshard
thus reads only the chunks holding its rows (plus, at each end, the rest of a chunk, at most
1 MiB). Format-1 shards (one zlib crc32 per tensor) are checked over the whole tensor first;
shards from before checksums are copied unchecked. All validation of the kernel's input is
here (:func:`_check_part`); the kernel assumes it.

Results are new arrays (by default one allocation for all of a load's tensors, so the pages are
faulted in as huge pages where the kernel offers them), the caller's arrays (``out``), or with
``mmap`` read-only views of the files themselves, verified up front or, with ``lazy``, when a
tensor is first looked up.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from . import _copy_crc
from .checksums import ShardChecksums
from .errors import TensorError
from .metadata import ShardMetadata
from .safetensors_io import SafetensorsFile, code_dtype, num_chunks, tensor_bytes

STREAM_MIN = 16 << 20  # loads at least this large store past the caches (non-temporal)
THREAD_MIN = 16 << 20  # loads smaller than this run on the calling thread alone
PIECE_MIN = 1 << 20  # bytes: threads take the work in pieces of at least this
_ALIGN = 64  # byte alignment of each tensor in a load's one allocation
_PAGE = 4096
_NO_CRCS = np.empty(0, np.uint32)


class VerifiedShards:
    """The shard files one load reads, each opened once through ``open_shard`` (which checks
    it against metadata.json), with what its header records about checksums."""

    def __init__(self, md: ShardMetadata, open_shard: Callable[[int], SafetensorsFile],
                 verify: bool = True) -> None:
        self.md = md
        self.verify = verify
        self._open = open_shard
        self.files: dict[int, SafetensorsFile] = {}
        self._sums: dict[int, ShardChecksums] = {}

    def file(self, rank: int) -> SafetensorsFile:
        f = self.files.get(rank)
        if f is None:
            f = self.files[rank] = self._open(rank)
        return f

    def open_all(self) -> None:
        """Open (and check against metadata.json) every rank's shard now."""
        for r in range(self.md.num_ranks):
            self.file(r)

    def sums(self, rank: int) -> ShardChecksums:
        s = self._sums.get(rank)
        if s is None:
            f = self.file(rank)
            s = self._sums[rank] = ShardChecksums(f.path, f.metadata,
                                                  self.md.format_version >= 2)
        return s


@dataclass(eq=False)
class Part:
    """The runs of bytes of old shard ``rank``'s tensor ``name`` that a new tensor needs: run
    ``o`` is ``src[o*src_row + src_off:][:run]``, for ``dst[o*dst_row + dst_off:][:run]``; the
    window ``[lo, hi)`` of ``src`` is read (whole chunks when ``want`` holds their checksums)."""

    shards: VerifiedShards
    rank: int
    name: str
    src: np.ndarray  # the old tensor's bytes in the file (uint8, zero-copy)
    outer: int
    src_row: int
    dst_row: int
    src_off: int
    dst_off: int
    run: int
    lo: int
    hi: int
    first_chunk: int = 0
    want: np.ndarray = field(default_factory=lambda: _NO_CRCS)  # recorded chunk CRC-32C
    got: np.ndarray = field(default_factory=lambda: _NO_CRCS)  # computed by the read
    whole_crc32: bool = False  # format 1: check zlib's crc32 of the whole tensor first

    def contiguous(self) -> bool:
        return self.outer == 1 or (self.src_off == 0 and self.run == self.src_row)

    def verify_whole(self) -> None:
        if self.whole_crc32:
            self.shards.sums(self.rank).check_crc32(self.name, self.src)
            self.whole_crc32 = False

    def check(self) -> None:
        """Raise ChecksumMismatchError unless every chunk read matched its record."""
        if self.want.size:
            self.shards.sums(self.rank).mismatch(self.name, self.src.size, self.first_chunk,
                                                 self.got, self.want)


def plan(shards: VerifiedShards, name: str, new_world: int,
         new_rank: int) -> tuple[tuple[int, ...], np.dtype, list[Part]]:
    """Shape, dtype and parts of rank ``new_rank``'s shard of ``name`` in a world of
    ``new_world`` (only the old shards holding some of its rows are opened)."""
    spec = shards.md.tensor_specs[name]
    # on the world that saved it, each rank's own shard (an uneven split as it was saved);
    # on another, the even split
    new = spec if len(spec.shard_sizes) == new_world else spec.resharded(new_world)
    lo, hi = new.start(new_rank), new.start(new_rank) + new.shard_sizes[new_rank]
    shape = new.shard_shape(new_rank)
    dim = spec.shard_dim
    parts: list[Part] = []
    code = spec.dtype or _one_dtype(shards, name, len(spec.shard_sizes))
    pos = 0
    for r, size in enumerate(spec.shard_sizes):
        s, e = max(lo, pos), min(hi, pos + size)
        if s < e:
            f = shards.file(r)
            itemsize = code_dtype(code, f"{f.path}: tensor {name!r}").itemsize
            old = spec.shard_shape(r)
            outer, inner = math.prod(old[:dim]), math.prod(old[dim + 1:]) * itemsize
            p = Part(shards, r, name, f.raw(name), outer, size * inner, (hi - lo) * inner,
                     (s - pos) * inner, (s - lo) * inner, (e - s) * inner, 0, 0)
            _window(p)
            parts.append(p)
        pos += size
    return shape, code_dtype(code, f"metadata.json: tensor {name!r}"), parts


def _one_dtype(shards: VerifiedShards, name: str, count: int) -> str:
    """The dtype of ``name`` where metadata.json records none (an old one, or one written
    beside plain safetensors shards): every shard's, which must agree (TensorError naming
    them: shards of float32 and float64 rows would load as garbage)."""
    codes = [shards.file(r).entries[name][0] for r in range(count)]
    if len(set(codes)) > 1:
        said = ", ".join(f"rank {r}: {c}" for r, c in enumerate(codes))
        raise TensorError(f"tensor {name!r}: its shards disagree on the dtype ({said}) and "
                          "metadata.json records none")
    return codes[0]


def _window(p: Part) -> None:
    """The bytes of ``p.src`` to read, and the checksums that cover them."""
    if p.outer == 0 or p.run == 0:
        p.lo = p.hi = 0
        return
    p.lo, p.hi = p.src_off, (p.outer - 1) * p.src_row + p.src_off + p.run
    if not p.shards.verify:
        return
    sums = p.shards.sums(p.rank)
    if sums.kind == "crc32c":
        chunk, n = sums.chunk, p.src.size
        k0, k1 = p.lo // chunk, -(-p.hi // chunk)
        p.lo, p.hi, p.first_chunk = k0 * chunk, min(k1 * chunk, n), k0
        p.want = sums.chunk_crcs(p.name, n)[k0:k1]
        p.got = np.empty(k1 - k0, np.uint32)
    elif sums.kind == "crc32":
        p.whole_crc32 = True


def _check_part(p: Part, dst: np.ndarray | None) -> None:
    """The kernel's preconditions (derived from verified headers, so a failure is a bug)."""
    last = (p.outer - 1) * p.src_row + p.src_off + p.run if p.outer and p.run else 0
    ok = 0 <= p.lo <= p.hi <= p.src.size and last <= p.src.size and p.run <= p.src_row
    if dst is not None and p.outer and p.run:
        ok = ok and (p.outer - 1) * p.dst_row + p.dst_off + p.run <= dst.size
    if p.want.size:
        chunk = p.shards.sums(p.rank).chunk
        ok = ok and p.lo % chunk == 0 and p.got.size == p.want.size == \
            num_chunks(p.hi - p.lo, chunk)
    if not ok:
        raise TensorError(f"{p.shards.file(p.rank).path}: tensor {p.name!r}: inconsistent read "
                          f"plan (window [{p.lo}, {p.hi}) of {p.src.size} bytes, {p.outer} runs "
                          f"of {p.run} every {p.src_row})")


def _tasks(p: Part, dst: np.ndarray | None, piece: int) -> list[tuple]:
    """Kernel calls reading ``p``'s window in pieces of about ``piece`` bytes (whole chunks)."""
    _check_part(p, dst)
    d = dst if dst is not None else np.empty(0, np.uint8)
    if p.want.size:
        chunk = p.shards.sums(p.rank).chunk
        step = max(1, piece // chunk)
        return [(p, d, p.lo + i * chunk, min(p.lo + (i + step) * chunk, p.hi), p.got[i:i + step],
                 chunk) for i in range(0, p.got.size, step)]
    if dst is None:
        return []
    step = max(piece, 1)
    return [(p, d, lo, min(lo + step, p.hi), _NO_CRCS, 1) for lo in range(p.lo, p.hi, step)]


def execute(jobs: list[tuple[Part, np.ndarray | None]], threads: int) -> None:
    """Read every part (into its destination's bytes, or checksum only for None) and raise
    ChecksumMismatchError naming the first bad chunk; ``threads`` kernel calls at a time."""
    total = sum(p.hi - p.lo for p, _ in jobs)
    stream = total >= STREAM_MIN
    threads = threads if total >= THREAD_MIN else 1
    piece = max(PIECE_MIN, total // (threads * 4)) if threads > 1 else 1 << 62
    for p, _ in jobs:
        p.verify_whole()  # format 1 only
    tasks = [t for p, d in jobs for t in _tasks(p, d, piece)]

    def run(t: tuple) -> None:
        p, d, lo, hi, crcs, chunk = t
        _copy_crc.copy_window(p.src, d, lo, hi, p.outer, p.src_row, p.dst_row, p.src_off,
                              p.dst_off, p.run, crcs, chunk, stream)

    if threads > 1 and len(tasks) > 1:
        with ThreadPoolExecutor(min(threads, len(tasks)),
                                thread_name_prefix="ferro-checkpoint-read") as pool:
            list(pool.map(run, tasks))
    else:
        for t in tasks:
            run(t)
    for p, _ in jobs:
        p.check()


def allocate(layout: dict[str, tuple[tuple[int, ...], np.dtype]],
             parts: dict[str, list[Part]] | None = None) -> dict[str, np.ndarray]:
    """New C-contiguous arrays of these shapes and dtypes, views of one allocation (numpy asks
    the kernel for huge pages for it; faulting in 4 KiB pages one by one costs more than the
    copy on some hosts). A tensor of 1 MiB or more starts at the same offset modulo 4096 as the
    first bytes it copies from its first part, so the kernel's loads never wait on its streamed
    stores (4K aliasing; see ``_crc32c.h``)."""
    offsets, total = {}, 0
    for name, (shape, dtype) in layout.items():
        nbytes = math.prod(shape) * dtype.itemsize
        total = -(-total // _ALIGN) * _ALIGN
        first = (parts or {}).get(name)
        if first and nbytes >= PIECE_MIN:
            p = first[0]
            residue = (p.src.ctypes.data + p.src_off - p.dst_off) % _PAGE
            if residue % dtype.itemsize == 0:
                total += (residue - total) % _PAGE
        offsets[name] = total
        total += nbytes
    buf = np.empty(total + _PAGE, np.uint8)
    base = -buf.ctypes.data % _PAGE
    return {name: buf[base + offsets[name]:base + offsets[name] +
                      math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
            for name, (shape, dtype) in layout.items()}


def _view(p: Part, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The bytes of a contiguous part as a read-only array backed by the file."""
    wire = dtype if np.little_endian else dtype.newbyteorder("<")
    n = math.prod(shape) * dtype.itemsize
    return p.src[p.src_off:p.src_off + n].view(wire).reshape(shape)


class LazyTensors(Mapping):
    """Read-only arrays backed by shard files, each verified when first looked up (``[]``,
    ``get``, ``values``, ``items``): a tensor whose bytes differ from their checksums raises
    ChecksumMismatchError then, and on every later lookup. What a load with ``mmap=True,
    verify="lazy"`` returns; not made by users.

    Parameters
    ----------
    arrays : dict of str to numpy.ndarray
        The tensors by name, views of the mapped files.
    pending : dict
        For each tensor not verified yet, the parts of the files to check on first lookup.
    """

    def __init__(self, arrays: dict[str, np.ndarray], pending: dict[str, list[Part]]) -> None:
        self._arrays = arrays
        self._pending = pending
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> np.ndarray:
        array = self._arrays[name]
        if name in self._pending:
            with self._lock:
                parts = self._pending.get(name)
                if parts is not None:
                    execute([(p, None) for p in parts], 1)  # raises, and stays pending
                    del self._pending[name]
        return array

    def __contains__(self, name: object) -> bool:
        return name in self._arrays  # (Mapping's would read and verify the tensor)

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __repr__(self) -> str:
        return (f"<LazyTensors: {len(self._arrays)} tensors, {len(self._pending)} not yet "
                "verified>")


def read_tensors(shards: VerifiedShards, names: list[str], new_world: int, new_rank: int, *,
                 out: Mapping[str, np.ndarray] | None = None, mmap: bool = False,
                 lazy: bool = False, threads: int = 1) -> dict[str, np.ndarray] | LazyTensors:
    """Rank ``new_rank``'s shard of each tensor of ``names`` in a world of ``new_world``.

    Into ``out``'s arrays where given (checked: C-contiguous, writable, shape and dtype), else
    new arrays; with ``mmap``, read-only views of the files where a tensor's bytes lie in one
    file in one piece (always on the saving world size), verified now or, with ``lazy``, on
    first lookup (a :class:`LazyTensors`); other tensors are copied, then made read-only too.
    """
    plans = {n: plan(shards, n, new_world, new_rank) for n in names}
    out = dict(out or {})
    result: dict[str, np.ndarray] = {}
    views: set[str] = set()
    pending: dict[str, list[Part]] = {}
    jobs: list[tuple[Part, np.ndarray | None]] = []
    for name, (shape, dtype, parts) in plans.items():
        if name in out:
            result[name] = _checked_out(out.pop(name), name, shape, dtype)
        elif mmap and len(parts) == 1 and parts[0].contiguous():
            result[name] = _view(parts[0], shape, dtype)
            views.add(name)
            if lazy:
                pending[name] = parts
            else:
                jobs.append((parts[0], None))
    if out:
        raise TensorError(f"out names tensors {sorted(out)} the checkpoint does not hold")
    new = [n for n in names if n not in result]
    result.update(allocate({n: plans[n][:2] for n in new}, {n: plans[n][2] for n in new}))
    for name in names:
        if name not in views:
            dst = tensor_bytes(result[name])
            jobs.extend((p, dst) for p in plans[name][2])
    execute(jobs, threads)
    result = {n: result[n] for n in names}
    if mmap:
        for a in result.values():
            a.flags.writeable = False
    return LazyTensors(result, pending) if lazy else result


def _checked_out(a, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.shape != shape or a.dtype != dtype or \
            not a.flags.c_contiguous or not a.flags.writeable:
        got = (f"{a.dtype}{a.shape} (C-contiguous {a.flags.c_contiguous}, writable "
               f"{a.flags.writeable})" if isinstance(a, np.ndarray) else type(a).__name__)
        raise TensorError(f"out[{name!r}] is {got}, expected a C-contiguous writable "
                          f"{dtype}{shape}")
    return a
