"""``Module``: the smallest model layer that FSDP, DDP and the optimizers need.

A :class:`Module` registers every attribute that is a :class:`~ferro_fsdp.parameter.Parameter`
or a :class:`Module`, in the order the attributes were first assigned (re-assigning keeps the
position; assigning anything else, or ``del``, unregisters). ``named_parameters`` walks that order
depth-first with dotted names (``"0.weight"``) and lists a shared Parameter once. Models are plain
numpy: ``forward`` computes, the optional ``backward(grad_output)`` sets ``.grad`` on the module's
parameters (adding to a gradient already there, as torch accumulates) and returns the gradient
wrt the input.

Hooks: ``register_forward_pre_hook``, ``register_forward_hook``, ``register_backward_pre_hook``
and ``register_backward_hook`` (and ``register_grads_ready_hook``, inside a backward that calls
``grads_ready()``) run around a module's ``forward``/``backward`` however it is
called (``m(x)``, ``m.forward(x)``, a container's ``child.backward(g)``): every subclass's
``forward`` and ``backward`` are wrapped once, when the class is defined, and the hooks fire at
the outermost call only (a ``super().backward`` inside does not fire them twice). DDP uses them
to start a bucket's allreduce as soon as its last gradient is written, FSDP to gather a unit
just before it runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .parameter import Parameter


class RemovableHandle:
    """What ``register_*_hook`` returns: ``remove()`` unregisters the hook (twice is fine)."""

    def __init__(self, hooks: list, hook: Callable) -> None:
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        """Unregister the hook: it no longer runs on later calls. Idempotent (removing twice,
        or after the module dropped its hooks, does nothing)."""
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


_HOOK_KINDS = ("forward_pre", "forward", "backward_pre", "backward", "grads_ready")


def _hooked(method: Callable, pre: str, post: str) -> Callable:
    """``method`` (a subclass's forward or backward) running ``pre``/``post`` hooks around the
    outermost call on an instance."""

    @functools.wraps(method)
    def run(self, *args: Any, **kwargs: Any) -> Any:
        hooks = self.__dict__.get("_ferro_hooks")
        if not hooks or self.__dict__.get("_in_" + pre):
            return method(self, *args, **kwargs)
        for hook in list(hooks[pre]):
            hook(self, args)
        self.__dict__["_in_" + pre] = True
        try:
            result = method(self, *args, **kwargs)
        finally:
            self.__dict__["_in_" + pre] = False
        for hook in list(hooks[post]):
            hook(self, args, result)
        return result

    run.__ferro_hooked__ = True
    return run


class Module:
    """Base class of models: attributes that are Parameters or Modules register themselves, in order.

    Subclasses implement ``forward(x)`` and, to be trained with ferro, ``backward(grad_output)``.
    Calling ``super().__init__()`` is recommended but not required. Takes no parameters.
    """

    training: bool

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, pre, post in (("forward", "forward_pre", "forward"),
                                ("backward", "backward_pre", "backward")):
            method = cls.__dict__.get(name)
            if callable(method) and not getattr(method, "__ferro_hooked__", False):
                setattr(cls, name, _hooked(method, pre, post))

    def __init__(self) -> None:
        object.__setattr__(self, "_registry", {})
        object.__setattr__(self, "training", True)

    # -- registration ---------------------------------------------------------------------
    def _reg(self) -> dict[str, None]:
        reg = self.__dict__.get("_registry")
        if reg is None:
            reg = {}
            object.__setattr__(self, "_registry", reg)
        return reg

    def __setattr__(self, name: str, value: Any) -> None:
        reg = self._reg()
        if isinstance(value, (Parameter, Module)):
            reg.setdefault(name, None)
        else:
            reg.pop(name, None)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self._reg().pop(name, None)
        object.__delattr__(self, name)

    def register_parameter(self, name: str, param: Parameter) -> None:
        """``setattr(self, name, param)``, for names that are not identifiers.

        Parameters
        ----------
        name : str
        param : Parameter

        Raises
        ------
        TypeError
            ``param`` is not a Parameter.
        """
        if not isinstance(param, Parameter):
            raise TypeError(f"register_parameter: {name!r} is a {type(param).__name__}, not a Parameter")
        setattr(self, name, param)

    def add_module(self, name: str, module: Module) -> None:
        """``setattr(self, name, module)``, for names like ``"0"``.

        Parameters
        ----------
        name : str
        module : Module

        Raises
        ------
        TypeError
            ``module`` is not a Module.
        """
        if not isinstance(module, Module):
            raise TypeError(f"add_module: {name!r} is a {type(module).__name__}, not a Module")
        setattr(self, name, module)

    # -- hooks ----------------------------------------------------------------------------
    def _add_hook(self, kind: str, hook: Callable) -> RemovableHandle:
        if not callable(hook):
            raise TypeError(f"register_{kind}_hook: {hook!r} is not callable")
        hooks = self.__dict__.get("_ferro_hooks")
        if hooks is None:
            hooks = {k: [] for k in _HOOK_KINDS}
            object.__setattr__(self, "_ferro_hooks", hooks)
        hooks[kind].append(hook)
        return RemovableHandle(hooks[kind], hook)

    def register_forward_pre_hook(self, hook: Callable) -> RemovableHandle:
        """``hook(module, args)`` before every ``forward``.

        Parameters
        ----------
        hook : callable

        Returns
        -------
        RemovableHandle

        Raises
        ------
        TypeError
            ``hook`` is not callable (as for every ``register_*_hook``).
        """
        return self._add_hook("forward_pre", hook)

    def register_forward_hook(self, hook: Callable) -> RemovableHandle:
        """``hook(module, args, output)`` after every ``forward`` that returned (not after one
        that raised).

        Parameters
        ----------
        hook : callable

        Returns
        -------
        RemovableHandle
        """
        return self._add_hook("forward", hook)

    def register_backward_pre_hook(self, hook: Callable) -> RemovableHandle:
        """``hook(module, (grad_output,))`` before every ``backward``.

        Parameters
        ----------
        hook : callable

        Returns
        -------
        RemovableHandle
        """
        return self._add_hook("backward_pre", hook)

    def register_backward_hook(self, hook: Callable) -> RemovableHandle:
        """``hook(module, (grad_output,), grad_input)`` after every ``backward``: this module's
        parameters then hold this backward's gradients.

        Parameters
        ----------
        hook : callable

        Returns
        -------
        RemovableHandle
        """
        return self._add_hook("backward", hook)

    def register_grads_ready_hook(self, hook: Callable) -> RemovableHandle:
        """``hook(module)`` when this module's ``backward`` says its parameters' gradients are
        final (:meth:`grads_ready`), before it computes the gradient wrt its input; a module
        that never says so fires only its backward hooks. (DDP starts a bucket's allreduce
        there: :class:`~ferro_fsdp.layers.Linear`'s input gradient is as costly as its weight's.)

        Parameters
        ----------
        hook : callable

        Returns
        -------
        RemovableHandle
        """
        return self._add_hook("grads_ready", hook)

    def grads_ready(self) -> None:
        """Called by a ``backward`` once it has written this module's parameters' gradients
        (and before it computes its input's): runs the grads-ready hooks.
        """
        hooks = self.__dict__.get("_ferro_hooks")
        if hooks:
            for hook in list(hooks["grads_ready"]):
                hook(self)

    def _items(self) -> Iterator[tuple[str, Parameter | Module]]:
        for name in list(self._reg()):
            yield name, self.__dict__[name]

    # -- traversal ------------------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True) -> list[tuple[str, Parameter]]:
        """``(dotted name, Parameter)`` in registration order, depth first; shared ones once.

        Parameters
        ----------
        prefix : str, default ""
            Prepended to every name.
        recurse : bool, default True
            Include the submodules' parameters (False: this module's own only).

        Returns
        -------
        list of (str, Parameter)
        """
        out: list[tuple[str, Parameter]] = []
        seen: set[int] = set()
        self._collect(prefix, recurse, out, seen)
        return out

    def _collect(self, prefix: str, recurse: bool, out: list, seen: set[int]) -> None:
        for name, value in self._items():
            full = f"{prefix}{name}"
            if isinstance(value, Parameter):
                if id(value) not in seen:
                    seen.add(id(value))
                    out.append((full, value))
            elif recurse:
                value._collect(full + ".", True, out, seen)

    def parameters(self, recurse: bool = True) -> list[Parameter]:
        """The Parameters of :meth:`named_parameters`, without their names.

        Parameters
        ----------
        recurse : bool, default True
            Include the submodules' parameters (depth first); False: only this module's own.

        Returns
        -------
        list of Parameter
            In registration order, a Parameter shared by several modules once; the objects
            themselves (not copies): what an optimizer is given.
        """
        return [p for _, p in self.named_parameters(recurse=recurse)]

    def named_children(self) -> list[tuple[str, Module]]:
        """The direct submodules with their attribute names, in registration order.

        Returns
        -------
        list of (str, Module)
            One level only (not the submodules' own children: see :meth:`named_modules`).
        """
        return [(n, v) for n, v in self._items() if isinstance(v, Module)]

    def children(self) -> list[Module]:
        """The direct submodules, in registration order (:meth:`named_children` without names).

        Returns
        -------
        list of Module
        """
        return [m for _, m in self.named_children()]

    def named_modules(self, prefix: str = "") -> list[tuple[str, Module]]:
        """This module (name ``prefix``) and every submodule, depth first.

        Parameters
        ----------
        prefix : str, default ""

        Returns
        -------
        list of (str, Module)
        """
        out = [(prefix, self)]
        for name, child in self.named_children():
            out.extend(child.named_modules(f"{prefix}.{name}" if prefix else name))
        return out

    def modules(self) -> list[Module]:
        """This module and every submodule, depth first (:meth:`named_modules` without names).

        Returns
        -------
        list of Module
            ``self`` first.
        """
        return [m for _, m in self.named_modules()]

    # -- computing ------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Compute the module's output; what subclasses implement (``m(x)`` calls it).

        The forward hooks run around the outermost call (see the module's docstring). Layers
        that have a :meth:`backward` keep what it needs from the last ``forward`` on the
        instance, so call ``backward`` before the next ``forward``.

        Parameters
        ----------
        *args, **kwargs
            The inputs, as the subclass defines them (usually one array).

        Returns
        -------
        object
            The output (usually a numpy array).

        Raises
        ------
        NotImplementedError
            The base class computes nothing.
        """
        raise NotImplementedError(f"{type(self).__name__}.forward is not implemented")

    def backward(self, grad_output: Any) -> Any:
        """Optional: set ``.grad`` on this module's parameters and return the gradient wrt its input.

        Parameters
        ----------
        grad_output : array_like
            The gradient wrt the output of the last ``forward``.

        Returns
        -------
        numpy.ndarray or None
        """
        raise NotImplementedError(f"{type(self).__name__}.backward is not implemented")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    # -- modes, gradients, state ----------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        """Set ``training`` on this module and every submodule (only layers such as
        :class:`~ferro_fsdp.nn.Dropout` behave differently).

        Parameters
        ----------
        mode : bool, default True
            True: training mode; False: evaluation mode (same as :meth:`eval`).

        Returns
        -------
        Module
            ``self``, for chaining.
        """
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self) -> Module:
        """Evaluation mode: ``train(False)`` on this module and every submodule.

        Returns
        -------
        Module
            ``self``, for chaining.
        """
        return self.train(False)

    def zero_grad(self) -> None:
        """Set every parameter's ``.grad`` to None."""
        for p in self.parameters():
            p.grad = None

    def state_dict(self) -> dict[str, np.ndarray]:
        """``{dotted name: copy of .data}`` in ``named_parameters`` order.

        Returns
        -------
        dict of str to numpy.ndarray
        """
        return {name: np.array(p.data, copy=True) for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy ``state``'s arrays into the parameters (same names and shapes, every name once).

        Parameters
        ----------
        state : dict of str to array_like
            As :meth:`state_dict` returns; values are cast to each parameter's dtype.

        Raises
        ------
        KeyError, ValueError
            Missing or unexpected names; an array of another shape.
        """
        named = dict(self.named_parameters())
        missing = [n for n in named if n not in state]
        unexpected = [n for n in state if n not in named]
        if missing or unexpected:
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for name, p in named.items():
            value = np.asarray(state[name])
            if value.shape != p.data.shape:
                raise ValueError(f"load_state_dict: {name!r} has shape {value.shape}, "
                                 f"expected {p.data.shape}")
            p.data = np.array(value, dtype=p.data.dtype, copy=True)

    def num_parameters(self) -> int:
        """The number of elements of every parameter (each shared Parameter counted once).

        Returns
        -------
        int
            Of the local ``.data``: under FSDP, the elements this rank holds.
        """
        return sum(p.data.size for p in self.parameters())

    def extra_repr(self) -> str:
        """What ``repr(module)`` shows in the parentheses after the class name; subclasses
        override it (``Linear``: its sizes), the base shows nothing.

        Returns
        -------
        str
        """
        return ""

    def __repr__(self) -> str:
        kids = self.named_children()
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not kids:
            return head + ")"
        body = "".join(f"\n  ({n}): " + repr(m).replace("\n", "\n  ") for n, m in kids)
        return head + body + "\n)"


__all__ = ["Module", "RemovableHandle"]
