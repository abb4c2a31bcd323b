"""The inference model: vLLM's KV cache sizing, block pool, continuous-batching scheduler, step cost and the sampler
that runs a run's sample calls on them (part of the service tier)."""
