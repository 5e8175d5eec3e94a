"""The uneven collectives: all_gather_v, all_to_all (list form), all_to_all_single.

Dim 0 may differ between ranks (and, for the all-to-alls, between destinations); the dtype and
the trailing shape may not (CollectiveMismatchError on every rank, naming what each called:
the header carries them with dim 0 as ``*``). The row counts travel in the metadata round of
:class:`~.metadata_step.MetaPlan`, so every rank knows every message's size before data moves and
every check on them is made by every rank alike (the same error everywhere, never a hang).

Algorithms:

- all_gather_v: the ring all-gather (n-1 steps, bandwidth-optimal) on uneven byte chunks; empty
  chunks are skipped by both sides.
- all_to_all: pairwise exchange: every receive is posted first (straight into the result), then
  at step ``s = 1..n-1`` rank ``r`` sends to ``r + s`` and waits for ``r - s`` (mod n), so each
  step is a permutation and no rank is sent to by many at once. On a ``ShmBackend`` the
  all-to-alls run on the same-host engine instead (:func:`.metadata_step.get_pieces`; from C in
  their common case, :mod:`._exchange_twin`): small data rides in the metadata step, large
  pieces are read straight from their senders' memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ferro_backend import Backend, SizeMismatchError

from . import _onecall
from .arguments import as_array, check_backend, check_out, check_out_known, deliver
from .engine_group import EngineGroup, Step
from .metadata_sizes import row_bytes, row_views, split_plan
from .metadata_step import (
    MetaPlan,
    get_pieces,
    guard,
    pack_ints,
    put_block,
    put_pieces,
    sent_bytes,
    unpack_ints,
)
from .p2p import Ctx
from .plan import Collective, choose


# ----------------------------------------------------------------------------- algorithms
def all_gather_v_ring(ctx: Ctx, buf: np.ndarray, bounds: Sequence[tuple[int, int]]) -> None:
    """Ring all-gather in place on uneven chunks (rank r starts with chunk r filled)."""
    n, me = ctx.n, ctx.rank
    right, left = (me + 1) % n, (me - 1) % n
    for s in range(n - 1):
        send_c, recv_c = (me - s) % n, (me - s - 1) % n
        tag = ctx.next_tag()
        rs, re = bounds[recv_c]
        req = ctx.irecv(buf[rs:re], left, tag) if re > rs else None
        ss, se = bounds[send_c]
        if se > ss:
            ctx.send(buf[ss:se], right, tag)
        if req is not None:
            ctx.wait(req, left, f"rank {recv_c}'s block (all-gather step {s})")


def all_to_all_pairwise(ctx: Ctx, sends: Sequence[np.ndarray],
                        recvs: Sequence[np.ndarray]) -> None:
    """``recvs[r]`` = what rank r sends us; ``sends[d]`` goes to rank d (byte arrays)."""
    n, me = ctx.n, ctx.rank
    tag = ctx.next_tag()
    reqs = {}
    for s in range(1, n):
        src = (me - s) % n
        if recvs[src].size:
            reqs[src] = ctx.irecv(recvs[src], src, tag)
    if recvs[me].size:
        recvs[me][...] = sends[me]
    for s in range(1, n):
        dst, src = (me + s) % n, (me - s) % n
        if sends[dst].size:
            ctx.send(sends[dst], dst, tag)
        if src in reqs:
            ctx.wait(reqs[src], src, f"its block (pairwise exchange step {s})")


# ----------------------------------------------------------------------------- list out=
def check_list_out(name: str, out, x: np.ndarray, n: int, me: int | None) -> None:
    """What a rank knows of a list collective's ``out=`` before the data moves (the rest is
    checked once it moved: ``api_uneven._into``): a sequence of ``n`` arrays (TypeError,
    ValueError), each as :func:`.arguments.check_out_known` checks it against ``x``'s dtype and
    shape after dim 0 (entry ``me``, this rank's own of all_gather_v: ``x``'s whole shape)."""
    if out is None:
        return
    if isinstance(out, np.ndarray) or not isinstance(out, Sequence):
        raise TypeError(f"{name}: out must be a list of {n} numpy arrays, got "
                        f"{type(out).__name__}")
    if len(out) != n:
        raise ValueError(f"{name}: out has {len(out)} arrays, the result {n} (one per rank)")
    some = () if x.ndim == 0 else (-1, *x.shape[1:])
    for r, o in enumerate(out):
        check_out_known(f"{name}: out[{r}]", o, x.shape if r == me else some, x.dtype)


def list_out_refused(name: str, out, tensors, backend: Backend) -> bool:
    """Whether a list collective's prepare step would refuse this call's ``out=`` (or its
    input): the engine's one-call path of all_gather_v and all_to_all does not see ``out=``, so
    such a call must take the general path, which refuses it on every rank. (False without
    ``out=``.)"""
    if out is None:
        return False
    try:
        n = backend.world_size
        if name == "all_gather_v":
            check_list_out(name, out, np.asarray(tensors), n, backend.rank)
        else:
            check_list_out(name, out, np.asarray(tensors[0]), n, None)
    except Exception:  # (a bad input too: the general path says what)
        return True
    return False


# ----------------------------------------------------------------------------- all_gather_v
def prepare_all_gather_v(tensor, backend: Backend, arg, timeout, algorithm, out,
                         seq: int | None = None) -> MetaPlan:
    """The checked plan of one all_gather_v (``arg`` unused; ``out``: the list the caller
    fills once the data moved, checked here as far as a rank knows it: :func:`check_list_out`)."""
    check_backend("all_gather_v", backend)
    choose(ALL_GATHER_V, algorithm, 0, backend.world_size)

    def prepare() -> np.ndarray:
        x = as_array("all_gather_v", tensor, backend)
        check_list_out("all_gather_v", out, x, backend.world_size, backend.rank)
        return x

    x, invalid = guard(prepare)
    if invalid is not None:
        return MetaPlan("all_gather_v", backend, timeout, (None, (), None, -1), bytes(8),
                        lambda ctx, metas: None, invalid)
    zero_d = x.ndim == 0
    trailing = x.shape[1:]
    block = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    rb = row_bytes(x.dtype, trailing)
    n = backend.world_size

    def body(ctx: Ctx, metas: list[bytes]) -> list[np.ndarray]:
        rows = [unpack_ints(m, 1)[0] for m in metas]
        bounds, start = [], 0
        for k in rows:
            bounds.append((start, start + k * rb))
            start += k * rb
        buf = np.empty(start, np.uint8)
        s, e = bounds[ctx.rank]
        if e > s:
            buf[s:e] = block
        if ctx.n > 1 and start:
            all_gather_v_ring(ctx, buf, bounds)
        return row_views(buf, rows, x.dtype, trailing, zero_d)

    def put(group: EngineGroup, payload: np.ndarray) -> None:
        put_block(group, payload, block)

    def run(group: EngineGroup, call: Step, step: int, off: int, metas: list[bytes],
            messages) -> list[np.ndarray]:
        """all_gather_v on the same-host engine: every rank's block rides in the metadata step
        when it fits, else every rank reads it from its owner's memory."""
        rows = [unpack_ints(m, 1)[0] for m in metas]
        buf = np.empty(sum(rows) * rb, np.uint8)
        result = row_views(buf, rows, x.dtype, trailing, zero_d)
        recvs = [r.reshape(-1).view(np.uint8) for r in result]
        if not get_pieces(group, call, step, off, [k * rb for k in rows], [0] * n, recvs,
                          block):
            return messages()
        return result

    header = (x.dtype, () if zero_d else (-1, *trailing), None, -1)
    return MetaPlan("all_gather_v", backend, timeout, header,
                    pack_ints([1 if zero_d else x.shape[0]]), body, engine_path=(put, run),
                    algorithm=algorithm)


# ----------------------------------------------------------------------------- all_to_all
def prepare_all_to_all(tensors, backend: Backend, arg, timeout, algorithm, out,
                       seq: int | None = None) -> MetaPlan:
    """The checked plan of one all_to_all (``arg`` unused; ``out``: as all_gather_v's)."""
    check_backend("all_to_all", backend)
    n = backend.world_size
    choose(ALL_TO_ALL, algorithm, 0, n)

    def prepare() -> list[np.ndarray]:
        if isinstance(tensors, np.ndarray | str | bytes) or not isinstance(tensors, Sequence):
            raise TypeError(f"all_to_all: tensors must be a list of world_size ({n}) arrays, got "
                            f"{type(tensors).__name__} (for one array split along dim 0 use "
                            "all_to_all_single)")
        if len(tensors) != n:
            raise ValueError(f"all_to_all: got {len(tensors)} tensors, expected world_size {n}")
        xs = [as_array("all_to_all", t, backend) for t in tensors]
        for r, t in enumerate(xs):
            if t.dtype != xs[0].dtype or t.ndim != xs[0].ndim or t.shape[1:] != xs[0].shape[1:]:
                raise ValueError(
                    f"all_to_all: tensors[{r}] is {t.dtype}{list(t.shape)}, tensors[0] is "
                    f"{xs[0].dtype}{list(xs[0].shape)}; all need one dtype and one shape after "
                    "dim 0")
        check_list_out("all_to_all", out, xs[0], n, None)
        return xs

    xs, invalid = guard(prepare)
    if invalid is not None:
        return MetaPlan("all_to_all", backend, timeout, (None, (), None, -1), bytes(8 * n),
                        lambda ctx, metas: None, invalid)
    dtype, zero_d, trailing = xs[0].dtype, xs[0].ndim == 0, xs[0].shape[1:]
    send_rows = [1 if zero_d else t.shape[0] for t in xs]
    rb = row_bytes(dtype, trailing)
    sends = [np.ascontiguousarray(t).reshape(-1).view(np.uint8) for t in xs]

    def plan(me: int, metas: list[bytes]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        rows = [unpack_ints(m, 1, 8 * me)[0] for m in metas]
        buf = np.empty(sum(rows) * rb, np.uint8)
        result = row_views(buf, rows, dtype, trailing, zero_d)
        return result, [r.reshape(-1).view(np.uint8) for r in result]

    def body(ctx: Ctx, metas: list[bytes]) -> list[np.ndarray]:
        result, recvs = plan(ctx.rank, metas)
        all_to_all_pairwise(ctx, sends, recvs)
        return result

    def put(group: EngineGroup, payload: np.ndarray) -> None:
        put_pieces(group, payload, sends)

    def run(group: EngineGroup, call: Step, step: int, off: int, metas: list[bytes],
            messages) -> list[np.ndarray]:
        me = group.me
        result, recvs = plan(me, metas)
        totals, starts = sent_bytes([[k * rb for k in unpack_ints(m, n)]
                                              for m in metas], me)
        if not get_pieces(group, call, step, off, totals, starts, recvs, sends[me]):
            return messages()
        return result

    header = (dtype, () if zero_d else (-1, *trailing), None, -1)
    return MetaPlan("all_to_all", backend, timeout, header, pack_ints(send_rows), body,
                    engine_path=(put, run), algorithm=algorithm)


# ----------------------------------------------------------------------------- all_to_all_single
def _splits(what: str, splits, n: int, total: int | None) -> list[int]:
    arr = np.asarray(splits)
    if arr.ndim != 1 or arr.size != n or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"all_to_all_single: {what} must be {n} integers (one per rank), got "
                         f"{splits!r}")
    values = [int(v) for v in arr]
    if any(v < 0 for v in values):
        raise ValueError(f"all_to_all_single: {what} {values} has a negative size")
    if total is not None and sum(values) != total:
        raise SizeMismatchError(f"all_to_all_single: {what} {values} add up to {sum(values)}, "
                                f"dim 0 of the tensor is {total}")
    return values


def prepare_all_to_all_single(tensor, backend: Backend, arg, timeout, algorithm, out,
                              seq: int | None = None) -> MetaPlan:
    """The checked plan of one all_to_all_single (``arg``: ``(send_splits, recv_splits)``)."""
    send_splits, recv_splits = arg
    name = "all_to_all_single"
    check_backend(name, backend)
    n = backend.world_size
    choose(ALL_TO_ALL, algorithm, 0, n)
    if out is not None and not isinstance(out, np.ndarray):
        raise TypeError(f"{name}: out must be a numpy array, got {type(out).__name__}")

    def prepare():
        x = as_array(name, tensor, backend)
        if x.ndim == 0:
            raise SizeMismatchError(f"{name}: a 0-d tensor cannot be split across ranks")
        if send_splits is None:
            if x.shape[0] % n:
                raise SizeMismatchError(f"{name}: dim 0 of shape {x.shape} ({x.shape[0]}) is not "
                                        f"divisible by world_size {n} (send_splits=None means "
                                        "equal splits)")
            send = [x.shape[0] // n] * n
        else:
            send = _splits("send_splits", send_splits, n, x.shape[0])
        recv = [-1] * n if recv_splits is None else _splits("recv_splits", recv_splits, n, None)
        if out is not None:  # (its dim 0 once the data moved, unless recv_splits say it)
            check_out_known(name, out, (-1 if recv_splits is None else sum(recv), *x.shape[1:]),
                            x.dtype)
        return x, send, recv

    prepared, invalid = guard(prepare)
    if invalid is not None:
        return MetaPlan(name, backend, timeout, (None, (), None, -1), bytes(16 * n),
                        lambda ctx, metas: None, invalid)
    x, send, recv = prepared
    trailing = x.shape[1:]
    rb = row_bytes(x.dtype, trailing)
    flat_in = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    sviews, starts, s0 = [], [], 0
    for k in send:
        sviews.append(flat_in[s0:s0 + k * rb])
        starts.append(s0)
        s0 += k * rb

    def plan(me: int, metas: list[bytes]):
        """The result array, its pieces by source rank, this rank's late ``out`` error (or the
        split error every rank raises alike), and the byte sizes for the engine."""
        rows, totals, at = split_plan(name, metas, n, me, rb)
        shape = (sum(rows), *trailing)
        res, late = out, None
        if out is not None:  # checked now that the shape is known; a bad one still takes part
            _, late = guard(lambda: check_out(name, out, shape, x.dtype))
        if res is None or late is not None or np.may_share_memory(res, x):
            res = np.empty(shape, x.dtype)
        flat_out = res.reshape(-1).view(np.uint8)
        rviews, r0 = [], 0
        for k in rows:
            rviews.append(flat_out[r0:r0 + k * rb])
            r0 += k * rb
        return res, rviews, late, (totals, at)

    def body(ctx: Ctx, metas: list[bytes]) -> np.ndarray:
        res, rviews, late, _ = plan(ctx.rank, metas)
        all_to_all_pairwise(ctx, sviews, rviews)
        return deliver(res, out, late)

    def put(group: EngineGroup, payload: np.ndarray) -> None:
        put_pieces(group, payload, sviews, flat_in, starts)

    def run(group: EngineGroup, call: Step, step: int, off: int, metas: list[bytes],
            messages) -> np.ndarray:
        me = group.me
        res, rviews, late, (totals, at) = plan(me, metas)
        if not get_pieces(group, call, step, off, totals, at, rviews, sviews[me]):
            return messages()
        return deliver(res, out, late)

    header = (x.dtype, (-1, *trailing), None, -1)
    return MetaPlan(name, backend, timeout, header, pack_ints(send + recv), body,
                    engine_path=(put, run), algorithm=algorithm)


ALL_GATHER_V = Collective("all_gather_v", prepare_all_gather_v, _onecall.ALL_GATHER_V,
                          ("auto", "ring"))
ALL_TO_ALL = Collective("all_to_all", prepare_all_to_all, _onecall.ALL_TO_ALL,
                        ("auto", "pairwise"), torch="all_to_all", jax="all_to_all")
#: its algorithms are all_to_all's (it takes no ``algorithm=`` of its own)
ALL_TO_ALL_SINGLE = Collective("all_to_all_single", prepare_all_to_all_single,
                               _onecall.ALL_TO_ALL_SINGLE, torch="all_to_all_single")

__all__ = ["ALL_GATHER_V", "ALL_TO_ALL", "ALL_TO_ALL_SINGLE", "all_gather_v_ring",
           "all_to_all_pairwise", "check_list_out", "list_out_refused", "prepare_all_gather_v",
           "prepare_all_to_all", "prepare_all_to_all_single"]
