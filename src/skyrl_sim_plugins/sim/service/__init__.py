"""Tier 5, the service around the trainer: tenancy (the adapter store), placement (``colocation``) and inference
(``inference/``: vLLM's KV cache, scheduler, step cost and the sampler), built on the tiers below."""
