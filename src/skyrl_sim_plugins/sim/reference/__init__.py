"""Tier 2, the reference models: time (``time_model``) and memory (``memory_ops``, ``memory_graph``, ``allocator``,
``device_memory``, ``static_memory``, ``segments``, ``memory_walk``), op by op and step by step, with no cache: the
meaning every fast path is held to."""
