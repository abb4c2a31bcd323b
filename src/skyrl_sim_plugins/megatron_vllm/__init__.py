"""The real backend: SkyRL's engine loop in wall-clock time over megatron-core LoRA workers and a vLLM sampler."""
