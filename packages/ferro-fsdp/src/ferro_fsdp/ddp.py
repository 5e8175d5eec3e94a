"""DistributedDataParallel: replicated parameters, gradients averaged in persistent buckets.

At construction rank 0's parameters are broadcast (one fused message per bucket). Parameters are
assigned to buckets in reverse ``named_parameters`` order (the order a backward pass produces
gradients, as in torch); each bucket holds parameters of one dtype and at most ``bucket_cap_mb``
(a larger parameter gets a bucket of its own). Each bucket is one persistent flat buffer and every
parameter's ``.grad`` is a view into it (torch's ``gradient_as_bucket_view``): layers write their
gradients straight into the bucket, nothing is packed per step, and the allreduce is in place.

Overlap: during ``DDP.backward`` a hook on every module that owns parameters marks them ready when
the module says its gradients are final (``Module.grads_ready``: a ``Linear`` does before it
computes its input's gradient) or else when its backward returns; as soon as a bucket's last
gradient is written its allreduce starts in the background while the rest of the backward runs
(or, when no core is free for it, runs there in the training thread, on gradients still in the
cache: ``ferro_fsdp.background``).
Buckets start in bucket order on every rank (a ready bucket waits for the ones before it), so all
ranks issue the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ferro_backend import Backend
from ferro_collective import Work, broadcast

from . import sharded_state
from .background import mean_in_place, runs_in_background
from .comm_hooks import GradBucket
from .flat import FlatLayout
from .module import Module
from .wrapper import ModuleWrapper


class DistributedDataParallel(ModuleWrapper):
    """Data parallel training of ``module`` over ``backend`` (every rank holds the full model).

    ``backward(grad_output)`` runs ``module.backward`` and then ``sync_gradients()`` (unless
    inside ``no_sync()``); a model trained without ``backward`` calls ``sync_gradients()``
    itself. After the sync every rank's ``.grad`` is the mean over ranks, bit-identical, and a
    view into its bucket (it stays one across steps; ``zero_grad`` may set it to None).

    Parameters
    ----------
    module : Module
        The model; every rank passes one with the same parameter shapes.
    backend : ferro_backend.Backend
    bucket_cap_mb : float, default 25.0
        Largest bucket, in MiB (torch's default, 25).
    first_bucket_cap_mb : float, optional
        Largest first bucket (the last parameters', whose gradients the backward writes first),
        in MiB: a small one starts the link early in the backward, as torch's DDP does with 1
        MiB. None (the default): ``bucket_cap_mb``.
    broadcast_parameters : bool, default True
        Broadcast rank 0's parameters at construction (default True).
    timeout : float, optional
        Passed to every collective; None (the default) leaves each collective the
        backend's own ``backend.timeout``.
    overlap : bool, default True
        Start each bucket's allreduce during ``backward`` as soon as its gradients are written
        (default True). With False every bucket starts after the backward.
    background : bool, optional
        Run the bucket allreduces on the collectives' background thread while the backward
        goes on (True), or in the training thread where each bucket starts, on gradients still
        in the cache (False; the same bits). None (the default) follows ``FERRO_BACKGROUND``
        (auto: in the background only when this host has a core to spare beyond its ranks;
        ``ferro_fsdp.background``).

    Raises
    ------
    TypeError, ValueError
        ``module`` is not a Module; ``bucket_cap_mb`` or ``first_bucket_cap_mb`` is not a
        finite real number > 0 (numpy's included).

    Examples
    --------
    >>> ddp = DDP(model, backend); loss = loss_fn(ddp(x), y)
    >>> ddp.backward(loss_fn.backward()); opt.step()  # .grad: the mean over ranks
    """

    def __init__(self, module: Module, backend: Backend, *, bucket_cap_mb: float = 25.0,
                 first_bucket_cap_mb: float | None = None, broadcast_parameters: bool = True,
                 timeout: float | None = None, overlap: bool = True,
                 background: bool | None = None) -> None:
        if not isinstance(module, Module):
            raise TypeError(f"DDP: module is a {type(module).__name__}, expected a ferro_fsdp.Module")
        for name, cap in (("bucket_cap_mb", bucket_cap_mb),
                          ("first_bucket_cap_mb", first_bucket_cap_mb)):
            if cap is None and name == "first_bucket_cap_mb":
                continue
            if isinstance(cap, bool | np.bool_) or not isinstance(cap, numbers.Real) \
                    or not 0 < cap < math.inf:
                raise ValueError(f"DDP: {name} {cap!r}, expected a finite number > 0")
        self._module = module
        self._backend = backend
        self._timeout = timeout
        self._background_asked = background
        self._background = runs_in_background(backend, background)
        self._cap = int(bucket_cap_mb * (1 << 20))
        self._first_cap = self._cap if first_bucket_cap_mb is None \
            else int(first_bucket_cap_mb * (1 << 20))
        self._first_cap_asked = first_bucket_cap_mb
        self._sync = True
        named = module.named_parameters()
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._buckets = self._plan_buckets([i for i in reversed(range(len(named)))
                                            if self._params[i].requires_grad])
        self._check_same_parameters(
            "DDP", [(n, p.data.shape, p.data.dtype.str, p.requires_grad) for n, p in named],
            backend, timeout)
        if broadcast_parameters and backend.world_size > 1:
            every = self._plan_buckets(list(reversed(range(len(named)))))
            for bucket in every:  # one fused broadcast per bucket, into the arrays in place
                params = [self._params[i] for i in bucket]
                layout = FlatLayout([p.data.shape for p in params], params[0].data.dtype, 1)
                flat = broadcast(layout.pack_shards([np.ravel(p.data) for p in params]),
                                 backend, 0, timeout=timeout)
                for p, value in zip(params, layout.gathered_to_full(flat)):
                    if p.data.flags.writeable:
                        np.copyto(p.data, value)
                    else:
                        p.data = value
        self._flats: list[np.ndarray] = []
        self._slots: dict[int, np.ndarray] = {}
        self._bucket_of: dict[int, int] = {}
        if backend.world_size > 1:
            self._make_buckets()
        self._overlap_asked = bool(overlap)
        self._overlap = bool(overlap) and backend.world_size > 1 and bool(self._buckets)
        self._hook_handles: list = []
        self._owners: dict[int, int] = {}
        if self._overlap:
            self._install_hooks()
        self._armed = False
        self._hook: tuple[Any, Callable[[Any, GradBucket], Work]] | None = None
        self._reset()

    def register_comm_hook(self, state: Any, hook: Callable[[Any, GradBucket], Work]) -> None:
        """Average each bucket with ``hook(state, bucket)`` instead of a mean allreduce
        (torch's contract; :mod:`ferro_fsdp.comm_hooks` has the hooks and says what they must
        return). Once, before the first backward; every rank registers the same hook.

        Parameters
        ----------
        state : object
            Passed to every call of ``hook`` (a :class:`~ferro_fsdp.comm_hooks.PowerSGDState`,
            a backend, None).
        hook : callable
            ``hook(state, bucket) -> ferro_collective.Work``; its ``wait()`` gives the bucket's
            averaged gradients (a flat array of the bucket's size).

        Raises
        ------
        RuntimeError
            A hook is registered already.
        TypeError
            ``hook`` is not callable.
        """
        if self._hook is not None:
            raise RuntimeError("DDP.register_comm_hook: a communication hook is registered "
                               "already (once per DDP)")
        if not callable(hook):
            raise TypeError(f"DDP.register_comm_hook: hook is a {type(hook).__name__}, expected "
                            "a callable hook(state, bucket) -> Work")
        self._hook = (state, hook)

    def _plan_buckets(self, order: list[int]) -> list[list[int]]:
        """Parameters (indices, in ``order``) in buckets of one dtype each, at most the cap
        (each dtype's first bucket: the first bucket's cap, as torch's DDP plans them)."""
        buckets: list[list[int]] = []
        open_by_dtype: dict[np.dtype, tuple[list[int], int]] = {}
        opened: dict[np.dtype, int] = {}
        for i in order:
            p = self._params[i]
            nbytes, dtype = p.data.nbytes, p.data.dtype
            bucket, size = open_by_dtype.get(dtype, (None, 0))
            cap = self._first_cap if opened.get(dtype) == 1 else self._cap
            if bucket is None or (size + nbytes > cap and bucket):
                bucket, size = [], 0
                buckets.append(bucket)
                opened[dtype] = opened.get(dtype, 0) + 1
            bucket.append(i)
            open_by_dtype[dtype] = (bucket, size + nbytes)
        return buckets

    def _make_buckets(self) -> None:
        """One persistent flat buffer per bucket; each parameter's gradient slot is a view."""
        for b, bucket in enumerate(self._buckets):
            params = [self._params[i] for i in bucket]
            flat = np.zeros(sum(p.data.size for p in params), params[0].data.dtype)
            offset = 0
            for i, p in zip(bucket, params):
                view = flat[offset:offset + p.data.size].reshape(p.data.shape)
                offset += p.data.size
                if p.grad is not None and np.shape(p.grad) == p.data.shape:
                    view[...] = p.grad
                    p.grad = view
                p.set_grad_slot(view)
                self._slots[i] = view
                self._bucket_of[i] = b
            self._flats.append(flat)

    def _install_hooks(self) -> None:
        index = {id(p): i for i, p in enumerate(self._params)}
        seen: set[int] = set()
        for _, m in self._module.named_modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            mine = [index[id(p)] for _, p in m.named_parameters(recurse=False)
                    if id(p) in index and index[id(p)] in self._bucket_of]
            if not mine:
                continue
            for i in mine:
                self._owners[i] = self._owners.get(i, 0) + 1
            self._hook_handles.append(m.register_backward_pre_hook(
                lambda mod, args, mine=mine: self._before_backward(mine)))
            self._hook_handles.append(m.register_grads_ready_hook(
                lambda mod, mine=mine: self._grads_ready(mod, mine)))
            self._hook_handles.append(m.register_backward_hook(
                lambda mod, args, out, mine=mine: self._backward_done(mod, mine)))

    def _reset(self) -> None:
        self._works: list[Work | None] = [None] * len(self._buckets)
        self._next = 0
        self._missing = [len(b) for b in self._buckets]
        self._fired = dict.fromkeys(self._owners, 0)
        self._early: set[int] = set()  # modules whose gradients were counted before they returned

    # -- accessors --------------------------------------------------------------------------
    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names per bucket, in the order the buckets are reduced."""
        return [[self._names[i] for i in b] for b in self._buckets]

    @property
    def bucket_cap_bytes(self) -> int:
        """The bucket size cap in bytes (``bucket_cap_mb`` times 2**20, rounded down); a parameter
        larger than the cap gets a bucket of its own.
        """
        return self._cap

    @property
    def first_bucket_cap_bytes(self) -> int:
        """The first bucket's cap in bytes (``first_bucket_cap_mb`` times 2**20, rounded down;
        ``bucket_cap_bytes`` unless it was given)."""
        return self._first_cap

    @property
    def overlap(self) -> bool:
        """Whether buckets start their allreduce during the backward."""
        return self._overlap

    def forward(self, x: Any) -> Any:
        """The wrapped module's ``forward`` on ``x``: not collective (DDP communicates only in the
        backward, where each bucket's gradients are averaged over the ranks).

        Parameters
        ----------
        x : object
            The module's input.

        Returns
        -------
        object
            The module's output.
        """
        return self._module.forward(x)

    def rebind(self, backend: Backend) -> None:
        """Continue on ``backend`` (an elastic job's next generation, see
        ``ferro_collective.elastic``): in-flight bucket work of the old one is dropped, the
        gradients are cleared and the buckets rebuilt for the new world; the parameters stay as
        they are (the elastic state copy has made them equal). Not collective.

        Parameters
        ----------
        backend : ferro_backend.Backend
        """
        for handle in self._hook_handles:
            handle.remove()
        for p in self._params:
            p.set_grad_slot(None)
            p.grad = None
        hook = self._hook
        self.__init__(self._module, backend, bucket_cap_mb=self._cap / (1 << 20),
                      first_bucket_cap_mb=self._first_cap_asked,
                      broadcast_parameters=False, timeout=self._timeout,
                      overlap=self._overlap_asked, background=self._background_asked)
        self._hook = hook  # it stays; a state holding the old backend (PowerSGDState) follows
        if hook is not None and getattr(hook[0], "backend", None) is not None:
            hook[0].backend = backend

    def backward(self, grad_output: Any) -> Any:
        """``module.backward(grad_output)``, then ``sync_gradients()`` unless in ``no_sync()``.

        Outside ``no_sync()`` each bucket's allreduce starts inside the backward, as soon as its
        gradients are complete (``overlap=True``).

        Parameters
        ----------
        grad_output : array_like

        Returns
        -------
        object
        """
        self._armed = self._sync and self._overlap
        self._early.clear()
        try:
            out = self._module.backward(grad_output)
        except BaseException:
            self._armed = False
            raise
        self._armed = False
        if self._sync:
            self.sync_gradients()
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside syncs them all."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # -- gradients --------------------------------------------------------------------------
    def _before_backward(self, mine: list[int]) -> None:
        if not self._armed:
            return
        for i in mine:
            if self._works[self._bucket_of[i]] is not None:
                raise RuntimeError(
                    f"DDP.backward: parameter {self._names[i]!r} gets another gradient after its "
                    "bucket's allreduce started (is its module called twice in forward?); use "
                    "DDP(..., overlap=False) for such models")

    def _grads_ready(self, module: Any, mine: list[int]) -> None:
        """``module``'s gradients are final before its backward returns: count them now."""
        if self._armed and id(module) not in self._early:
            self._early.add(id(module))
            self._after_backward(mine)

    def _backward_done(self, module: Any, mine: list[int]) -> None:
        if id(module) in self._early:
            self._early.discard(id(module))  # (counted when it said so)
        else:
            self._after_backward(mine)

    def _after_backward(self, mine: list[int]) -> None:
        if not self._armed:
            return
        for i in mine:
            self._fired[i] += 1
            if self._fired[i] == self._owners[i]:
                self._missing[self._bucket_of[i]] -= 1
        while self._next < len(self._buckets) and self._missing[self._next] == 0:
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        """Start bucket ``b``'s in-place mean allreduce (buckets start in order)."""
        assert b == self._next
        for i in self._buckets[b]:
            p, slot = self._params[i], self._slots[i]
            if p.grad is None:
                slot[...] = 0
            elif p.grad is not slot:
                if np.shape(p.grad) != p.data.shape:
                    raise ValueError(f"DDP.sync_gradients: gradient of shape {np.shape(p.grad)} for "
                                     f"{self._names[i]!r} of shape {p.data.shape}")
                np.copyto(slot, p.grad)
            p.grad = slot
        flat = self._flats[b]
        if self._hook is not None:
            state, hook = self._hook
            self._works[b] = hook(state, GradBucket(
                b, flat, [self._params[i] for i in self._buckets[b]],
                b == len(self._buckets) - 1, self._backend, self._background))
        else:
            self._works[b] = mean_in_place(self._background, flat, self._backend,
                                           timeout=self._timeout)
        self._next = b + 1

    def clip_grad_norm_(self, max_norm: float) -> float:
        """After the gradients are synced: clip them to a global L2 norm of at most
        ``max_norm`` (every rank holds the same averaged gradients, so no communication) and
        return the norm before clipping.

        Parameters
        ----------
        max_norm : float
            The largest global L2 norm (> 0, else ValueError).

        Returns
        -------
        float
        """
        return self._clip(max_norm, "DDP.clip_grad_norm_", None)

    def sync_gradients(self) -> None:
        """Mean-allreduce every gradient, one in-place async allreduce per bucket. Collective.

        Buckets the backward already started are only waited for. A parameter without a
        gradient counts as zeros (and gets the averaged gradient).
        """
        if self._backend.world_size == 1 or not self._buckets:
            return
        try:
            while self._next < len(self._buckets):
                self._launch(self._next)
            for flat, work in zip(self._flats, self._works):
                result = work.wait(self._timeout)
                if self._hook is not None and result is not flat:
                    if np.size(result) != flat.size:
                        raise ValueError(f"DDP: the communication hook returned "
                                         f"{np.size(result)} values for a bucket of {flat.size}")
                    np.copyto(flat, np.reshape(result, flat.shape))
        finally:
            self._reset()

    # -- state dicts ------------------------------------------------------------------------
    def _state_plan(self) -> sharded_state.Plan:
        dtypes = {p.data.dtype for p in self._params}
        if len(dtypes) > 1:
            raise TypeError(f"DDP state dicts need one parameter dtype, got {sorted(map(str, dtypes))}")
        layout = FlatLayout([p.data.shape for p in self._params],
                            dtypes.pop() if dtypes else np.float32, 1)
        return sharded_state.Plan(self._backend, self._names, self._params, layout, False,
                           self._backend.world_size, self._backend.rank, self._timeout)

    def sharded_state_dict(self, optimizer: Any = None
                           ) -> tuple[dict[str, np.ndarray], dict[str, tuple]]:
        """As :meth:`ferro_fsdp.FSDP.sharded_state_dict`: each rank saves its split of the replicas.

        Parameters
        ----------
        optimizer : ferro_fsdp.optim.Optimizer, optional

        Returns
        -------
        tensors, specs : dict of str to numpy.ndarray, dict of str to tuple
        """
        return sharded_state.save(self._state_plan(), optimizer)

    def load_sharded_state_dict(self, tensors: dict[str, Any], optimizer: Any = None) -> None:
        """As :meth:`ferro_fsdp.FSDP.load_sharded_state_dict` (gathers the full tensors). Collective.

        Parameters
        ----------
        tensors : dict of str to array_like
        optimizer : ferro_fsdp.optim.Optimizer, optional
        """
        sharded_state.load(self._state_plan(), tensors, optimizer)


DDP = DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel"]
