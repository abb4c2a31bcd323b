"""Tier 4, the bound models: the time and memory models bound to an endpoint (``timing``, ``memory``,
``memory_effects``), the only tier that keeps anything between calls, every cache a ``cache.BoundedCache``."""
