"""The bound tier's state: one bounded cache (``BoundedCache``) and the binding of models to endpoints
(``EndpointBinding``).

Only the bound models (``bound/``, and the service models above them) keep anything between calls, and every cache
they keep is a ``BoundedCache``: one eviction policy for all of them. A cache that is full starts over (it is emptied,
with whatever was derived from its entries: ``on_clear``) before it takes a new entry. A lookup is a plain ``dict``
lookup: the hot paths read their caches millions of times a run, and a least-recently-used order would cost every
hit a move. The cost of the policy is a refill of what is still in use after a cache starts over, which a cache
sized to hold a run's working set rarely pays.

A run binds its endpoint once (the cost contracts' ``bind``, ``plugin_host.costs``) and asks the bound model about
every call. ``EndpointBinding`` keeps the bound models of the endpoints asked about without one (a test, a script, a
calibration over many endpoints): the pair asked about last is recognised by identity, any other by its settings.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from skyrl_sim.api import Endpoint, ModelArch

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
B = TypeVar("B")


class BoundedCache(dict[K, V]):
    """A dict of at most ``limit`` entries that starts over when an insertion finds it full.

    Read it as a dict (``get``, ``in``, ``[]``); write new entries with ``put``, ``put_many`` or ``get_or_make`` (a
    plain ``cache[key] = value`` skips the bound). ``on_clear`` runs whenever the cache is emptied (a structure
    derived from the entries, such as the tiles their values point into, goes with them)."""

    __slots__ = ("limit", "on_clear")

    def __init__(self, limit: int, on_clear: Callable[[], None] | None = None) -> None:
        super().__init__()
        if limit < 1:
            raise ValueError(f"a bounded cache holds at least one entry, not {limit}")
        self.limit = limit
        self.on_clear = on_clear

    def clear(self) -> None:
        super().clear()
        if self.on_clear is not None:
            self.on_clear()

    def make_room(self, count: int = 1) -> None:
        """Start over unless ``count`` more entries fit."""
        if len(self) + count > self.limit:
            self.clear()

    def put(self, key: K, value: V) -> V:
        """Store ``value`` under ``key`` (starting over first when a new key finds the cache full); returns it."""
        if key not in self:
            self.make_room()
        self[key] = value
        return value

    def put_many(self, items: list[tuple[K, V]]) -> None:
        """Store entries that belong together (a tile's lanes): room is made for all of them at once, so none is
        lost to a start-over among them."""
        self.make_room(len(items))
        self.update(items)

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The entry under ``key``, made by ``make`` and stored when there is none."""
        found = self.get(key, _MISSING)
        if found is _MISSING:
            return self.put(key, make())
        return found  # type: ignore[return-value]


_MISSING: Any = object()


class EndpointBinding(Generic[B]):
    """Models bound to endpoints (``make(endpoint, model)``), one per endpoint's settings and model.

    A run asks about one endpoint thousands of times: the endpoint and model asked about last are recognised by
    identity, any other is looked up by its settings (endpoints are mutable pydantic models; change one by copying
    it, ``model_copy``, not in place between two calls)."""

    def __init__(self, make: Callable[[Endpoint, ModelArch], B], limit: int = 16) -> None:
        self._make = make
        self._bound: BoundedCache[tuple[str, Any], B] = BoundedCache(limit)
        self._last: tuple[Endpoint, ModelArch, str, B] | None = None

    def bind(self, endpoint: Endpoint, model: ModelArch) -> B:
        """The model bound to ``endpoint`` and ``model``, made on first use."""
        last = self._last
        if last is not None and last[0] is endpoint and last[1] is model:
            return last[3]
        settings = endpoint.model_dump_json()
        bound = self._bound.get_or_make((settings, model.cache_key), lambda: self._make(endpoint, model))
        self._last = (endpoint, model, settings, bound)
        return bound

    def settings(self, endpoint: Endpoint, model: ModelArch) -> str:
        """The endpoint's settings as a cache key (a dump is cheap, but not free: the last endpoint's is reused)."""
        last = self._last
        if last is not None and last[0] is endpoint and last[1] is model:
            return last[2]
        return endpoint.model_dump_json()
