"""Static memory of a training rank: what it holds before its first micro-batch and keeps between calls.

The trainer's own (``description.trainers``, one entry per trainer SkyRL runs): Megatron's TP/PP-sharded weights (and
the vision tower on the vision-language path), with LoRA the adapters' parameters, fp32 gradients and Adam state
(sharded over data parallelism by the distributed optimizer; off the device with ``optimizer_offload``), with full
fine-tuning the gradient buffer and the distributed optimizer's shard instead; FSDP's fp32 shards. Under expert
parallelism a rank holds only its own experts. State a trainer makes on the way (FSDP's gradients, Adam's moments of a
full fine-tune) is carried by the walk from call to call, not held from the start (``trainers.lazy_state``).

Read by the walk (every rank's allocator starts from it: ``memory_walk.EndpointFacts``), by tenancy (an adapter
slot's bytes: ``service.tenancy``) and by colocation (the trainer's share of a device it shares with vLLM).
"""

from __future__ import annotations

from skyrl_sim_plugins.sim.description.trainers import (  # noqa: F401 (this module's names, defined once there)
    lora_params_per_rank,
    static_bytes,
    trainable_state_bytes,
)
