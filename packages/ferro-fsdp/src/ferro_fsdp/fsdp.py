"""Fully sharded data parallel for numpy models: the :class:`FSDP` wrapper, flattened and padded.

An :class:`FSDP` shards its module's parameters in units (:mod:`ferro_fsdp.units`): with
``wrap=None`` the whole module is one unit, so a forward is one all-gather and a gradient sync
one reduce-scatter (or one allreduce); with ``wrap=`` (:mod:`ferro_fsdp.wrap_policy`) every
wrapped submodule is its own unit, gathered just before it runs and freed right after, and its
gradients' reduction starts as soon as its backward is done. FSDP never replaces a Parameter
object; it swaps ``.data`` and ``.grad``. What each strategy does is read from its
:class:`~ferro_fsdp.strategy.StrategySpec`; what ``.data`` and ``.grad`` hold under each
strategy, and the padding of chunks, are in the package README.

This module builds an FSDP (process groups, shards, units) and holds its accessors; the rest
comes from mixins: :mod:`ferro_fsdp.schedule` runs forward and backward unit by unit,
:mod:`ferro_fsdp.grad_sync` averages the gradients and :mod:`ferro_fsdp.sharded_state` saves and loads
sharded state dicts.

A training step::

    out = fsdp(x)                         # per unit: all-gather, run, free
    loss = loss_fn(out, y)
    fsdp.backward(loss_fn.backward())     # per unit: all-gather, run backward, start its reduce
    fsdp.sync_gradients()                 # wait for the reductions: .grad = this rank's chunk
    opt.step(); opt.zero_grad()           # on fsdp.module.parameters(): the shards
    fsdp.broadcast_updated_params()       # SHARD_GRAD_OP only (a no-op otherwise)
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ferro_backend import Backend, InvalidWorldSizeError, SubBackend, pack
from ferro_collective import all_gather, broadcast
from ferro_collective.wire import check_wire

from .background import runs_in_background
from .buffer_pool import BufferPool
from .flat import FlatLayout
from .grad_sync import GradientSync
from .module import Module
from .parameter import Parameter
from .schedule import UnitSchedule
from .sharded_state import ShardedStateDicts, load
from .strategy import ShardingStrategy
from .units import Unit
from .wrap_policy import find_units, owners
from .wrapper import ModuleWrapper


class FSDP(UnitSchedule, ModuleWrapper, Module, GradientSync, ShardedStateDicts):
    """Shard ``module``'s parameters over ``backend``'s ranks with ``strategy``.

    Parameters
    ----------
    module : Module
        A :class:`~ferro_fsdp.Module`; all its parameters must share one floating dtype. Every
        rank must pass a module with the same parameter shapes (use ``sync_module_states=True``
        when their values may differ).
    backend : ferro_backend.Backend
        The ranks to shard over (any ``ferro_backend.Backend``).
    strategy : ShardingStrategy or str, default ShardingStrategy.FULL_SHARD
        A :class:`ShardingStrategy` (or its name, ``"full_shard"``...).
    wrap : None, Module subclass, tuple of them, or int, default None
        None: the whole module is one unit. A Module subclass (or a tuple of them): every
        submodule of those types is its own unit. An int: submodules whose parameters (not
        already in a deeper unit) add up to at least that many elements are units, in module
        order. The parameters no unit claims form the root unit. A parameter registered under
        modules of several units (a tied weight), or under a unit and outside every unit,
        belongs to the innermost unit that holds all of them (the root unit when none does),
        so it is full whenever any of its users runs and its gradient sums every use. Units
        change when parameters are gathered and gradients reduced, never the results (the
        same bits as ``wrap=None``).
        An FSDP built on a submodule beforehand (same backend and strategy) may also sit inside
        ``module``: it stays its own unit, and this FSDP's ``sync_gradients``, state dicts and
        ``clip_grad_norm_`` cover its parameters too.
    intra_node_size : int, optional
        HYBRID_SHARD (and FULL_SHARD with ``secondary_shard``): ranks per node; the world size
        must be a positive multiple of it.
    reshard_after_forward : bool or dict of str to bool, optional
        Free each unit's gathered parameters after its ``forward`` (FULL_SHARD / HYBRID_SHARD;
        default True, as torch); its ``backward`` then gathers them again. With False they stay
        until the unit's backward. A dict ``{unit name: bool}`` sets it per unit (unit names
        are dotted module paths, ``""`` for the root unit; others keep the default).
    sync_module_states : bool, default False
        Broadcast rank 0's parameters before sharding.
    timeout : float, optional
        Passed to every collective; None (the default) leaves each collective the
        backend's own ``backend.timeout``.
    background : bool, optional
        Run the gathers and reductions on the collectives' background thread while the model
        computes (True), or in the training thread at the same points (False; the same bits).
        None (the default) follows ``FERRO_BACKGROUND`` (auto: in the background only when
        this host has a core to spare beyond its ranks; ``ferro_fsdp.background``).
    weights_wire : {None, "bf16", "fp16", "int8", "int4"}
        Gather the parameters in that wire format (``ferro_collective.wire``; ZeRO++'s
        quantized weights): every rank computes with the same decoded full parameters (its own
        shard's too), while the optimizer updates the exact shards. None: exact. Refused
        under NO_SHARD, which gathers no parameters.
    grads_wire : {None, "bf16", "fp16", "int8", "int4"}
        Reduce the gradients in that wire format (the reduce-scatter, NO_SHARD's allreduce and
        HYBRID_SHARD's allreduce across the replicas), folded in float32. With "int8" and
        "int4" each rank feeds back what every encoding it makes rounded away into the next
        step's (error feedback: its reduce-scatter or allreduce contribution, a buffer of the
        unit's full gradient size per rank, and the chunk an allreduce folds on it before its
        all-gather; ``ferro_collective.wire.Feedback``; saved with the sharded state dict), so
        the error summed over steps stays that of one step, under every strategy. None: exact.
    secondary_shard : bool, default False
        FULL_SHARD across nodes of ``intra_node_size`` ranks (ZeRO++'s hpZ): the forward's
        all-gather over the world leaves each rank a secondary shard of the parameters it
        gathered (its node's share, ``1/intra_node_size`` of each unit), and the backward
        gathers them inside the node from those instead of across the world: the same
        values (with ``weights_wire``, the forward's decoded ones), half the all-gathers
        across nodes, at the cost of the secondary shards' memory. Units that keep their
        parameters after the forward (``reshard_after_forward=False``) gather nothing again.

    Raises
    ------
    InvalidWorldSizeError
        HYBRID_SHARD without a valid ``intra_node_size`` (a divisor of the world size).
    ValueError
        ``intra_node_size`` with another strategy, an unknown strategy or wire format, a nested FSDP on
        another backend or strategy, an unknown unit name in ``reshard_after_forward``,
        ``weights_wire`` under NO_SHARD.
    TypeError
        Not a Module, parameters of mixed or non-floating dtypes, a ``wrap`` of another kind.

    Examples
    --------
    >>> model = nn.Sequential(nn.Linear(8, 32, rng=0), nn.ReLU(), nn.Linear(32, 2, rng=1))
    >>> fsdp = FSDP(model, backend, "full_shard")
    >>> opt = optim.AdamW(fsdp.parameters(), lr=1e-3)  # this rank's shards
    >>> loss = loss_fn(fsdp(x), y)
    >>> fsdp.backward(loss_fn.backward()); fsdp.sync_gradients()
    >>> opt.step(); opt.zero_grad()
    """

    def __init__(self, module: Module, backend: Backend,
                 strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD, *,
                 wrap: Any = None, intra_node_size: int | None = None,
                 reshard_after_forward: bool | dict[str, bool] | None = None,
                 sync_module_states: bool = False, timeout: float | None = None,
                 background: bool | None = None, weights_wire: str | None = None,
                 grads_wire: str | None = None, secondary_shard: bool = False) -> None:
        Module.__init__(self)
        if not isinstance(module, Module):
            raise TypeError(f"FSDP: module is a {type(module).__name__}, expected a ferro_fsdp.Module")
        strategy = ShardingStrategy.coerce(strategy)
        self._module = module
        self._backend = backend
        self._strategy = strategy
        self._timeout = timeout
        self._background = runs_in_background(backend, background)
        spec = strategy.spec
        self._spec = spec
        world, rank = backend.world_size, backend.rank
        self._intra: Backend | None = None
        self._inter: Backend | None = None
        mine = _instance_suffix(backend)
        if spec.shard_group == "intra":
            self._intra = _node_group(backend, intra_node_size, strategy.name,
                                      f"fsdp-intra{mine}")
            self._inter = SubBackend(backend, range(rank % intra_node_size, world, intra_node_size),
                                     name=f"fsdp-inter{mine}")
        elif secondary_shard:
            if strategy is not ShardingStrategy.FULL_SHARD:
                raise ValueError(f"FSDP: secondary_shard is for FULL_SHARD (a node's copy of the "
                                 f"parameters for the backward's gather), got {strategy.name}")
            self._intra = _node_group(backend, intra_node_size, "secondary_shard",
                                      f"fsdp-secondary{mine}")
        elif intra_node_size is not None:
            raise ValueError(f"FSDP: intra_node_size {intra_node_size} is only valid for HYBRID_SHARD "
                             f"(or FULL_SHARD with secondary_shard), got {strategy.name}")
        self._intra_node_size = intra_node_size
        self._secondary = bool(secondary_shard)
        if weights_wire is not None and spec.shard_group is None:
            raise ValueError(f"FSDP: weights_wire={weights_wire!r} compresses the parameters' "
                             f"all-gather, and {strategy.name} gathers none (each rank keeps "
                             "them whole); grads_wire compresses its gradients' allreduce")

        unit_modules, nested = find_units(module, wrap, lambda m: isinstance(m, FSDP))
        for name, inner in nested:
            if inner._backend is not backend or inner._strategy is not strategy:
                raise ValueError(
                    f"FSDP: nested FSDP {name!r} shards over {inner._backend!r} with "
                    f"{inner._strategy.name}; a nested FSDP must use this FSDP's backend and "
                    f"strategy ({backend!r}, {strategy.name})")
        self._nested: list[FSDP] = [inner for _, inner in nested]
        named = module.named_parameters()
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        dtypes = {p.data.dtype for p in self._params}
        if len(dtypes) > 1:
            raise TypeError(f"FSDP: parameters have dtypes {sorted(map(str, dtypes))}; one flat "
                            "buffer needs a single dtype")
        dtype = dtypes.pop() if dtypes else np.dtype(np.float32)
        if dtype.kind not in "fc":
            raise TypeError(f"FSDP: parameter dtype {dtype} is not floating")
        for what, wire in (("weights_wire", weights_wire), ("grads_wire", grads_wire)):
            if wire is not None:
                check_wire(wire, f"FSDP {what}")
                if dtype.kind != "f":
                    raise TypeError(f"FSDP {what}={wire!r}: wire formats compress real float "
                                    f"dtypes, not {dtype}")
        self._weights_wire, self._grads_wire = weights_wire, grads_wire
        groups = {"world": backend, "intra": self._intra, "inter": self._inter, None: None}
        self._shard_group: Backend | None = groups[spec.shard_group]
        self._replicate_group: Backend | None = groups[spec.replicate_group]
        shard_world = self._shard_group.world_size if self._shard_group is not None else 1
        self._shard_rank = self._shard_group.rank if self._shard_group is not None else 0
        nested_ids = {id(p) for inner in self._nested for p in inner._module.parameters()}
        own = [i for i, p in enumerate(self._params) if id(p) not in nested_ids]
        # a nested FSDP has sharded its parameters already: the layout describes the full ones
        shapes = [self._nested_full_shape(p) if id(p) in nested_ids else p.data.shape
                  for p in self._params]
        self._layout = FlatLayout(shapes, dtype, shard_world)
        self._full_layout = FlatLayout(shapes, dtype, 1)
        self._check_same_parameters(
            "FSDP", [(n, tuple(shape), dtype.str, p.requires_grad)
                     for n, p, shape in zip(self._names, self._params, shapes)], backend, timeout)

        if sync_module_states and world > 1 and own:
            flat = self._pack_full([self._params[i].data for i in own],
                                   [shapes[i] for i in own])
            flat = broadcast(flat, backend, 0, timeout=timeout)
            for i, value in zip(own, FlatLayout([shapes[i] for i in own], dtype, 1)
                                .gathered_to_full(flat)):
                self._params[i].data = np.array(value, copy=True)
        if spec.shards_params:
            for i in own:
                p = self._params[i]
                p.data = self._layout.shard_of(i, p.data, self._shard_rank)
                p.grad = None
        self._pool = BufferPool()
        self._units = self._make_units(unit_modules, own, reshard_after_forward)
        self._root = self._units[0]
        self._init_schedule()

    # -- whole-model state dicts: full tensors, as torch's FSDP.state_dict --------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """``{name: full parameter}`` on every rank (copies), as torch's ``FSDP.state_dict``:
        :meth:`~ferro_fsdp.FSDP.full_state_dict` (not this rank's flat shards, which
        :meth:`~ferro_fsdp.FSDP.sharded_state_dict` saves). Collective for the sharded
        strategies.

        Returns
        -------
        dict of str to numpy.ndarray
            In ``named_parameters`` order.
        """
        return self.full_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load full parameters (what :meth:`~ferro_fsdp.FSDP.state_dict` returns, or a
        one-process model's ``state_dict``), the same on every rank: each rank keeps its
        shard (or, NO_SHARD, the whole). The optimizer's state and ``grads_wire``'s error
        feedback are left as they are (:meth:`~ferro_fsdp.FSDP.load_sharded_state_dict` loads
        them). Collective: every rank must call it.

        Parameters
        ----------
        state : dict of str to array_like
            Every parameter's full tensor under its name (cast to the parameters' dtype).

        Raises
        ------
        KeyError
            Missing or unexpected names.
        ValueError
            A tensor of another shape than its parameter.
        """
        missing = [n for n in self._names if n not in state]
        unexpected = [n for n in state if n not in self._names]
        if missing or unexpected:
            raise KeyError(f"FSDP.load_state_dict: missing keys {missing}, unexpected keys "
                           f"{unexpected}")
        for name, shape in zip(self._names, self._layout.shapes):
            if np.shape(state[name]) != tuple(shape):
                raise ValueError(f"FSDP.load_state_dict: {name!r} has shape "
                                 f"{np.shape(state[name])}, expected the full {tuple(shape)}")
        load(self._state_plan(), state)

    def _nested_full_shape(self, p: Parameter) -> tuple[int, ...]:
        for inner in self._nested:
            for q, shape in zip(inner._params, inner._layout.shapes):
                if q is p:
                    return shape
        raise AssertionError("unreachable: parameter of no nested FSDP")

    def _make_units(self, unit_modules: list[tuple[str, Module]], own: list[int],
                    reshard: Any) -> list[Unit]:
        default = self._spec.shards_params
        per_unit: dict[str, bool] = {}
        if isinstance(reshard, dict):
            known = {"", *(name for name, _ in unit_modules)}
            unknown = sorted(set(reshard) - known)
            if unknown:
                raise ValueError(f"FSDP: reshard_after_forward names {unknown}, which are not "
                                 f"units; the units are {sorted(known)}")
            per_unit = {k: bool(v) and default for k, v in reshard.items()}
        elif reshard is not None:
            default = bool(reshard) and default
        owner = owners(self._module, unit_modules, {id(self._params[i]): i for i in own},
                       lambda m: isinstance(m, FSDP))
        subs = [Unit(self, name, m, sorted(i for i in own if owner[i] == name),
                     per_unit.get(name, default)) for name, m in unit_modules]
        root = Unit(self, "", None, [i for i in own if owner[i] == ""],
                    per_unit.get("", default))
        order = {name: k for k, (name, _) in enumerate(sorted(unit_modules, key=lambda t: (
            self._first_param(t[1]), t[0])))}
        subs.sort(key=lambda u: order[u.name])
        return [root, *subs]

    def _first_param(self, m: Module) -> int:
        ids = {id(p) for p in m.parameters()}
        return min((i for i, p in enumerate(self._params) if id(p) in ids), default=-1)

    # -- module tree: an FSDP inside a module is transparent -----------------------------------
    def _collect(self, prefix: str, recurse: bool, out: list, seen: set[int]) -> None:
        self._module._collect(prefix, recurse, out, seen)

    def named_children(self) -> list[tuple[str, Module]]:
        """The wrapped module's direct submodules: FSDP is transparent in the module tree, so names
        (and ``state_dict`` keys) are the same with or without the wrapper.

        Returns
        -------
        list of (str, Module)
        """
        return self._module.named_children()

    # -- accessors --------------------------------------------------------------------------
    @property
    def strategy(self) -> ShardingStrategy:
        """The :class:`ShardingStrategy` this FSDP runs with (a name given to the constructor,
        converted).
        """
        return self._strategy

    @property
    def intra_node_size(self) -> int | None:
        """HYBRID_SHARD: the number of consecutive ranks that shard among themselves (a node);
        None for the other strategies.
        """
        return self._intra_node_size

    @property
    def intra_node_group(self) -> Backend | None:
        """HYBRID_SHARD: this rank's node (the ranks it shards with); else None."""
        return self._intra

    @property
    def inter_node_group(self) -> Backend | None:
        """HYBRID_SHARD: the ranks holding the same chunk on other nodes; else None."""
        return self._inter

    @property
    def layout(self) -> FlatLayout:
        """The flat layout: shapes, chunk sizes, padding (its ``world`` is the sharding group's size)."""
        return self._layout

    @property
    def param_names(self) -> list[str]:
        """The dotted names of the parameters FSDP manages, in ``named_parameters`` order (a
        copy: editing it changes nothing).
        """
        return list(self._names)

    @property
    def full_params(self) -> list[Parameter]:
        """Full parameters of the last forward, in ``named_parameters`` order (empty after a
        sync; parameters of nested FSDPs are theirs, not listed here).

        Their ``.grad`` collects the full gradients of ``backward`` until the unit's reduction
        starts (``sync_gradients``, or the end of the unit's backward outside ``no_sync()``).
        Under FULL_SHARD / HYBRID_SHARD their ``.data`` is freed (an empty array) outside the
        unit's ``forward`` and ``backward`` unless ``reshard_after_forward=False``.
        """
        if self._root.fps is None:
            return []
        by_index = {i: fp for u in self._units for i, fp in zip(u.idx, u.ensure_fps())}
        return [by_index[i] for i in sorted(by_index)]

    @property
    def units(self) -> list[str]:
        """The units' names (dotted module paths; ``""`` is the root unit), root first."""
        return [u.name for u in self._units]

    @property
    def has_pending_prefetch(self) -> bool:
        """Whether a unit's all_gather started by :meth:`prefetch_forward_params` (or ``forward``'s
        one-ahead prefetch) is in flight and not yet consumed by ``forward``.
        """
        return any(u.pending is not None for u in self._units)

    def local_param_bytes(self) -> int:
        """Bytes of parameter data this rank holds now (its shards, plus full parameters if held).

        Returns
        -------
        int
        """
        held = {id(_root(p.data)): _root(p.data).nbytes for p in self._params}
        for u in self._units:
            for fp in u.fps or ():
                held.setdefault(id(_root(fp.data)), _root(fp.data).nbytes)
        return sum(held.values())

    def __repr__(self) -> str:
        return (f"FSDP(strategy={self._strategy.name}, rank={self._backend.rank}, "
                f"world_size={self._backend.world_size}, units={len(self._units)}, "
                f"{self._layout!r})")

    # -- gathering --------------------------------------------------------------------------
    def _pack_full(self, arrays: list[np.ndarray | None],
                   shapes: list[tuple[int, ...]] | None = None) -> np.ndarray:
        shapes = list(self._layout.shapes) if shapes is None else shapes
        out = np.empty(sum(int(np.prod(s)) for s in shapes), dtype=self._layout.dtype)
        if arrays:
            pack([np.zeros(s, self._layout.dtype) if a is None else
                  np.ascontiguousarray(a, dtype=self._layout.dtype)
                  for a, s in zip(arrays, shapes)], out=out.view(np.uint8))
        return out

    def _gather(self) -> list[np.ndarray]:
        """Every full parameter (views into one new buffer) from this rank's shards."""
        flat = self._layout.pack_shards([p.data for p in self._params])
        if self._layout.world > 1 and self._layout.numel:
            flat = all_gather(flat, self._shard_group, timeout=self._timeout)
        return self._layout.gathered_to_full(flat)


_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _instance_suffix(backend: Backend) -> str:
    """What this FSDP's subgroups' names end with: "" for the first FSDP built on ``backend``,
    "#k" for the k-th after it (every rank builds its FSDPs in one order, so the same k). A
    subgroup's tags come from its members and name: a nested FSDP's node groups had its
    parent's, and their calls in flight at once crossed (a mismatch, or two same-sized units'
    gradients swapped)."""
    try:
        k = _BUILT.get(backend, 0)
        _BUILT[backend] = k + 1
    except TypeError:  # a backend that takes no weak reference: names as before
        return ""
    return f"#{k}" if k else ""


def _node_group(backend: Backend, intra_node_size: Any, what: str, name: str) -> Backend:
    """This rank's node: ``intra_node_size`` consecutive ranks (a positive divisor of the world
    size, else InvalidWorldSizeError naming ``what`` asked for it)."""
    world = backend.world_size
    if intra_node_size is None or isinstance(intra_node_size, bool) or \
            not isinstance(intra_node_size, int) or intra_node_size <= 0 or \
            world % intra_node_size:
        raise InvalidWorldSizeError(
            f"FSDP {what}: world_size {world} must be a positive multiple of "
            f"intra_node_size {intra_node_size}")
    node = backend.rank // intra_node_size
    return SubBackend(backend, range(node * intra_node_size, (node + 1) * intra_node_size),
                      name=name)


def _root(arr: np.ndarray) -> np.ndarray:
    while isinstance(getattr(arr, "base", None), np.ndarray):
        arr = arr.base
    return arr


__all__ = ["FSDP"]
