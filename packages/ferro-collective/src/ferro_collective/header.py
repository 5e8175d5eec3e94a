"""Mismatch detection: every collective starts by all-gathering a small header.

The header names the collective, its dtype, shape, reduce op and root (the engine's door,
``ferro/engine.h``, packs the same bytes for its calls in C: ``_header.h``) (a negative dim, printed
``*``, is one that may differ between ranks, as dim 0 of ``all_gather_v``; ``INVALID`` marks a
rank whose own arguments were wrong, so that its peers fail at once instead of waiting: a
refusal, :func:`refusal`, carries that rank's reason; ``UNKNOWN`` a broadcast's non-root that
passed None, which takes the root's dtype and shape from the root's header). The
exchange uses Bruck's all-gather (ceil(log2 n) rounds of small messages), so every rank learns
every rank's header, and either all ranks proceed or all raise :class:`CollectiveMismatchError`
naming what each rank called — never a hang, never garbage. The same exchange is the barrier.
A call that takes several sequence numbers (a compressed call's block) says how many in its
first collective's header (its span, bytes 6-7): where the headers disagree, a rank whose call
took fewer catches up (:func:`owed`), so the next call is the next call on every rank.

The dtype is a code of at most 8 bytes (:func:`dtype_code`) that tells any two dtypes apart:
numpy's ``dtype.str`` where it rebuilds the dtype, a fixed code per ml_dtypes type
(:data:`EXTENSION_DTYPES`; float8 types all have ``dtype.str`` ``<V1``), else ``#`` and a hash
(structured dtypes, datetimes of long units), which detects a mismatch but names no dtype a
rank can build: a broadcast whose root passes such an array and whose non-roots pass None
raises :class:`CollectiveMismatchError` on every rank (the root cannot know, before the
exchange, that a non-root passed None), and the next call is the next call on every rank.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import zlib

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


def collective_code(name: str) -> int:
    """The header code of collective ``name``: ferro's own have fixed ones (:data:`COLLECTIVES`,
    the engine's door uses the same); a collective added by its record alone gets one from its
    name (128-255, the same on every rank; two such names may share one, which only weakens the
    mismatch check between those two)."""
    code = COLLECTIVES.get(name)
    return code if code is not None else 128 + zlib.crc32(name.encode()) % 128
_REDOP_NAMES = {spec.wire: op.name for op, spec in OPS.items()}
#: header flag: this rank's arguments were invalid (it raises its own error; peers a mismatch)
INVALID = 1
#: header flag: a broadcast's non-root that passed None (no dtype or shape: the root's header's)
UNKNOWN = 2
#: a refusal's reason: bytes 8..24 (dtype and root) and 28..76 (the dims) of its header
_REASON = ((8, 24), (28, 28 + 8 * _MAX_DIMS))
REASON_BYTES = sum(b - a for a, b in _REASON)

#: The header's code of each extension dtype whose numpy ``str`` names its size alone
#: (``<V1``, ``<V2``) or that numpy cannot parse (float8_e5m2's ``<f1``): ``(code, name in
#: ml_dtypes)``. The codes are part of the wire format (other ranks, other versions, the
#: engine's door, ``_header.h``, whose bfloat16 is ``<V2``): never change or reuse one; add
#: new ones at the end.
EXTENSION_DTYPES = (
    ("<V2", "bfloat16"), ("f8e3m4", "float8_e3m4"), ("f8e4m3", "float8_e4m3"),
    ("f8e4m3bz", "float8_e4m3b11fnuz"), ("f8e4m3fn", "float8_e4m3fn"),
    ("f8e4m3fz", "float8_e4m3fnuz"), ("f8e5m2", "float8_e5m2"), ("f8e5m2fz", "float8_e5m2fnuz"),
    ("f8e8m0fu", "float8_e8m0fnu"), ("f6e2m3fn", "float6_e2m3fn"),
    ("f6e3m2fn", "float6_e3m2fn"), ("f4e2m1fn", "float4_e2m1fn"), ("int1", "int1"),
    ("int2", "int2"), ("int4", "int4"), ("uint1", "uint1"), ("uint2", "uint2"),
    ("uint4", "uint4"), ("c32", "complex32"), ("bc32", "bcomplex32"))
_EXT_BY_CODE = {c.encode(): name for c, name in EXTENSION_DTYPES}
_EXT_BY_NAME = {name: c.encode() for c, name in EXTENSION_DTYPES}
_dtype_codes: dict[tuple[str, str, int], bytes] = {}
_code_dtypes: dict[bytes, np.dtype | None] = {}


def dtype_code(dtype: np.dtype, width: int = 8) -> bytes:
    """The code naming ``dtype`` in a header (``width`` bytes at most; a descriptor's 16).

    Two dtypes have two codes, and every rank computes the same one; :func:`dtype_from_code`
    rebuilds the dtype from it where it can.

    Parameters
    ----------
    dtype : numpy.dtype
        The dtype (anything ``numpy.dtype`` takes).
    width : int
        The bytes the code may take (8 in a header).

    Returns
    -------
    bytes
        At most ``width`` ASCII bytes, none NUL: numpy's ``dtype.str`` where ``numpy.dtype``
        rebuilds ``dtype`` from it (``<f4``; its byte order dropped, or its ``name``, where
        that fits instead), an ml_dtypes type's code (:data:`EXTENSION_DTYPES`), else ``#``
        and a hash of the dtype's name and layout (structured dtypes, datetimes with long
        units), which tells dtypes apart but cannot rebuild one.
    """
    dtype = np.dtype(dtype)
    if dtype.names is not None:  # (numpy's == of dtypes is loose, and not symmetric)
        return _make_code(dtype, width)
    key = (dtype.str, dtype.name, width)
    code = _dtype_codes.get(key)
    if code is None:
        code = _make_code(dtype, width)
        if len(_dtype_codes) > 1024:
            _dtype_codes.clear()
        _dtype_codes[key] = code
    return code


def _make_code(dtype: np.dtype, width: int) -> bytes:
    ext = _EXT_BY_NAME.get(dtype.name)
    if ext is not None and getattr(dtype.type, "__module__", "").startswith("ml_dtypes"):
        return ext
    candidates = [dtype.str, dtype.name]
    if dtype.str[:1] in "<|=":  # (this host's order: numpy's default)
        candidates.insert(1, dtype.str[1:])
    for name in candidates:
        code = name.encode("ascii", "replace")
        if len(code) > width or code in _EXT_BY_CODE or b"\0" in code:
            continue
        try:
            parsed = np.dtype(name)
        except (TypeError, ValueError):
            continue
        if parsed == dtype and dtype == parsed and parsed.str == dtype.str:
            return code
    try:
        layout = repr(dtype.descr)
    except (TypeError, ValueError):
        layout = str(dtype)
    digest = hashlib.blake2b(f"{dtype.name};{dtype.itemsize};{layout}".encode()).digest()
    return b"#" + base64.b64encode(digest)[:width - 1]


def dtype_from_code(code: bytes) -> np.dtype | None:
    """The dtype a code names (:func:`dtype_code`; trailing NULs ignored), or None where it
    cannot be rebuilt: a hashed code, an ml_dtypes type this process cannot import, a string
    numpy does not parse. Never raises.

    Parameters
    ----------
    code : bytes
        A dtype's code, as a header carries it.

    Returns
    -------
    numpy.dtype or None
        The dtype, or None.
    """
    code = bytes(code).rstrip(b"\0")
    if code in _code_dtypes:
        return _code_dtypes[code]
    dtype: np.dtype | None = None
    try:
        name = _EXT_BY_CODE.get(code)
        if name is not None:
            import ml_dtypes

            dtype = np.dtype(getattr(ml_dtypes, name))
        elif code and not code.startswith(b"#"):
            dtype = np.dtype(code.decode("ascii"))
    except Exception:  # (an old ml_dtypes, a string numpy cannot parse: not rebuilt)
        dtype = None
    if len(_code_dtypes) > 1024:
        _code_dtypes.clear()
    _code_dtypes[code] = dtype
    return dtype


def dtype_name(code: bytes) -> str:
    """A readable name of the dtype a code names (:func:`dtype_code`): numpy's or ml_dtypes'
    (``float32``, ``float8_e4m3fn``), else the code itself (``#`` and a hash: a dtype without
    a short name, as a structured one). A dtype not in this host's byte order is named by its
    code (``>f4``), so that it reads otherwise than the native one (``float32``). Never raises.

    Parameters
    ----------
    code : bytes
        A dtype's code, as a header carries it.

    Returns
    -------
    str
        The name.
    """
    code = bytes(code).rstrip(b"\0")
    name = _EXT_BY_CODE.get(code)
    if name is not None:
        return name
    text = code.decode("ascii", "replace")
    if text.startswith("#"):  # (as the engine's door prints it too)
        return text
    dtype = dtype_from_code(code)
    if dtype is None:
        return text
    return dtype.name if dtype.byteorder in "=|" else dtype.str


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
_SPAN_OFFSET = 6  # ... and the numbers its whole call takes (uint16; 0: one)
_templates: dict[tuple, bytes] = {}


def encode(op: str, dtype: np.dtype | None, shape: tuple[int, ...],
           redop: ReduceOp | None = None, root: int = -1, seq: int = 0, *, flags: int = 0,
           span: int = 0) -> bytes:
    """The header of one call (cached per call signature; only ``seq`` is packed each time).
    ``span``: the sequence numbers the caller's whole call takes where this collective is the
    first of several (a compressed call's block; 0: one): :func:`owed`."""
    # (the dtype's str too: numpy has M8[1000ns] == M8[us], not the other way round)
    key = (op, dtype, getattr(dtype, "str", None), shape, redop, root, flags, span)
    template = _templates.get(key)
    if template is None:
        if len(_templates) > 4096:
            _templates.clear()
        template = _templates[key] = _encode(op, dtype, shape, redop, root, 0, flags, span)
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
            redop: ReduceOp | None, root: int, seq: int, flags: int = 0, span: int = 0) -> bytes:
    dims = list(shape[:_MAX_DIMS]) + [0] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
    if len(shape) > _MAX_DIMS:
        dims[-1] = _tail_hash(tuple(shape[_MAX_DIMS - 1:]))
    dstr = dtype_code(dtype) if dtype is not None else b""
    wire_op = 0 if redop is None else OPS[redop].wire
    return _HEADER.pack(b"FC", collective_code(op), wire_op, min(len(shape), 255), flags,
                        span, dstr, root, seq & 0xFFFFFFFF, *dims)


def refusal(op: str, seq: int, exc: BaseException, span: int = 0) -> bytes:
    """The header of a call this rank refused (its arguments were wrong): ``op``'s code, the
    INVALID flag and the first :data:`REASON_BYTES` bytes of ``"TypeName: message"`` (the door's
    messages describe it the same way, ``_header.h``); ``span`` as :func:`encode`'s."""
    text = f"{type(exc).__name__}: {str(exc).removeprefix(op + ': ')}".encode(errors="replace")
    if len(text) > REASON_BYTES:
        text = text[:REASON_BYTES - 3] + b"..."
    text = text.ljust(REASON_BYTES, b"\0")
    h = bytearray(_encode(op, None, (), None, -1, seq, INVALID, span))
    at = 0
    for a, b in _REASON:
        h[a:b] = text[at:at + b - a]
        at += b - a
    return bytes(h)


def span_of(header: bytes) -> int:
    """The sequence numbers the call whose header is ``header`` takes (bytes 6-7; 0 there:
    one)."""
    return header[_SPAN_OFFSET] | header[_SPAN_OFFSET + 1] << 8 or 1


def owed(headers: list[bytes], rank: int) -> int:
    """After a mismatch: the numbers ``rank``'s call must give back to catch up with the
    peer whose call takes the most (every rank then numbers the next call alike: a compressed
    call takes a block, :mod:`.compressed_agreement`), 0 if none."""
    return max(span_of(h) for h in headers) - span_of(headers[rank])


def reason(header: bytes) -> str:
    """A refusal's reason (:func:`refusal`)."""
    return b"".join(header[a:b] for a, b in _REASON).rstrip(b"\0").decode(errors="replace")


def unknown(op: str, root: int, seq: int) -> bytes:
    """The header of a broadcast's non-root that passed None (its dtype and shape: the
    root's)."""
    return _encode(op, None, (), None, root, seq, UNKNOWN)


def decode_array(header: bytes) -> tuple[np.dtype, tuple[int, ...]] | None:
    """The dtype and shape a header names, where it names them whole (a header of an array of
    at most six dims whose dtype's code rebuilds it, :func:`dtype_from_code`; None otherwise).
    Never raises."""
    magic, _, _, ndim, flags, _, dstr, _, _, *dims = _HEADER.unpack(header)
    if magic != b"FC" or flags or not dstr.rstrip(b"\0") or ndim > _MAX_DIMS or \
            any(d < 0 for d in dims):
        return None
    dtype = dtype_of(dstr)
    return None if dtype is None else (dtype, tuple(dims[:ndim]))


def dtype_of(dstr: bytes | str) -> np.dtype | None:
    """The numpy dtype of a header's dtype code (:func:`dtype_from_code`), or None where it
    cannot be rebuilt. Never raises."""
    return dtype_from_code(dstr.encode("ascii", "replace") if isinstance(dstr, str) else dstr)


def describe(header: bytes) -> str:
    magic, op, redop, ndim, flags, span, dstr, root, seq, *dims = _HEADER.unpack(header)
    if magic != b"FC":
        return f"<not a ferro collective header: {header[:8]!r}>"
    name = _COLLECTIVE_NAMES.get(op, f"collective#{op}")
    if name == "barrier":
        return f"barrier (seq {seq})"
    if flags & INVALID:
        return f"{name}(<refused: {reason(header)}>) (seq {seq})"
    if flags & UNKNOWN:
        return f"{name}(None, root={root}) (seq {seq})"
    args = []
    if dstr.rstrip(b"\x00"):  # collectives whose data only some ranks know name no dtype
        dtype = dtype_name(dstr)
        tail = ndim > _MAX_DIMS  # (the last dim's place holds a hash of the rest)
        shape = ", ".join(str(d) if d >= 0 else "*" for d in dims[:min(ndim, _MAX_DIMS) - tail])
        args.append(f"{dtype}[{shape}{f', ... ({ndim} dims)' if tail else ''}]")
    if redop:
        args.append(_REDOP_NAMES.get(redop, f"op#{redop}"))
    if root >= 0:
        args.append(f"root={root}")
    # (the first collective of a call made of several: a rank's exact call meeting it must not
    # read as if the peer had called this inner collective)
    whole = (f"; the first of the {span} collectives of one call, as a compressed call with "
             "wire= begins" if span > 1 else "")
    return f"{name}({', '.join(args)}) (seq {seq}{whole})"


def resolve_unknown(headers: list[bytes]) -> list[bytes]:
    """``headers`` with each broadcast non-root's that passed None (:data:`UNKNOWN`) replaced
    by its root's header, where that root called the same broadcast with an array whose dtype
    and shape its header names whole."""
    out = list(headers)
    for r, h in enumerate(headers):
        if h[5] & UNKNOWN:
            root = _HEADER.unpack(h)[7]
            if 0 <= root < len(headers):
                theirs = headers[root]
                if theirs[2] == h[2] and theirs[16:28] == h[16:28] and \
                        decode_array(theirs) is not None:
                    out[r] = theirs
    return out


def check_all(name: str, rank: int, headers: list[bytes],
              members: tuple[int, ...] | None = None) -> None:
    """Raise :class:`CollectiveMismatchError` on every rank when the ranks' ``headers`` (one per
    rank, in rank order) disagree, naming what each rank called, and first the ranks that
    refused the call and why. A broadcast's non-root that passed None agrees with its root
    (:func:`resolve_unknown`). ``members``: the ranks the message names (a subgroup's ranks in
    its parent), default the headers' indices."""
    headers = resolve_unknown(headers)
    ranks = members if members is not None else range(len(headers))
    mine = headers[rank]
    if all(h == mine for h in headers):
        return
    blind = [r for r, h in enumerate(headers) if h[5] & UNKNOWN]
    if blind:
        root = _HEADER.unpack(headers[blind[0]])[7]
        theirs = headers[root] if 0 <= root < len(headers) else b""
        if theirs[:3] == headers[blind[0]][:3] and theirs[4] > _MAX_DIMS:
            raise CollectiveMismatchError(
                f"{name}: ranks {[ranks[r] for r in blind]} passed None to a broadcast whose "
                f"root (rank {root}) passes an array of {theirs[4]} dims; its header names at "
                f"most {_MAX_DIMS}: pass an array of the root's shape and dtype there")
        if theirs[:3] == headers[blind[0]][:3] and not theirs[5] and \
                dtype_from_code(theirs[8:16]) is None:
            raise CollectiveMismatchError(
                f"{name}: ranks {[ranks[r] for r in blind]} passed None to a broadcast whose "
                f"root (rank {root}) passes an array of a dtype its header names but cannot "
                f"rebuild ({dtype_name(theirs[8:16])}: a structured dtype, a datetime of a "
                "long unit, an ml_dtypes type this process cannot import): pass an array of "
                "the root's shape and dtype there")
    refused = [(ranks[r], h) for r, h in enumerate(headers) if h[5] & INVALID]
    if refused and len(refused) < len(headers):
        r, h = refused[0]
        seq = _HEADER.unpack(h)[8]
        others = [f"rank {r2} refused it ({reason(h2)})" for r2, h2 in refused[1:]]
        raise CollectiveMismatchError(
            f"{name} (seq {seq}): rank {r} refused the call ({reason(h)})"
            + "".join(f"; {o}" for o in others) + "; every rank raises, none waits for it")
    groups: dict[bytes, list[int]] = {}
    for r, h in enumerate(headers):
        groups.setdefault(h, []).append(ranks[r])
    parts = [f"ranks {rs} called {describe(h)}" for h, rs in groups.items()]
    raise CollectiveMismatchError(f"{name}: ranks disagree on the collective: " + "; ".join(parts))
