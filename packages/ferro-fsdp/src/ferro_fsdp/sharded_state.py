"""Sharded state dicts: this rank's pieces of parameters and optimizer state, and their specs.

A *piece layout* is what a ``TensorShardSpec((n,), 0, sizes)`` describes: the pieces of all ranks,
in rank order, concatenate to the flattened tensor. Saving writes pieces in such a layout without
communication. Loading learns the layout of the pieces it is given from one small all-gather of
their lengths (so it takes ferro-checkpoint's reshard split, the layout it saved, or the full
tensor on every rank, checked to be the same on every rank by a CRC-32 of each) and only
all-gathers a tensor's data when some rank's piece does not cover the region that rank needs.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferro_backend import Backend
from ferro_backend.partition import split_bounds, split_sizes
from ferro_collective import all_gather

from . import wire_state
from .flat import FlatLayout
from .parameter import Parameter


@dataclass
class Plan:
    """How a wrapper holds its parameters locally.

    ``sharded``: each rank holds one chunk of every parameter, split over ``layout.world``
    ranks (the whole world, or a node of a HYBRID_SHARD job: rank ``q`` holds chunk
    ``q % layout.world``); else every rank holds full parameters.
    """

    backend: Backend
    names: list[str]
    params: list[Parameter]
    layout: FlatLayout
    sharded: bool
    world: int
    rank: int
    timeout: float | None = None

    def needed(self, i: int, q: int) -> tuple[int, int]:
        """``(start, length)`` of parameter ``i``'s flattened elements that rank ``q`` holds."""
        n = self.layout.numels[i]
        if not self.sharded:
            return 0, n
        parts = self.layout.world
        start, end = split_bounds(n, parts)[q % parts]
        return start, end - start

    def piece(self, i: int, local: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
        """This rank's saved piece of a local array of parameter ``i``, and every rank's size.

        Sharded: the first ``layout.world`` ranks save their chunks (a HYBRID_SHARD job saves
        its first node's), the others empty pieces. Full: ferro-checkpoint's split of the world.
        """
        n = self.layout.numels[i]
        flat = np.asarray(local).reshape(-1)
        if self.sharded:
            parts = self.layout.world
            sizes = split_sizes(n, parts) + (0,) * (self.world - parts)
            return np.array(flat[:sizes[self.rank]], copy=True), sizes
        sizes = split_sizes(n, self.world)
        start, end = split_bounds(n, self.world)[self.rank]
        return np.array(flat[start:end], copy=True), sizes

    def local_from(self, i: int, data: np.ndarray) -> np.ndarray:
        """The local array of parameter ``i`` from the elements ``needed(i, rank)``."""
        if not self.sharded:
            return np.array(data, dtype=self.layout.dtype).reshape(self.layout.shapes[i])
        out = np.zeros(self.layout.chunks[i], dtype=self.layout.dtype)
        out[:data.size] = data
        return out


def _keys(plan: Plan, optimizer: Any) -> list[tuple[str, int, str, str]]:
    """``(key, param index, kind, state key)`` for every tensor a state dict may hold."""
    keys = [(name, i, "param", "") for i, name in enumerate(plan.names)]
    if optimizer is not None:
        for i, name in enumerate(plan.names):
            for k in getattr(optimizer, "array_state_keys", ()):
                keys.append((f"optim.{name}.{k}", i, "array", k))
            for k in getattr(optimizer, "scalar_state_keys", ()):
                keys.append((f"optim.{name}.{k}", i, "scalar", k))
    return keys


def _check_optimizer(op: str, plan: Plan, optimizer: Any) -> None:
    if optimizer is None:
        return
    if not hasattr(optimizer, "state"):
        raise TypeError(f"{op}: {type(optimizer).__name__} has no .state; expected a ferro_fsdp.optim "
                        "optimizer")
    mine = {id(p) for p in getattr(optimizer, "params", ())}
    absent = [n for n, p in zip(plan.names, plan.params) if id(p) not in mine]
    if absent:
        raise ValueError(f"{op}: the optimizer does not hold the parameters {absent}; build it on "
                         "module.parameters()")


def save(plan: Plan, optimizer: Any = None) -> tuple[dict[str, np.ndarray], dict[str, tuple]]:
    _check_optimizer("sharded_state_dict", plan, optimizer)
    tensors: dict[str, np.ndarray] = {}
    specs: dict[str, tuple] = {}
    for key, i, kind, k in _keys(plan, optimizer):
        p = plan.params[i]
        n = plan.layout.numels[i]
        if kind == "param":
            tensors[key], sizes = plan.piece(i, p.data)
            specs[key] = ((n,), 0, sizes)
            continue
        state = optimizer.state.get(p, {})
        if k not in state:
            continue
        value = state[k]
        if kind == "array":
            tensors[key], sizes = plan.piece(i, np.asarray(value))
            specs[key] = ((n,), 0, sizes)
        else:
            dtype = np.int64 if isinstance(value, (int, np.integer)) else np.float64
            tensors[key] = np.array([value], dtype=dtype)
            specs[key] = ((plan.world,), 0, (1,) * plan.world)
    return tensors, specs


def load(plan: Plan, tensors: dict[str, Any], optimizer: Any = None,
         problem: str | None = None) -> None:
    """Load ``tensors`` into the parameters (and ``optimizer``), checking everything on every
    rank before it changes anything: a load that raises leaves them as they were. ``problem``:
    what a caller found wrong with the rest of the state it loads (every rank raises)."""
    _check_optimizer("load_sharded_state_dict", plan, optimizer)
    keys = _keys(plan, optimizer)
    known = {k for k, *_ in keys}
    unexpected = sorted(k for k in tensors if k not in known)
    # a tensor of more than one dim is a full one: of its parameter's shape, not only its size
    # (a transposed weight would load scrambled)
    misshaped = [(k, np.shape(tensors[k]), plan.layout.shapes[i]) for k, i, kind, _ in keys
                 if kind != "scalar" and k in tensors and np.ndim(tensors[k]) > 1
                 and np.shape(tensors[k]) != tuple(plan.layout.shapes[i])]
    lengths = np.array([np.asarray(tensors[k]).size if k in tensors else -1 for k, *_ in keys]
                       + [len(unexpected), len(misshaped), problem is not None], dtype=np.int64)
    if plan.world > 1:
        table = all_gather(lengths, plan.backend, timeout=plan.timeout).reshape(plan.world, -1)
    else:
        table = lengths.reshape(1, -1)
    if table[:, -1].any():
        where = np.flatnonzero(table[:, -1]).tolist()
        raise ValueError(problem or f"load_sharded_state_dict: refused on ranks {where} "
                                    f"(see theirs)")
    if table[:, -3].any():
        raise ValueError(f"load_sharded_state_dict: unexpected keys {unexpected} on rank {plan.rank} "
                         f"({int(table[:, -3].sum())} over all ranks)")
    if table[:, -2].any():
        where = np.flatnonzero(table[:, -2]).tolist()
        said = "; ".join(f"{k!r} has shape {got}, its parameter {want}"
                         for k, got, want in misshaped) or "see theirs"
        raise ValueError(f"load_sharded_state_dict: full tensors of another shape on ranks "
                         f"{where} ({said})")
    missing = [k for j, (k, _, kind, _) in enumerate(keys) if kind == "param" and (table[:, j] < 0).all()]
    if missing:
        raise ValueError(f"load_sharded_state_dict: missing parameter keys {missing}")
    _check_complete(plan, keys, table, optimizer)
    _check_full_claims(plan, keys, tensors, table)
    new_state: dict[int, dict[str, Any]] = {}
    new_params: list[tuple[Parameter, np.ndarray]] = []  # set once all have loaded
    for j, (key, i, kind, k) in enumerate(keys):
        col = table[:, j]
        if (col < 0).all():
            continue
        if (col < 0).any():
            raise ValueError(f"load_sharded_state_dict: {key!r} is present on ranks "
                             f"{np.flatnonzero(col >= 0).tolist()} only")
        if kind == "scalar":
            value = _load_scalar(plan, key, tensors[key], col)
            new_state.setdefault(i, {})[k] = value
            continue
        data = _load_region(plan, key, i, np.asarray(tensors[key]), col)
        local = plan.local_from(i, data)
        if kind == "param":
            new_params.append((plan.params[i], local))
        else:
            new_state.setdefault(i, {})[k] = local
    for p, local in new_params:
        if p.data.shape == local.shape and p.data.dtype == local.dtype and p.data.flags.writeable:
            p.data[...] = local
        else:
            p.data = local
    if optimizer is not None:
        for i, p in enumerate(plan.params):
            if i in new_state:
                optimizer.state[p] = new_state[i]
            else:
                optimizer.state.pop(p, None)


def _check_complete(plan: Plan, keys: list, table: np.ndarray, optimizer: Any) -> None:
    """Refuse (on every rank: ``table`` is every rank's) optimizer state that names a
    parameter without all of the optimizer's ``required_state_keys`` (Adam's moments without
    its step count, or one moment)."""
    required = getattr(optimizer, "required_state_keys", ())
    held: dict[int, set[str]] = {}
    for j, (_, i, kind, k) in enumerate(keys):
        if kind != "param" and (table[:, j] >= 0).any():
            held.setdefault(i, set()).add(k)
    for i, ks in held.items():
        lacking = [k for k in required if k not in ks]
        if lacking:
            raise ValueError(f"load_sharded_state_dict: the optimizer state of "
                             f"{plan.names[i]!r} lacks {[f'optim.{plan.names[i]}.{k}' for k in lacking]} "
                             f"(it has {sorted(ks)})")


def _check_full_claims(plan: Plan, keys: list, tensors: dict[str, Any], table: np.ndarray) -> None:
    """Refuse (on every rank, before anything is loaded) pieces taken for the full tensor on
    every rank that are not the same on every rank.

    Every rank holding exactly ``n`` elements of a parameter of ``n`` elements is either the full
    tensor on every rank or the shards of a tensor ``world`` times larger (a checkpoint of a
    model of another shape: hidden width halved on 2 ranks). One all-gather of a CRC-32 of each
    such piece tells them apart.
    """
    if plan.world <= 1:
        return
    claims = []
    for j, (key, i, kind, _) in enumerate(keys):
        n = plan.layout.numels[i]
        col = table[:, j]
        if kind != "scalar" and n > 0 and (col == n).all():
            claims.append((key, i))
    if not claims:
        return
    sums = np.array([zlib.crc32(np.ascontiguousarray(np.asarray(tensors[key]).reshape(-1),
                                                     dtype=plan.layout.dtype).tobytes())
                     for key, _ in claims], dtype=np.int64)
    every = all_gather(sums, plan.backend, timeout=plan.timeout).reshape(plan.world, -1)
    for c, (key, i) in enumerate(claims):
        differ = np.flatnonzero(every[:, c] != every[0, c]).tolist()
        if differ:
            n = plan.layout.numels[i]
            raise ValueError(
                f"load_sharded_state_dict: {key!r} does not fit this model's parameter of shape "
                f"{plan.layout.shapes[i]} ({n} elements): every one of the {plan.world} ranks "
                f"holds {n} elements, but ranks {differ} hold other values than rank 0, so they "
                f"are not the full tensor on every rank but shards of a tensor of "
                f"{n * plan.world} elements. Was the checkpoint saved from a model of another "
                "shape?")


def _gather_pieces(plan: Plan, piece: np.ndarray, col: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Every rank's piece, concatenated in rank order (one all-gather, padded to the longest)."""
    width = int(col.max())
    buf = np.zeros(width, dtype=dtype)
    buf[:piece.size] = piece.reshape(-1)
    table = all_gather(buf, plan.backend, timeout=plan.timeout).reshape(plan.world, width)
    return np.concatenate([table[q, :int(col[q])] for q in range(plan.world)])


def _load_region(plan: Plan, key: str, i: int, piece: np.ndarray, col: np.ndarray) -> np.ndarray:
    n = plan.layout.numels[i]
    total = int(col.sum())
    if total == n:
        starts = np.concatenate([[0], np.cumsum(col)[:-1]])
        covers = [(int(starts[q]), int(col[q])) for q in range(plan.world)]
    elif (col == n).all():
        covers = [(0, n)] * plan.world
    else:
        shape = plan.layout.shapes[i]
        raise ValueError(
            f"load_sharded_state_dict: {key!r} does not fit this model's parameter of shape "
            f"{shape} ({n} elements): expected 1-d shards whose sizes over the {plan.world} "
            f"ranks add up to {n} (e.g. {list(split_sizes(n, plan.world))}), or the full {n} "
            f"elements on every rank; got shard sizes {col.tolist()} ({total} elements in all, "
            f"this rank's shard of shape {tuple(np.shape(piece))}). Was the checkpoint saved "
            "from a model of another shape?")

    def inside(q: int) -> bool:
        s, length = plan.needed(i, q)
        cs, cl = covers[q]
        return length == 0 or (cs <= s and s + length <= cs + cl)

    start, length = plan.needed(i, plan.rank)
    piece = np.asarray(piece, dtype=plan.layout.dtype).reshape(-1)
    if all(inside(q) for q in range(plan.world)):
        off = start - covers[plan.rank][0]
        return piece[max(off, 0):max(off, 0) + length]
    full = _gather_pieces(plan, piece, col, plan.layout.dtype)
    if total != n:
        full = full[:n]
    return full[start:start + length]


def _load_scalar(plan: Plan, key: str, piece: Any, col: np.ndarray) -> int | float:
    piece = np.asarray(piece).reshape(-1)
    if int(col.sum()) == 0:
        raise ValueError(f"load_sharded_state_dict: {key!r} is empty on every rank")
    dtype = np.int64 if piece.dtype.kind in "iub" else np.float64
    if (col >= 1).all():
        value = piece[0]
    else:
        value = _gather_pieces(plan, piece.astype(np.float64), col, np.dtype(np.float64))[0]
    return int(value) if dtype is np.int64 else float(value)


class ShardedStateDicts:
    """FSDP's whole-model views and sharded state dicts (a mixin of :class:`~ferro_fsdp.FSDP`)."""

    def full_state_dict(self) -> dict[str, np.ndarray]:
        """``{name: full parameter}`` on every rank (copies). Collective for sharded strategies.

        Returns
        -------
        dict of str to numpy.ndarray
            In ``named_parameters`` order.
        """
        if self._spec.shards_params:
            full = self._gather()
        else:
            full = [p.data for p in self._params]
        return {n: np.array(a, copy=True) for n, a in zip(self._names, full)}

    def sharded_state_dict(self, optimizer: Any = None
                           ) -> tuple[dict[str, np.ndarray], dict[str, tuple]]:
        """This rank's pieces of the parameters (and optimizer state) and their shard specs.

        Returns ``(tensors, specs)``: ``tensors[name]`` is a 1-d array, ``specs[name]`` is
        ``(full_shape, shard_dim, shard_sizes)`` = ``((n,), 0, sizes)`` where concatenating every
        rank's piece in rank order gives the flattened tensor (ferro-checkpoint's
        ``TensorShardSpec(*spec)``). Parameters are saved under their names, optimizer state as
        ``"optim.<name>.<key>"`` (``momentum_buffer``; ``exp_avg``, ``exp_avg_sq``, ``step``).
        ``step`` is an int64 piece of one element per rank (full shape ``(world,)``).
        FULL_SHARD / SHARD_GRAD_OP / NO_SHARD save ferro-checkpoint's own split
        (``sizes[r] = n // W + (r < n % W)``); HYBRID_SHARD saves the first node's chunks and
        empty pieces elsewhere. With ``grads_wire="int8"`` / ``"int4"`` each rank's error
        feedback is saved too, as ``"wire_error.<unit>.<k>"`` pieces and ``"wire_error.world"``
        (``ferro_fsdp.wire_state``): a resumed run on the same world size goes on with the
        same bits as an unbroken one. No communication.

        Parameters
        ----------
        optimizer : ferro_fsdp.optim.Optimizer, optional
            An optimizer built on ``module.parameters()``: its state is saved too.

        Returns
        -------
        tensors : dict of str to numpy.ndarray
            This rank's 1-d piece of each tensor.
        specs : dict of str to tuple
            ``(full_shape, shard_dim, shard_sizes)`` of each tensor.

        Raises
        ------
        TypeError, ValueError
            ``optimizer`` has no ``.state``, or does not hold the module's parameters.

        Examples
        --------
        >>> tensors, specs = fsdp.sharded_state_dict(opt)
        >>> meta = ShardMetadata(world, {k: TensorShardSpec(*v) for k, v in specs.items()})
        >>> save_distributed(tensors, "ckpt", rank, world, meta)  # ferro_checkpoint
        """
        tensors, specs = save(self._state_plan(), optimizer)
        # grads_wire int8 / int4: this rank's error feedback too (ferro_fsdp.wire_state)
        errors, error_specs = wire_state.save(self._units, self._backend.world_size)
        tensors.update(errors)
        specs.update(error_specs)
        return tensors, specs

    def load_sharded_state_dict(self, tensors: dict[str, Any], optimizer: Any = None) -> None:
        """Load pieces saved by :meth:`sharded_state_dict` on any world size and strategy.

        ``tensors`` is this rank's piece of each tensor such that the pieces of all ranks, in
        rank order, concatenate to the flattened tensor (what ferro-checkpoint's
        ``load_distributed``/``reshard`` return), or the full tensor on every rank (the same
        on every rank: pieces of the parameter's size that differ between ranks are the shards
        of a model of another shape, and are refused). Optimizer
        state is loaded into ``optimizer`` (built on ``module.parameters()``); keys it does not
        find start fresh, and so does ``grads_wire``'s error feedback where it was not saved or
        was saved on another world size, and a residual this configuration's steps do not feed
        back (of another strategy or wrap policy; both with a RuntimeWarning). Collective: every
        rank must call it.

        Parameters
        ----------
        tensors : dict of str to array_like
            This rank's piece of every parameter (and optimizer state) key, or the full tensors.
        optimizer : ferro_fsdp.optim.Optimizer, optional
            Receives the saved optimizer state.

        Raises
        ------
        ValueError
            Missing parameter keys, unexpected keys, pieces that do not add up, "full
            tensors" that differ between ranks, or a malformed error feedback key (on every
            rank, before anything is changed: a refused load leaves the parameters, the
            optimizer state and the error feedback as they were).
        TypeError
            ``optimizer`` has no ``.state``.

        Examples
        --------
        >>> tensors = load_distributed("ckpt", rank, world)  # ferro_checkpoint, any world size
        >>> fsdp.load_sharded_state_dict(tensors, opt)
        """
        rest, errors = wire_state.split(tensors)
        if self._grads_wire not in ("int8", "int4"):  # (fed back by no step: not kept either,
            errors = {}                                # lest a later save carry it stale)
        problem, loaded = None, wire_state.Loaded([], [])
        try:  # checked with the rest, on every rank, before anything changes
            loaded = wire_state.prepare(self._units, errors, self._backend.world_size,
                                        self._backend.rank)
        except ValueError as e:
            problem = str(e)
        load(self._state_plan(), rest, optimizer, problem)
        wire_state.apply(self._units, loaded)

    def _state_plan(self) -> Plan:
        return Plan(self._backend, self._names, self._params, self._layout,
                    self._spec.shards_params, self._backend.world_size, self._backend.rank,
                    self._timeout)
