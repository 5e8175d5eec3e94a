"""Containers of :mod:`ferro_fsdp.nn` (re-exported there): modules made of modules.

A container's ``forward`` calls its children (their hooks fire, so FSDP gathers each one's
parameters as it runs) and its ``backward`` runs theirs in reverse.
"""

from __future__ import annotations

from typing import Any

from .module import Module


class Sequential(Module):
    """Runs its modules in order; registered as attributes ``"0"``, ``"1"``, ...

    Parameters
    ----------
    *modules : Module
        The layers, first to last (TypeError for anything else).
    """

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            self.add_module(str(i), m)

    def _layers(self) -> list[Module]:
        return self.children()

    def __len__(self) -> int:
        return len(self._layers())

    def __iter__(self):
        return iter(self._layers())

    def __getitem__(self, index: int) -> Module:
        return self._layers()[index]

    def forward(self, x: Any) -> Any:
        """Call each module on the previous one's output, first to last (each module's hooks fire).

        Parameters
        ----------
        x : object
            The first module's input.

        Returns
        -------
        object
            The last module's output (``x`` itself when the container is empty).
        """
        for m in self._layers():
            x = m(x)
        return x

    def backward(self, grad_output: Any) -> Any:
        """Run each module's ``backward`` last to first, each on the gradient the next one returned.

        Parameters
        ----------
        grad_output : array_like
            The gradient wrt the last module's output.

        Returns
        -------
        object
            The first module's input gradient (None if that module computes none).

        Raises
        ------
        ValueError
            A module needs an input gradient that the module after it did not compute
            (``input_grad=False`` anywhere but on the first layer).
        """
        g = grad_output
        for m in reversed(self._layers()):
            if g is None:  # a later layer computed no input gradient (input_grad=False)
                raise ValueError(f"Sequential.backward: {type(m).__name__} comes before a layer "
                                 "with input_grad=False: it needs that gradient")
            g = m.backward(g)
        return g


__all__ = ["Sequential"]
