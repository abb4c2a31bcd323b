"""The axes a user chooses, as registries: each axis names its options and says which one an endpoint picks.

What a simulated run models is chosen along a few axes (the model family, the trainer, the allocator, the vLLM
version, the card): each is an ``Axis``, its options registered by name by the module that defines them, and its
``pick`` reading the endpoint (and model) for the name of the one that applies. A run makes its choices once, when it
binds its models (``bound.binding.Binding``), and every call of the run is answered by what was chosen; nothing
downstream recognises the endpoint again to decide which rule applies. A new option (the classic caching allocator, a
hardware profile, a model family) is registered on its axis and picked by the endpoint's own settings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from skyrl_sim.api import Endpoint, ModelArch, UserError

T = TypeVar("T")

Pick = Callable[[Endpoint, ModelArch | None], str]
"""Which option of an axis an endpoint (and, where the axis reads it, its model) picks, by name."""


class Axis(Generic[T]):
    """One axis: its options by name (``register``, when a module defining one is imported) and which one an
    endpoint picks (``choose``). An axis holds no state a run changes: its options are fixed once the package is
    imported."""

    def __init__(self, name: str, pick: Pick) -> None:
        self.name = name
        self._pick = pick
        self._options: dict[str, T] = {}

    def register(self, key: str, option: T) -> T:
        """Add ``option`` under ``key``; a key registered twice is a programming error."""
        if key in self._options:
            raise ValueError(f"{self.name}: '{key}' is registered already")
        self._options[key] = option
        return option

    def options(self) -> dict[str, T]:
        """Every option by name (a copy)."""
        return dict(self._options)

    def choose(self, endpoint: Endpoint, model: ModelArch | None = None) -> T:
        """The option ``endpoint`` picks; an endpoint that picks one nobody registered is told which ones exist."""
        key = self._pick(endpoint, model)
        found = self._options.get(key)
        if found is None:
            known = ", ".join(sorted(self._options)) or "none"
            raise UserError(f"endpoint '{endpoint.name}': no {self.name} '{key}' (known: {known})")
        return found
