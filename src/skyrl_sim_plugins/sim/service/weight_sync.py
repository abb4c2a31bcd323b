"""A merged weight sync to vLLM engines on GPUs of their own (``placement.colocate_all: false``): both ends' memory.

SkyRL 0.4.0 broadcasts the full weights over NCCL from the trainer's rank 0 to every inference worker
(``worker_dispatch.py``: ``save_weights_for_sampler``, ``_broadcast_to_inference_engines``), streamed through packed
buffers (``weight_senders.py``: ``_packed_buffer_size_bytes``: the configured
``weight_transfer_threshold_cuda_ipc_GB``, floored to vLLM's 1 GiB default and to the largest parameter). vLLM's
packed producer and consumer (``vllm/distributed/weight_transfer/packed_tensor.py``) fill a buffer tensor by tensor
until it passes that size, so one bucket is up to the target plus its last tensor:

- **Receive side** (``packed_nccl_broadcast_consumer``): it keeps ``DEFAULT_PACKED_NUM_BUFFERS`` (2) slots and
  allocates the next bucket before the slot's old one is released, so when bucket ``i`` is allocated buckets
  ``i - 1`` and ``i - 2`` are still alive. They must fit beside what the awake engine holds: its context, weights,
  KV cache, graphs and the activations its last step left cached. With ``offload_kv_for_weight_sync`` (PR #1934,
  non-colocated and non-LoRA only) SkyRL sleeps the engine first (``sleep() -> wake_up(["weights"]) -> broadcast ->
  wake_up(["kv_cache"])``), so the KV cache is not on the device during the broadcast; the synchronous trainer's
  plain sleep discards it (level 2: nothing is copied), and waking it maps it again.
- **Send side** (``packed_nccl_broadcast_producer``): it drops a slot's old bucket before packing the next, so two
  buckets are alive, beside the trainer's resident model and optimizer (nothing is offloaded when the engines have
  their own GPUs) and, under tensor parallelism, the full tensor gathered from the shards.

The tensors are streamed in the model's order (the embedding, each layer, the final norm, the output layer). Only
the merged (full-weight) sync is modelled here; an adapter sync exports and loads the adapter (the time model's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skyrl_sim.api import GIB, MODEL_DTYPE_BYTES, Endpoint, HardwareProfile, ModelArch, OomRecord, format_size
from skyrl_sim_plugins.sim.reference.allocator import round_reserved
from skyrl_sim_plugins.sim.reference.device_memory import endpoint_allocator
from skyrl_sim_plugins.sim.reference.static_memory import static_bytes
from skyrl_sim_plugins.sim.service.inference.fp8_weights import sync_tensors
from skyrl_sim_plugins.sim.service.inference.vllm_startup import StartFailure, VllmStart
from skyrl_sim_plugins.sim.service.inference.weight_tensors import model_tensors  # noqa: F401 (imported from here)

VLLM_PACKED_BUFFER_BYTES = 1 << 30
"""vLLM's ``DEFAULT_PACKED_BUFFER_SIZE_BYTES``: SkyRL's packed buffer is never smaller."""


def packed_target_bytes(endpoint: Endpoint, tensors: list[int]) -> int:
    """``_packed_buffer_size_bytes``: the configured size (GB read as GiB), floored to vLLM's default and to the
    largest tensor."""
    configured = int(endpoint.inference.weight_transfer_threshold_cuda_ipc_GB * GIB)
    return max(VLLM_PACKED_BUFFER_BYTES, configured, max(tensors))


def buckets(tensors: list[int], target: int) -> list[int]:
    """The packed buckets: tensors are added until the bucket passes ``target`` (``if packing_tensor_sizes >
    target_packed_tensor_size: break``), the rest go in a last, smaller one."""
    out, size = [], 0
    for nbytes in tensors:
        size += nbytes
        if size > target:
            out.append(size)
            size = 0
    if size:
        out.append(size)
    return out


@dataclass(frozen=True)
class SyncFailure:
    side: str  # inference | trainer
    bucket: int  # index of the bucket whose allocation failed
    attempted: int
    free: int
    held: int  # the sync's own buffers alive beside it


def first_failure(sizes: list[int], free: int, alive: int) -> SyncFailure | None:
    """The first bucket whose allocation does not fit in ``free`` bytes beside the ``alive - 1`` buckets before it
    that are still referenced; None when every bucket fits."""
    for i, nbytes in enumerate(sizes):
        held = sum(sizes[max(0, i - alive + 1) : i])
        if held + nbytes > free:
            return SyncFailure("", i, nbytes, max(free - held, 0), held)
    return None


@dataclass(frozen=True)
class SeparateSync:
    """A merged sync's memory on both ends: the buckets, each side's free bytes, and the first failure (if any)."""

    buckets: list[int]
    receive_free: int
    send_free: int
    offload_kv: bool
    failure: SyncFailure | None
    start_failure: StartFailure | None = None  # the engine could not start on its own device: no sync at all
    start: dict[str, Any] | None = None  # that start's steps (``VllmStart.as_dict``), for --explain

    def as_dict(self) -> dict[str, Any]:
        return {
            "buckets": len(self.buckets),
            "largest_bucket_bytes": max(self.buckets) if self.buckets else 0,
            "receive_free_bytes": self.receive_free,
            "send_free_bytes": self.send_free,
            "offload_kv_for_weight_sync": self.offload_kv,
        }

    def oom(self, endpoint: Endpoint) -> OomRecord | None:
        """The failure as an out-of-memory record (phase ``weight_sync``), in PyTorch's words; a start that failed on
        the engine's own device first (phase ``vllm_start``: SkyRL starts the engines before the first sync)."""
        total = int(endpoint.hardware.device_memory_gib * GIB)
        if self.start_failure is not None:
            sf = self.start_failure
            where = {"phase": "vllm_start", "op": f"vllm_start: {sf.step}", "start_step": sf.step, "check": sf.check,
                     "free_bytes": sf.free, "start_live_bytes": sf.live, "start": self.start}
            return OomRecord(attempted_bytes=sf.attempted, where=where, message=sf.message, capacity_bytes=total)
        f = self.failure
        if f is None:
            return None
        message = (
            f"CUDA out of memory. Tried to allocate {format_size(round_reserved(f.attempted))}. GPU 0 has a total "
            "capacity of "
            f"{format_size(total)} of which {format_size(f.free)} is free. (weight sync, {f.side} side: packed "
            f"bucket {f.bucket + 1} of {len(self.buckets)})"
        )
        where = {
            "phase": "weight_sync",
            "op": f"weight_sync: {f.side} bucket",
            "side": f.side,
            "bucket": f.bucket,
            "free_bytes": f.free,
            "sync_buffers_bytes": f.held,
            **self.as_dict(),
        }
        return OomRecord(attempted_bytes=f.attempted, where=where, message=message, capacity_bytes=total)


def separate_sync(endpoint: Endpoint, model: ModelArch, start: VllmStart) -> SeparateSync:
    """Both ends of a merged sync to engines on their own GPUs, from the engine's start on its device."""
    dtype = MODEL_DTYPE_BYTES[endpoint.inference.model_dtype]
    tensors = sync_tensors(endpoint, model, dtype)  # SkyRL's FP8 wire to an FP8 vLLM
    sizes = buckets(tensors, packed_target_bytes(endpoint, tensors))
    offload = endpoint.inference.offload_kv_for_weight_sync
    started = start.first_failure(start.total - start.context)
    if started is not None:
        return SeparateSync(sizes, 0, 0, offload, None, started, start.as_dict())
    # awake: everything it serves with; slept for the sync: only its context and the woken weights pool
    vllm_held = start.context + start.weights if offload else start.awake
    receive_free = start.total - vllm_held
    alive = endpoint.vllm.packed_num_buffers + 1
    failure = first_failure(sizes, receive_free, alive)
    if failure is not None:
        failure = SyncFailure("inference", failure.bucket, failure.attempted, failure.free, failure.held)
    send_free = trainer_free(endpoint, model, tensors)
    if failure is None:
        sent = first_failure(sizes, send_free, endpoint.vllm.packed_num_buffers)
        if sent is not None:
            failure = SyncFailure("trainer", sent.bucket, sent.attempted, sent.free, sent.held)
    return SeparateSync(sizes, receive_free, send_free, offload, failure)


def trainer_free(endpoint: Endpoint, model: ModelArch, tensors: list[int]) -> int:
    """What the trainer's rank 0 has free for its send buffers: its device less its memory outside PyTorch, its
    resident model and optimizer, and under tensor parallelism the largest tensor gathered whole."""
    rule = endpoint_allocator(endpoint)
    static = static_bytes(model, endpoint)
    resident = rule.reserved(static["weights"]) + rule.reserved(static["adapters"])
    gathered = max(tensors) if endpoint.parallelism.tp > 1 else 0
    return endpoint.capacity_bytes - resident - gathered


def kv_round_trip_seconds(start: VllmStart, profile: HardwareProfile, offload_kv: bool) -> float:
    """The KV cache's part of a sync with ``offload_kv_for_weight_sync``: the synchronous trainer's plain sleep
    discards it and the wake maps it again (no copy); only the graph pools go to the host and back."""
    return 2 * start.graphs / profile.bytes_host if offload_kv else 0.0
