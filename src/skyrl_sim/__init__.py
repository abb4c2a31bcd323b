"""skyrl-sim: a capacity simulator with a real-hardware twin for Tinker-API RL-training services.

The host package holds the interface (``hookspecs``), the plugin manager (``host``), the scenario schema, SkyRL's engine
rules as pure functions, the shape rules, the result schema and the CLI. Backends (the simpy simulator, the real
megatron-core + vLLM backend) are plugins.
"""

__version__ = "0.1.0"
