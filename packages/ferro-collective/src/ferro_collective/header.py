"""Mismatch detection: every collective starts by all-gathering a small header.

The header names the collective, its dtype, shape, reduce op and root (the engine's door,
``ferro/engine.h``, packs the same bytes for its calls in C: ``_header.h``) (a negative dim, printed
``*``, is one that may differ between ranks, as dim 0 of ``all_gather_v``; ``INVALID`` marks a
rank whose own arguments were wrong, so that its peers fail at once instead of waiting). The
exchange uses Bruck's all-gather (ceil(log2 n) rounds of small messages), so every rank learns
every rank's header, and either all ranks proceed or all raise :class:`CollectiveMismatchError`
naming what each rank called — never a hang, never garbage. The same exchange is the barrier.
"""

from __future__ import annotations

import struct

import numpy as np

from ferro_backend import CollectiveMismatchError, settings

from .ops import OPS, ReduceOp

_MAX_DIMS = 6
_HEADER = struct.Struct(f"<2sBBBBH8sqI{_MAX_DIMS}q")
HEADER_SIZE = _HEADER.size
COLLECTIVES = {"barrier": 1, "allreduce": 2, "broadcast": 3, "all_gather": 4,
               "reduce_scatter": 5, "reduce": 6, "gather": 7, "scatter": 8, "all_gather_v": 9,
               "all_to_all": 10, "all_to_all_single": 11, "broadcast_object": 12,
               "all_gather_object": 13}
_COLLECTIVE_NAMES = {v: k for k, v in COLLECTIVES.items()}
_REDOP_NAMES = {spec.wire: op.name for op, spec in OPS.items()}
#: header flag: this rank's arguments were invalid (it raises its own error; peers a mismatch)
INVALID = 1

_check: bool | None = None  # None: FERRO_COLLECTIVE_CHECK decides, at the first call


def set_mismatch_check(enabled: bool) -> None:
    """Turn the header exchange of non-barrier collectives on or off (on by default).

    It must be set the same way on every rank. Off saves ceil(log2 n) small-message rounds per
    call; a mismatched call then fails with a size error or a timeout instead.

    Parameters
    ----------
    enabled : bool
        True checks every call's collective, dtype, shape, op and root against the peers'
        (the default, from ``FERRO_COLLECTIVE_CHECK``); False skips the check.
    """
    global _check
    _check = bool(enabled)


def mismatch_check_enabled() -> bool:
    global _check
    if _check is None:
        _check = settings.COLLECTIVE_CHECK.get()
    return _check


_SEQ_OFFSET = 24  # where the sequence number sits in a packed header
_templates: dict[tuple, bytes] = {}


def encode(op: str, dtype: np.dtype | None, shape: tuple[int, ...],
           redop: ReduceOp | None = None, root: int = -1, seq: int = 0, *, flags: int = 0
           ) -> bytes:
    """The header of one call (cached per call signature; only ``seq`` is packed each time)."""
    key = (op, dtype, shape, redop, root, flags)
    template = _templates.get(key)
    if template is None:
        if len(_templates) > 4096:
            _templates.clear()
        template = _templates[key] = _encode(op, dtype, shape, redop, root, 0, flags)
    return template[:_SEQ_OFFSET] + (seq & 0xFFFFFFFF).to_bytes(4, "little") + \
        template[_SEQ_OFFSET + 4:]


def _tail_hash(dims: tuple[int, ...]) -> int:
    """The sixth dim of a header whose shape has more than six: FNV-1a (64 bits) over the
    little-endian bytes of dims 5.., masked to 63 bits (the engine's door computes the same)."""
    x = 14695981039346656037
    for d in dims:
        for byte in (d & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little"):
            x = ((x ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return x & 0x7FFFFFFFFFFFFFFF


def _encode(op: str, dtype: np.dtype | None, shape: tuple[int, ...],
            redop: ReduceOp | None, root: int, seq: int, flags: int = 0) -> bytes:
    dims = list(shape[:_MAX_DIMS]) + [0] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
    if len(shape) > _MAX_DIMS:
        dims[-1] = _tail_hash(tuple(shape[_MAX_DIMS - 1:]))
    dstr = (np.dtype(dtype).str if dtype is not None else "").encode()[:8]
    wire_op = 0 if redop is None else OPS[redop].wire
    return _HEADER.pack(b"FC", COLLECTIVES[op], wire_op, min(len(shape), 255), flags,
                        0, dstr, root, seq & 0xFFFFFFFF, *dims)


def describe(header: bytes) -> str:
    magic, op, redop, ndim, flags, _, dstr, root, seq, *dims = _HEADER.unpack(header)
    if magic != b"FC":
        return f"<not a ferro collective header: {header[:8]!r}>"
    name = _COLLECTIVE_NAMES.get(op, f"op#{op}")
    if name == "barrier":
        return f"barrier (seq {seq})"
    if flags & INVALID:
        return f"{name}(<invalid arguments, see that rank's error>) (seq {seq})"
    args = []
    if dstr.rstrip(b"\x00"):  # collectives whose data only some ranks know name no dtype
        dtype = np.dtype(dstr.rstrip(b"\x00").decode())
        shape = ", ".join(str(d) if d >= 0 else "*" for d in dims[:min(ndim, _MAX_DIMS)])
        args.append(f"{dtype.name}[{shape}]")
    if redop:
        args.append(_REDOP_NAMES.get(redop, f"op#{redop}"))
    if root >= 0:
        args.append(f"root={root}")
    return f"{name}({', '.join(args)}) (seq {seq})"


def check_all(name: str, rank: int, headers: list[bytes]) -> None:
    mine = headers[rank]
    if all(h == mine for h in headers):
        return
    groups: dict[bytes, list[int]] = {}
    for r, h in enumerate(headers):
        groups.setdefault(h, []).append(r)
    parts = [f"ranks {rs} called {describe(h)}" for h, rs in groups.items()]
    raise CollectiveMismatchError(f"{name}: ranks disagree on the collective: " + "; ".join(parts))
