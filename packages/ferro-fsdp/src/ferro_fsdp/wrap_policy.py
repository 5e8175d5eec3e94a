"""The wrap policy: which submodules of an FSDP's module become units of their own.

``FSDP(..., wrap=...)`` takes None (the whole module is one unit), a Module subclass or a tuple
of them (every submodule of those types is a unit), or an int (a size-based policy, as torch's).
:func:`find_units` applies it and finds the nested FSDPs, which keep their own parameters; which
parameters each unit then holds is decided by :class:`~ferro_fsdp.FSDP`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .module import Module


def _matcher(wrap: Any) -> Callable[[Module, int], bool]:
    """``wrap`` as a predicate over (submodule, its parameters not yet in a unit)."""
    if isinstance(wrap, type) and issubclass(wrap, Module):
        return lambda m, n: isinstance(m, wrap)
    if isinstance(wrap, tuple) and wrap and all(isinstance(t, type) and issubclass(t, Module)
                                                for t in wrap):
        return lambda m, n: isinstance(m, wrap)
    if isinstance(wrap, int | np.integer) and not isinstance(wrap, bool) and wrap > 0:
        return lambda m, n: n >= int(wrap)
    raise TypeError(f"FSDP: wrap={wrap!r}; expected None, a Module subclass, a tuple of them, "
                    "or a minimum number of parameters (int > 0)")


def find_units(root: Module, wrap: Any, is_nested: Callable[[Module], bool]
               ) -> tuple[list[tuple[str, Module]], list[tuple[str, Module]]]:
    """``(units, nested)``: the submodules of ``root`` that ``wrap`` makes units (dotted name,
    module; deepest first within a branch, in module order otherwise) and the nested FSDPs
    (``is_nested``) found under it, which own their parameters and are not descended into.

    A size-based ``wrap`` (an int) makes a submodule a unit when the parameters under it that no
    deeper unit claimed add up to at least that many elements (torch's size-based policy).
    """
    match = None if wrap is None else _matcher(wrap)
    units: list[tuple[str, Module]] = []
    nested: list[tuple[str, Module]] = []
    claimed: set[int] = set()
    seen: set[int] = set()

    def free_numel(m: Module) -> int:
        return sum(p.data.size for p in m.parameters() if id(p) not in claimed)

    def visit(prefix: str, m: Module) -> None:
        for name, child in m.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if id(child) in seen:
                continue
            seen.add(id(child))
            if is_nested(child):
                nested.append((full, child))
                claimed.update(id(p) for p in child.parameters())
                continue
            visit(full, child)
            if match is not None and match(child, free_numel(child)) and free_numel(child):
                units.append((full, child))
                claimed.update(id(p) for p in child.parameters())

    visit("", root)
    return units, nested




def owners(root: Module, unit_modules: list[tuple[str, Module]], index: dict[int, int],
           is_nested: Callable[[Module], bool]) -> dict[int, str]:
    """The unit (its name; ``""``: the root unit) that holds each parameter of ``index`` (id of
    a Parameter to its index): the innermost unit whose module holds every place the parameter
    appears in the module tree. A parameter of one module is that module's innermost unit's; one
    shared by modules of several units (tied weights) belongs to a unit enclosing all of them
    (the root unit when no other does), so it is gathered whenever any of its users runs and
    its gradient sums every use. ``is_nested(m)``: ``m`` is an FSDP (a nested one keeps its
    own parameters; the root given as one stands for its module's tree)."""
    unit_of = {id(m): name for name, m in unit_modules}
    chains: dict[int, list[tuple[str, ...]]] = {}

    def walk(m: Module, chain: tuple[str, ...], path: set[int]) -> None:
        if id(m) in path or (is_nested(m) and m is not root):
            return  # (a module inside itself: walked once; a nested FSDP keeps its own)
        if id(m) in unit_of and m is not root:
            chain = (*chain, unit_of[id(m)])
        for _, p in m.named_parameters(recurse=False):
            if id(p) in index:
                chains.setdefault(index[id(p)], []).append(chain)
        for _, child in m.named_children():
            walk(child, chain, path | {id(m)})

    while is_nested(root):  # (an FSDP given to an FSDP: its module's tree)
        root = root._module
    walk(root, ("",), set())
    owner = {}
    for i, found in chains.items():
        common = set(found[0]).intersection(*found[1:])
        owner[i] = next(name for name in reversed(found[0]) if name in common)
    return owner


__all__ = ["find_units", "owners"]
