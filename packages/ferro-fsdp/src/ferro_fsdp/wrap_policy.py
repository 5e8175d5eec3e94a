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


__all__ = ["find_units"]
