"""SGD (momentum, dampening, Nesterov, weight decay), Adam and AdamW, with torch's update rules.

An optimizer steps whatever Parameters it is given, in place (``p.data`` is updated, never
replaced, so views stay views). Given a rank's FSDP shards, its state is sharded too (ZeRO);
FSDP's ``sharded_state_dict(optimizer)`` saves that state with the parameters. Parameters whose
``.grad`` is None are skipped, as in torch.

``optimizer.state`` maps each Parameter to its state dict (``"momentum_buffer"`` for SGD;
``"step"``, ``"exp_avg"``, ``"exp_avg_sq"`` for Adam and AdamW). ``state_dict()`` / ``load_state_dict()``
use parameter indices instead, like torch.

The step: when a parameter, its gradient and its state arrays are C-contiguous and of one dtype
(float32 or float64), the compiled kernel ``_optim_step`` updates it in one pass without the
GIL, with the same bits as the numpy step (the same operations in the same order, each rounded
to the parameter's dtype); otherwise, or with ``fused=False``, the numpy step runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np

from . import _optim_step
from .parameter import Parameter

_FUSED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _flat_views(*arrays: np.ndarray) -> list[np.ndarray] | None:
    """1-d views of ``arrays`` for the compiled step, or None when it cannot take them (not all
    C-contiguous, or not all of one float32/float64 dtype)."""
    dtype = arrays[0].dtype
    if dtype not in _FUSED_DTYPES:
        return None
    if any(a.dtype != dtype or not a.flags.c_contiguous for a in arrays):
        return None
    return [a.reshape(-1) for a in arrays]


class Optimizer:
    """Parameter groups, per-parameter state, ``zero_grad``, ``state_dict``.

    Parameters
    ----------
    params : iterable of Parameter, or iterable of dict
        The Parameters to step, or parameter groups: dicts with a ``"params"`` list and
        per-group options overriding ``defaults``.
    defaults : dict
        The options of every group (``lr``...), set by the subclass.

    Raises
    ------
    ValueError
        An empty parameter list, or a Parameter listed twice.
    TypeError
        Something that is not a Parameter.
    """

    #: state entries that are arrays shaped like the parameter
    array_state_keys: ClassVar[tuple[str, ...]] = ()
    #: state entries that are Python numbers
    scalar_state_keys: ClassVar[tuple[str, ...]] = ()
    #: the entries a parameter's state holds all of once it has any (SGD's buffer may be absent)
    required_state_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, params: Iterable[Parameter] | Iterable[dict], defaults: dict[str, Any]) -> None:
        self.defaults = dict(defaults)
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Parameter, dict[str, Any]] = {}
        params = list(params)
        if not params:
            raise ValueError(f"{type(self).__name__}: got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        seen: set[int] = set()
        for g in groups:
            group = {**self.defaults, **g, "params": list(g["params"])}
            for p in group["params"]:
                if not isinstance(p, Parameter):
                    raise TypeError(f"{type(self).__name__}: {type(p).__name__} is not a Parameter")
                if id(p) in seen:
                    raise ValueError(f"{type(self).__name__}: a Parameter appears twice")
                seen.add(id(p))
            self.param_groups.append(group)

    @property
    def params(self) -> list[Parameter]:
        """Every parameter this optimizer steps, group by group in the order given (the objects
        themselves).
        """
        return [p for g in self.param_groups for p in g["params"]]

    @property
    def lr(self) -> float:
        """The first group's learning rate; setting it sets every group's (a scheduler's hook)."""
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for g in self.param_groups:
            g["lr"] = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's gradient before the next backward.

        Parameters
        ----------
        set_to_none : bool, default True
            True: ``p.grad = None`` (the next backward writes a fresh gradient, and ``step`` skips a
            parameter that got none). False: zero-filled arrays of the parameter's shape and dtype
            where a gradient existed (a parameter without one keeps None).
        """
        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad = np.zeros_like(p.data)

    @staticmethod
    def _grad(p: Parameter, who: str) -> np.ndarray:
        g = p.grad
        if g.shape != p.data.shape:
            raise ValueError(f"{who}.step: gradient of shape {g.shape} for a parameter of shape "
                             f"{p.data.shape}")
        if not p.data.flags.writeable:
            raise ValueError(f"{who}.step: parameter of shape {p.data.shape} is read-only")
        return g

    def step(self) -> None:
        """Update every parameter that has a gradient, in place, by the subclass's rule.

        ``p.data`` is written into, never replaced (views stay views); a parameter whose ``.grad``
        is None or whose ``requires_grad`` is False is skipped, as in torch. On each rank the
        update is deterministic (the compiled and numpy steps give the same bits), so ranks that
        hold the same parameters and gradients stay bit-identical.

        Raises
        ------
        ValueError
            A gradient whose shape is not its parameter's, a read-only parameter array, or a
            state array (:attr:`array_state_keys`) not of its parameter's shape: state made
            for the parameter's other data, e.g. a full-size one from a step before FSDP
            sharded the parameter (checked before anything of that parameter is written; the
            compiled step would read and write past a smaller array's end, or use a larger
            one's first elements).
        """
        name = type(self).__name__
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or not p.requires_grad:
                    continue
                grad = self._grad(p, name)
                state = self.state.setdefault(p, {})
                self._check_arrays(state, p, "step", None)
                self._update(p, grad, group, state)

    def _check_arrays(self, state: dict[str, Any], p: Parameter, op: str,
                      who: str | None) -> None:
        """Refuse an array entry of ``state`` (of :attr:`array_state_keys`) not of ``p``'s shape
        (the compiled step would read and write past a smaller one's end, or use a larger one's
        first elements), in the words of ``op`` (``who``: the parameter; None: its index)."""
        for k in self.array_state_keys:
            v = state.get(k)
            if v is not None and np.shape(v) != p.data.shape:
                hint = (" (state made before the parameter was resharded, e.g. a step before "
                        "FSDP wrapped the model? Create the optimizer's state after wrapping, "
                        "or restore it with load_sharded_state_dict)") if op == "step" else ""
                raise ValueError(f"{type(self).__name__}.{op}: {who or self._who(p)}'s {k!r} "
                                 f"has shape {np.shape(v)}, its parameter {p.data.shape}{hint}")

    def _who(self, p: Parameter) -> str:
        """``p`` in an error's words: its index in :attr:`params`."""
        return f"parameter {next(i for i, q in enumerate(self.params) if q is p)}"

    def _update(self, p: Parameter, grad: np.ndarray, group: dict, state: dict) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: {...}}, "param_groups": [...]}`` with parameters as indices (copies).

        Returns
        -------
        dict
            What ``load_state_dict`` takes.
        """
        index = {id(p): i for i, p in enumerate(self.params)}
        state = {index[id(p)]: {k: (np.array(v, copy=True) if isinstance(v, np.ndarray) else v)
                                for k, v in s.items()}
                 for p, s in self.state.items() if id(p) in index}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned: the groups' hyperparameters and the per-parameter
        state, matched to this optimizer's parameters by index.

        Parameters
        ----------
        state_dict : dict
            ``{"state": {index: {...}}, "param_groups": [...]}``; array entries are copied and cast
            to their parameter's dtype, and the current state is replaced (not merged).

        Raises
        ------
        ValueError
            A different number of groups, or of parameters in a group; a parameter's state
            without one of :attr:`required_state_keys`, or an array entry not of its
            parameter's shape (nothing is changed then).
        IndexError, KeyError
            A malformed ``state_dict`` (an index past the parameters, a missing key).
        """
        params = self.params
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, self.param_groups)):
            raise ValueError(f"{type(self).__name__}.load_state_dict: parameter groups do not match")
        state = {}
        for i, s in state_dict["state"].items():
            p = params[int(i)]
            state[p] = {k: (np.array(v, dtype=p.data.dtype, copy=True) if isinstance(v, np.ndarray)
                            else v) for k, v in s.items()}
            self.check_state(state[p], p, f"parameter {int(i)}")
        for g, mine in zip(groups, self.param_groups):
            mine.update({k: v for k, v in g.items() if k != "params"})
        self.state = state

    def check_state(self, state: dict[str, Any], p: Parameter, who: str) -> None:
        """Refuse a parameter's state that the step cannot take: an array entry (of
        :attr:`array_state_keys`) not of the parameter's shape (the compiled step would read
        and write past its end), or, once it holds anything, a missing one of
        :attr:`required_state_keys`.

        Parameters
        ----------
        state : dict
            The parameter's state entries.
        p : Parameter
        who : str
            The parameter, in the error's words.

        Raises
        ------
        ValueError
            Naming the optimizer, ``who``, the entry and the shapes.
        """
        name = type(self).__name__
        self._check_arrays(state, p, "load_state_dict", who)
        missing = [k for k in self.required_state_keys if k not in state]
        if state and missing:
            raise ValueError(f"{name}.load_state_dict: {who}'s state lacks {missing} (it has "
                             f"{sorted(state)})")


class SGD(Optimizer):
    """torch.optim.SGD: ``g = grad + wd*p``; ``buf = momentum*buf + (1-dampening)*g`` (``buf = g``
    on the first step); ``g = g + momentum*buf`` if nesterov else ``buf``; ``p -= lr*g``.

    Parameters
    ----------
    params : iterable of Parameter, or iterable of dict
        As for :class:`Optimizer`.
    lr : float
        Learning rate (>= 0).
    momentum, weight_decay : float, default 0.0
        Momentum factor and L2 penalty (>= 0).
    dampening : float, default 0.0
        Dampening of the momentum.
    nesterov : bool, default False
        Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
    fused : bool, default True
        Use the compiled step where it applies (the same bits as the numpy step).

    Raises
    ------
    ValueError, TypeError
        A negative ``lr``, ``momentum`` or ``weight_decay``, an invalid ``nesterov``; else as
        :class:`Optimizer`.
    """

    array_state_keys = ("momentum_buffer",)

    def __init__(self, params: Iterable[Parameter] | Iterable[dict], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, *, dampening: float = 0.0, nesterov: bool = False,
                 fused: bool = True) -> None:
        if not (lr >= 0 and momentum >= 0 and weight_decay >= 0):  # (NaN too)
            raise ValueError(f"SGD: lr {lr}, momentum {momentum} and weight_decay {weight_decay} "
                             "must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: nesterov needs momentum > 0 and dampening 0")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "dampening": dampening, "nesterov": nesterov})
        self._scratch: dict[int, np.ndarray] = {}
        self.fused = bool(fused)

    def _update(self, p: Parameter, grad: np.ndarray, group: dict, state: dict) -> None:
        wd, momentum = group["weight_decay"], group["momentum"]
        buf = state.get("momentum_buffer")
        if self.fused and (buf is not None or not momentum):   # the first step is numpy's
            flat = _flat_views(p.data, grad, buf if momentum else p.data)
            if flat is not None:
                _optim_step.sgd_step(*flat, float(group["lr"]), float(wd), float(momentum),
                                     float(group["dampening"]), bool(group["nesterov"]))
                return
        d = grad + wd * p.data if wd else grad
        if momentum:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = np.array(d, dtype=p.data.dtype, copy=True)
                state["momentum_buffer"] = buf
            else:
                buf *= momentum
                if group["dampening"]:
                    buf += (1.0 - group["dampening"]) * d
                else:
                    buf += d  # (1 - 0) * d is d: the same bits without a temporary
            d = d + momentum * buf if group["nesterov"] else buf
        # p -= lr * d through a persistent scratch array: no parameter-sized allocation
        scratch = self._scratch.get(id(p))
        if scratch is None or scratch.shape != d.shape or scratch.dtype != p.data.dtype:
            scratch = self._scratch[id(p)] = np.empty(d.shape, p.data.dtype)
        np.multiply(d, group["lr"], out=scratch)
        p.data -= scratch


class Adam(Optimizer):
    """torch.optim.Adam (L2 weight decay added to the gradient, bias-corrected moments).

    Parameters
    ----------
    params : iterable of Parameter, or iterable of dict
        As for :class:`Optimizer`.
    lr : float, default 1e-3
        Learning rate (>= 0).
    betas : (float, float), default (0.9, 0.999)
        Decay rates of the first and second moments, each in ``[0, 1)``.
    eps : float, default 1e-8
        Added to the denominator (>= 0).
    weight_decay : float, default 0.0
        L2 penalty (>= 0).
    fused : bool, default True
        Use the compiled step where it applies (the same bits as the numpy step).

    Raises
    ------
    ValueError, TypeError
        An out-of-range ``lr``, ``betas``, ``eps`` or ``weight_decay``; else as :class:`Optimizer`.
    """

    array_state_keys = ("exp_avg", "exp_avg_sq")
    scalar_state_keys = ("step",)
    required_state_keys = ("step", "exp_avg", "exp_avg_sq")
    _decoupled: ClassVar[bool] = False

    def __init__(self, params: Iterable[Parameter] | Iterable[dict], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, fused: bool = True) -> None:
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and 0 <= betas[0] < 1
                and 0 <= betas[1] < 1):  # (NaN fails every comparison)
            raise ValueError(f"{type(self).__name__}: invalid lr {lr}, betas {betas}, eps {eps} "
                             f"or weight_decay {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay})
        self.fused = bool(fused)

    def _update(self, p: Parameter, grad: np.ndarray, group: dict, state: dict) -> None:
        beta1, beta2 = group["betas"]
        if "step" not in state:
            state["step"] = 0
            state["exp_avg"] = np.zeros_like(p.data)
            state["exp_avg_sq"] = np.zeros_like(p.data)
        state["step"] += 1
        step = state["step"]
        bias1 = 1.0 - beta1 ** step
        bias2_sqrt = math.sqrt(1.0 - beta2 ** step)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        flat = _flat_views(p.data, grad, m, v) if self.fused else None
        if flat is not None:
            lr = float(group["lr"])
            _optim_step.adam_step(*flat, float(beta1), float(beta2), bias2_sqrt,
                                  float(group["eps"]), lr / bias1, float(group["weight_decay"]),
                                  lr, self._decoupled)
            return
        if self._decoupled:
            d = grad
            if group["weight_decay"]:
                p.data *= 1.0 - group["lr"] * group["weight_decay"]
        else:
            d = grad + group["weight_decay"] * p.data if group["weight_decay"] else grad
        m *= beta1
        m += (1.0 - beta1) * d
        v *= beta2
        if np.iscomplexobj(v):  # as torch: a complex value's two parts as two real values
            v += (1.0 - beta2) * (d.real * d.real + 1j * (d.imag * d.imag))
            re, im = (np.sqrt(part) / bias2_sqrt + group["eps"] for part in (v.real, v.imag))
            p.data -= (group["lr"] / bias1) * (m.real / re + 1j * (m.imag / im))
            return
        v += (1.0 - beta2) * (d * d)
        denom = np.sqrt(v) / bias2_sqrt + group["eps"]
        p.data -= (group["lr"] / bias1) * (m / denom)


class AdamW(Adam):
    """torch.optim.AdamW: decoupled weight decay, ``p *= 1 - lr * weight_decay`` before the Adam
    step on the raw gradient (no L2 term in the moments); default ``weight_decay=1e-2``.

    Parameters
    ----------
    params, lr, betas, eps, fused
        As for :class:`Adam`.
    weight_decay : float, default 1e-2
        Decoupled weight decay (>= 0).

    Raises
    ------
    ValueError, TypeError
        As for :class:`Adam`.

    Examples
    --------
    >>> fsdp = FSDP(model, backend)
    >>> opt = AdamW(fsdp.parameters(), lr=3e-4)  # this rank's shards: ZeRO state
    >>> fsdp.backward(loss_fn.backward()); fsdp.sync_gradients()
    >>> opt.step(); opt.zero_grad()
    """

    _decoupled = True

    def __init__(self, params: Iterable[Parameter] | Iterable[dict], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, fused: bool = True) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, fused=fused)


__all__ = ["SGD", "Adam", "AdamW", "Optimizer"]
