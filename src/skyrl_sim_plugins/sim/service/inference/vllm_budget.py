"""The bytes of vLLM's start, term by term, as the endpoint's vLLM version sizes them on one engine worker.

One definition of vLLM's memory budget and of every term its start puts on the device. ``kv_cache.kv_cache_size``
sizes the KV cache from ``profiled_budget``; ``vllm_startup.vllm_start`` orders the terms into the start's steps.
The version's rules are the endpoint's ``vllm`` (``skyrl_sim/schema/vllm_versions.py``); every size below cites the
function of vLLM's code it follows (the same Python files in every version listed there unless a rule says
otherwise).

- **Which model runner** (``VllmConfig.use_v2_model_runner``): the V2 runner (``vllm/v1/worker/gpu/``) for the models
  the version's ``mrv2_default`` names (0.23.0's listed architectures only when not quantized:
  ``_is_default_v2_model_runner_model``; 0.26.0 on never asks), else the V1 runner
  (``vllm/v1/worker/gpu_model_runner.py``). The CPU platform runs its own V1-derived runner
  (``cpu_model_runner.py``), never the V2 one (it needs Triton).
- **The budget** (``vllm/v1/worker/utils.py``: ``request_memory``): ``ceil(gpu_memory_utilization x total)``. What
  the worker's process held before its memory snapshot (its CUDA context and NCCL, taken in ``init_device`` before
  ``MemorySnapshot``) is not in it: it only lowers the free memory the budget is checked against.
- **Inside the budget** (``gpu_worker.py``: ``determine_available_memory``, ``utils/mem_utils.py``:
  ``memory_profiling``): the weights, the LoRA adapter slots where vLLM serves LoRA (``lora_slots``: made inside
  ``load_model``), the runner's persistent buffers made while loading (the V2 sampler's
  ``PenaltiesState``: ``output_bin_counts`` int32 ``[max_num_seqs, vocab]`` and ``prompt_bin_mask``), the profile
  run's transient peak (``profile_run``: a forward over ``max_num_batched_tokens`` tokens, then ``_dummy_sampler_run``
  over ``min(max_num_seqs, max_num_batched_tokens)`` rows), and the CUDA-graph estimate where the version takes one
  (``profile_cudagraph_memory``). The KV cache gets the rest.
- **On top of the budget**: the CUDA graphs where the runner does not estimate them (the V2 runner before 0.30), and
  whatever the sampler warm-up allocates beyond the profile run's peak. The V2 runner's profile sampler skips top-k,
  top-p and logprobs (``_dummy_sampler_run``: "the sampler may skip top_k, top_p, and logprobs, using less GPU
  memory than what is possible during actual execution"), while ``warmup_kernels`` samples with
  ``SamplingParams.for_sampler_warmup`` (all of them) over up to ``max_num_seqs`` requests.

Estimates, not derived to the byte: the forward's activation peak (one layer's widest live tensors) and the CUDA
graphs' memory (the activations of the largest captured batch in every layer: ``cuda_graph_bytes`` says what vLLM's
code shows and why the sum stands in for the per-graph memory vLLM measures on the device). The
non-PyTorch memory a process gains while profiling (CUDA modules loaded for the first time) is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from skyrl_sim.api import (
    GIB,
    MODEL_DTYPE_BYTES,
    MRV2_LISTED_ARCHITECTURES,
    Endpoint,
    ModelArch,
    fp8_checkpoint,
    profile_device,
)
from skyrl_sim_plugins.sim.service.inference.fp8_weights import vllm_weights_bytes
from skyrl_sim_plugins.sim.service.inference.lora_slots import lora_slots
from skyrl_sim_plugins.sim.service.inference.vision_weights import tower_built, vision_weights_bytes

Runner = Literal["v1", "v2", "cpu"]
V1_SAMPLER_FP32_COPIES = 2
"""The V1 sampler's profile step (``vllm/v1/sample/sampler.py``: ``forward``) holds the logits' fp32 copy and one fp32
working tensor of top-k/top-p beside the logits (an estimate of its sort buffers)."""
WARMUP_DECODE_LEN = 3
"""``warmup_kernels``: a request of ``decode_query_len + 1`` prompt tokens decodes ``decode_query_len`` more (no
speculative decoding: 1 + 1 + 1 tokens), so it needs ``ceil(3 / block_size)`` KV blocks."""
FLASHINFER_TOP_K_FIRST: tuple[str, ...] = ("fp32", "fp32")
"""What FlashInfer's top-k/top-p sampler allocates beside the fp32 logits vLLM hands it, in order. Every V2 version
read calls ``flashinfer.sampling.top_k_top_p_sampling_from_logits(logits, k, p, deterministic=True)`` for requests
with both top-k and top-p (``vllm/v1/sample/ops/topk_topp_sampler.py``: ``flashinfer_sample``; the warm-up's
``SamplingParams.for_sampler_warmup`` sets both, with a temperature and no seed, so ``Sampler.sample`` takes that
path on CUDA). Its default ``filter_apply_order="top_k_first"`` (``flashinfer/sampling.py``:
``top_k_top_p_sampling_from_logits``) makes ``masked_logits = top_k_mask_logits(logits, top_k)`` (a new tensor,
``torch.empty_like(logits)``: fp32) and then ``probs = torch.softmax(masked_logits, dim=-1)`` (fp32) while the logits
stay alive as the caller's argument. vLLM passes ``top_k`` as a per-request tensor
(``SamplingStates.get_top_k_top_p``), so the scalar-k fast path of newer FlashInfer releases
(``_top_k_first_fast_path_applicable`` requires an ``int``) never applies."""
FP32_BYTES = 4
INT32_BYTES = 4
PENALTY_MASK_BITS = 32


def hf_architecture(model: ModelArch) -> str | None:
    """The Hugging Face architecture vLLM resolves the model to: a config's ``architectures[0]``, else the preset's
    family (``qwen3-*`` dense: Qwen3ForCausalLM, ``qwen2*``: Qwen2ForCausalLM, ``llama*``: LlamaForCausalLM)."""
    listed = model.extra.get("architectures")
    if isinstance(listed, list) and listed:
        return str(listed[0])
    name = model.name.lower()
    if name.startswith("qwen3-") and dense_full_attention(model):
        return "Qwen3ForCausalLM"
    if name.startswith("qwen2"):
        return "Qwen2ForCausalLM"
    if name.startswith("llama"):
        return "LlamaForCausalLM"
    return None


def dense_full_attention(model: ModelArch) -> bool:
    """No experts and every layer full attention (vLLM: not ``is_moe``, not ``is_hybrid``)."""
    return model.moe is None and all(kind == "full_attention" for kind in model.layer_types)


def runner(endpoint: Endpoint, model: ModelArch) -> Runner:
    """The model runner vLLM's default picks for this model (``VllmConfig.use_v2_model_runner``)."""
    if profile_device(endpoint.hardware.profile) != "cuda":
        return "cpu"
    default = endpoint.vllm.mrv2_default
    if default == "all":
        return "v2"
    if default == "dense":
        return "v2" if dense_full_attention(model) else "v1"
    listed = hf_architecture(model) in MRV2_LISTED_ARCHITECTURES
    quantized = fp8_checkpoint(endpoint, model) is not None  # 0.23.0's _is_default_v2_model_runner_model: not quantized
    return "v2" if dense_full_attention(model) and listed and not quantized else "v1"


def requested_memory(endpoint: Endpoint, total_memory_bytes: int) -> int:
    """vLLM's budget on a device (``request_memory``): ``gpu_memory_utilization`` of its total memory, rounded up."""
    return math.ceil(total_memory_bytes * endpoint.inference.gpu_memory_utilization)


def dtype_bytes(endpoint: Endpoint) -> int:
    return MODEL_DTYPE_BYTES[endpoint.inference.model_dtype]


def weights_bytes(endpoint: Endpoint, model: ModelArch) -> int:
    """The weights one engine worker holds: the vision tower vLLM builds for a multimodal checkpoint
    (``vision_weights``: none when it runs the language model only), and the language model's parameters over tensor
    parallel at model dtype, or an FP8 checkpoint's modules in fp8 with their scales and the rest at model dtype
    (``fp8_weights``)."""
    vision = vision_weights_bytes(endpoint, model)
    fp8 = vllm_weights_bytes(endpoint, model)
    if fp8 is not None:
        return vision + fp8
    return vision + model.parameter_count() * dtype_bytes(endpoint) // endpoint.inference.tensor_parallel_size


def largest_weight_bytes(endpoint: Endpoint, model: ModelArch) -> int:
    """The largest single tensor the load allocates: the embedding (vocab-parallel over TP) or one fused MLP matrix."""
    tp, d = endpoint.inference.tensor_parallel_size, dtype_bytes(endpoint)
    embedding = -(-model.vocab_size // tp) * model.hidden_size * d
    ffn = model.ffn_hidden_size if model.moe is None else model.moe.expert_ffn_hidden_size
    return max(embedding, 2 * ffn // tp * model.hidden_size * d)


def sampler_buffers_bytes(endpoint: Endpoint, model: ModelArch) -> int:
    """The V2 sampler's persistent state, made while loading (``vllm/v1/worker/gpu/sample/penalties.py``:
    ``PenaltiesState``): ``output_bin_counts`` int32 ``[max_num_seqs, vocab]`` and ``prompt_bin_mask`` int32
    ``[max_num_seqs, ceil(vocab / 32)]``. The V1 runner keeps no such tensor on the device."""
    if runner(endpoint, model) != "v2":
        return 0
    rows, vocab = endpoint.inference.max_num_seqs, model.vocab_size
    return rows * vocab * INT32_BYTES + rows * -(-vocab // PENALTY_MASK_BITS) * INT32_BYTES


def profile_rows(endpoint: Endpoint) -> int:
    """The dummy sampler's rows in the profile run (``_dummy_run``: ``min(num_tokens, max_num_seqs)`` requests over
    ``max_num_batched_tokens`` tokens, one logit row each)."""
    inference = endpoint.inference
    return min(inference.max_num_seqs, inference.max_num_batched_tokens)


def forward_peak_bytes(endpoint: Endpoint, model: ModelArch, tokens: int) -> int:
    """Estimated activation peak of a forward over ``tokens`` tokens on one worker: one layer's widest live tensors
    (the residual and hidden state, qkv, the fused gate+up and its SwiGLU output)."""
    tp = endpoint.inference.tensor_parallel_size
    ffn = model.ffn_hidden_size if model.moe is None else model.moe.expert_ffn_hidden_size * model.moe.top_k
    per_token = 2 * model.hidden_size + (model.qkv_width + 3 * ffn) // tp
    return tokens * per_token * dtype_bytes(endpoint)


def profile_sampler_bytes(endpoint: Endpoint, model: ModelArch) -> int:
    """The profile run's dummy sampler step: the logits of ``profile_rows`` rows (``compute_logits``, model dtype),
    and on the V1 runner its fp32 copies (``Sampler.forward``: ``logits.to(torch.float32)``, top-k/top-p). The V2
    runner's profile skips top-k, top-p and logprobs: the logits are all it holds."""
    cells = profile_rows(endpoint) * model.vocab_size
    logits = cells * dtype_bytes(endpoint)
    if runner(endpoint, model) == "v2":
        return logits
    return logits + cells * FP32_BYTES * V1_SAMPLER_FP32_COPIES


def profile_runs(endpoint: Endpoint, model: ModelArch) -> bool:
    """Whether the start runs a profile run: always on CUDA; on CPU only to warm a compiled model up
    (``cpu_worker.py``: ``determine_available_memory`` calls ``warming_up_model``, which returns at once in eager
    mode, ``CompilationMode.NONE``)."""
    return runner(endpoint, model) != "cpu" or not endpoint.inference.enforce_eager


def encoder_profile_items(endpoint: Endpoint, model: ModelArch) -> tuple[int, int]:
    """``(items, tokens per item)`` of the dummy image batch the profile run encodes first, ``(0, 0)`` without a vision
    tower (``v1/worker/gpu/model_runner.py`` and ``gpu_model_runner.py``: ``profile_run``; ``multimodal/
    encoder_budget.py``: ``MultiModalBudget``). The encoder budget is ``min(compute, cache)`` with both
    ``max(max_num_batched_tokens, the largest item's tokens)`` (``encoder_cache_manager.py``:
    ``compute_mm_encoder_budget``; ``SchedulerConfig`` sets ``max_num_encoder_input_tokens`` and
    ``encoder_cache_size`` to ``max_num_batched_tokens``), and the batch is ``budget // tokens per item`` copies of the
    largest image (``_get_max_items``, ``get_dummy_encoder_profile_inputs``; the decoder bound ``max_num_seqs x
    items per prompt`` is larger at any setting modelled). Not on CPU: only a CUDA start profiles."""
    tower = tower_built(endpoint, model)
    if tower is None or runner(endpoint, model) == "cpu":
        return 0, 0
    per_item = tower.max_image_tokens
    budget = max(endpoint.inference.max_num_batched_tokens, per_item)
    return max(1, budget // per_item), per_item


def encoder_output_bytes(endpoint: Endpoint, model: ModelArch) -> int:
    """The dummy batch's encoder outputs, which the encoder cache keeps through the language model's dummy run
    (``encoder_runner.py``: ``profile_encoder_cache`` stores them as ``tmp_i`` until ``reset_encoder_cache``): one
    ``out_hidden_size`` vector per token (times ``1 + deepstack mergers``) at the model's dtype, whole on every rank
    (the merger's ``linear_fc2`` is row-parallel: all-reduced)."""
    items, per_item = encoder_profile_items(endpoint, model)
    tower = tower_built(endpoint, model)
    if not items or tower is None:
        return 0
    width = tower.out_hidden_size * (1 + tower.deepstack_mergers)
    return items * per_item * width * dtype_bytes(endpoint)


def encoder_forward_peak_bytes(endpoint: Endpoint, model: ModelArch) -> int:
    """Estimated activation peak of the tower's forward over the dummy batch on one worker (``Qwen3_VisionTransformer.
    forward``): the patches' pixels as the processor hands them (fp32) and their model-dtype copy (``input_norm``),
    the interpolated position embeddings (``prepare_encoder_metadata``), and one block's widest live tensors: the
    residual and its norm, the TP-sharded qkv, ``linear_fc1``'s output and its activation (as ``forward_peak_bytes``
    estimates a decoder layer); the attention is FlashAttention's (no ``[patches, patches]`` scores)."""
    items, per_item = encoder_profile_items(endpoint, model)
    tower = tower_built(endpoint, model)
    if not items or tower is None:
        return 0
    tp, d = endpoint.inference.tensor_parallel_size, dtype_bytes(endpoint)
    patches = items * per_item * tower.spatial_merge_size**2
    pixels = patches * tower.patch_inputs * (FP32_BYTES + d)
    h = tower.hidden_size
    per_patch = 2 * h + h + (3 * h + 2 * tower.intermediate_size) // tp  # residual, norm, pos embeds; qkv, fc1, act
    return pixels + patches * per_patch * d


def profile_activation_bytes(endpoint: Endpoint, model: ModelArch) -> int:
    """The profile run's transient peak on one worker (``memory_profiling``: the torch peak above what stays
    allocated): for a multimodal checkpoint the vision encoder's forward over the dummy image batch first, then its
    outputs held in the encoder cache beside the language model's dummy run (``encoder_profile_items``); the larger
    of the forward over ``max_num_batched_tokens`` tokens and the dummy sampler step; 0 where no profile run
    happens."""
    if not profile_runs(endpoint, model):
        return 0
    forward = forward_peak_bytes(endpoint, model, endpoint.inference.max_num_batched_tokens)
    language = max(forward, profile_sampler_bytes(endpoint, model))
    return max(encoder_forward_peak_bytes(endpoint, model), encoder_output_bytes(endpoint, model) + language)


def graphs_captured(endpoint: Endpoint) -> bool:
    """Whether vLLM captures CUDA graphs: not with ``enforce_eager``, never on CPU."""
    return not endpoint.inference.enforce_eager and profile_device(endpoint.hardware.profile) == "cuda"


def cudagraph_capture_sizes(endpoint: Endpoint) -> tuple[int, ...]:
    """The batch sizes vLLM captures by default (``VllmConfig._set_cudagraph_sizes``): 1, 2, 4, then every 8 below
    256 and every 16 from 256, up to ``min(2 x max_num_seqs, 512, max_num_batched_tokens)``, plus
    ``max_num_batched_tokens`` when it is below that ceiling. Empty without graphs."""
    if not graphs_captured(endpoint):
        return ()
    inference = endpoint.inference
    top = min(inference.max_num_seqs * 2, endpoint.vllm.max_cudagraph_capture_size, inference.max_num_batched_tokens)
    sizes = [n for n in (1, 2, 4) if n <= top]
    if top >= 8:
        sizes += list(range(8, min(top + 1, 256), 8))
    if top >= 256:
        sizes += list(range(256, top + 1, 16))
    if inference.max_num_batched_tokens <= top:
        sizes.append(inference.max_num_batched_tokens)
    return tuple(sorted(set(sizes)))


def cudagraph_capture_descs(endpoint: Endpoint) -> dict[str, tuple[int, ...]]:
    """The graphs vLLM's default ``cudagraph_mode`` (``FULL_AND_PIECEWISE`` in every version modelled:
    ``config/vllm.py``'s optimization-level defaults) captures, per mode, largest first
    (``CudagraphDispatcher.get_capture_descs``: PIECEWISE first, then FULL, each sorted by ``num_tokens``
    descending). ``initialize_cudagraph_keys``: a PIECEWISE graph for every capture size (mixed batches); a FULL graph
    for every capture size up to ``max_num_seqs`` (uniform decode batches, query length 1: no speculative decoding).
    LoRA's capture cases (one graph per size and LoRA count) are not modelled. Empty without graphs."""
    sizes = cudagraph_capture_sizes(endpoint)
    if not sizes:
        return {}
    largest_first = tuple(sorted(sizes, reverse=True))
    full = tuple(n for n in largest_first if n <= endpoint.inference.max_num_seqs)
    descs = {"PIECEWISE": largest_first}
    if full:
        descs["FULL"] = full
    return descs


def cuda_graph_bytes(endpoint: Endpoint, model: ModelArch) -> int:
    """Estimated memory of capturing vLLM's graphs on one worker (0 without graphs): one forward's activations at the
    largest captured size over the modes (``cudagraph_capture_descs``), in every layer.

    What vLLM's code says, and why this stays an estimate. Inside one capture a freed intermediate returns to the
    private pool and the capture's later allocations reuse it; between pieces the compiled module drops each value
    after its last use (``torch/fx/graph.py``: ``delete_unused_values``) and the pieces' outputs are weak references
    (``compilation/cuda_graph.py``: ``CUDAGraphWrapper.__call__``); sizes are captured largest first into one shared
    pool, FULL and PIECEWISE overlaid (``profile_cudagraph_memory``: ``max`` of the modes' first captures). So the
    pool keeps about one forward's live peak, not one per layer, and the eager warm-up before each capture leaves as
    much in PyTorch's cache (``capture_model`` reads the free memory before its last ``empty_cache``). The rest of
    what vLLM measures is each graph's own memory (the driver's, for every instantiated graph): vLLM takes the second
    capture's delta, at least 1 MiB a graph, and extrapolates; its code does not size it. Public logs put it at 2-15
    MiB a captured size, growing with the model's depth (``validation/vllm-public-logs``): a code-only rule (pool,
    warm-up cache and the 1 MiB floor) reads 0.24-0.50 of every logged capture, so the per-layer sum, which grows with
    depth as that memory does (1.15-3.38x the logs of small models), is kept until a GPU measures the per-graph
    memory."""
    descs = cudagraph_capture_descs(endpoint)
    if not descs:
        return 0
    largest = max(sizes[0] for sizes in descs.values())
    return forward_peak_bytes(endpoint, model, largest) * model.num_layers


def graphs_in_budget(endpoint: Endpoint, model: ModelArch) -> bool:
    """Whether the graphs' memory is taken out of the KV budget: the V1 runner estimates it
    (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``, on by default); the V2 runner only from 0.30."""
    rules = endpoint.vllm
    kind = runner(endpoint, model)
    if kind == "cpu":
        return False
    return rules.mrv2_graph_estimate if kind == "v2" else rules.graph_estimate_default


def warmup_rows(endpoint: Endpoint, model: ModelArch, num_blocks: int, block_size: int) -> int:
    """The requests the sampler warm-up samples for. V2 (``warmup.py``: ``warmup_kernels``): ``min(max_num_seqs,
    max_num_batched_tokens // 2, (num_blocks - 1) // blocks_per_request)``; V1 (``compile_or_warm_up_model``):
    ``min(max_num_seqs, max_num_batched_tokens)``."""
    inference = endpoint.inference
    if runner(endpoint, model) != "v2":
        return min(inference.max_num_seqs, inference.max_num_batched_tokens)
    per_request = -(-WARMUP_DECODE_LEN // block_size)
    return max(1, min(inference.max_num_seqs, inference.max_num_batched_tokens // 2, (num_blocks - 1) // per_request))


def warmup_tensors(endpoint: Endpoint, model: ModelArch, rows: int) -> tuple[int, ...]:
    """The ``[rows, vocab]`` tensors the warm-up's sampling step allocates, in order, in bytes. V2: the version's
    ``mrv2_warmup_sampler`` (the logits, then the fp32 copy ``apply_sampling_params`` makes, a raw-logprobs clone,
    the copy ``flashinfer_sample`` takes), then FlashInfer's masked logits and probabilities
    (``FLASHINFER_TOP_K_FIRST``: the V2 runner only runs on CUDA, and ``flashinfer_sampler_supported`` holds on every
    modelled card: A100, L4, H100, H200, B200 and B300 are compute capability 8.0 to 10.3, inside
    ``FlashInferBackend.supports_compute_capability``'s 8.0 to 12.1, with more than 16 SMs); V1:
    ``_dummy_sampler_run`` again, the same step as the profile run's."""
    cells = rows * model.vocab_size
    if runner(endpoint, model) != "v2":
        return (cells * dtype_bytes(endpoint),) + (cells * FP32_BYTES,) * V1_SAMPLER_FP32_COPIES
    sizes = {"fp32": FP32_BYTES, "model": dtype_bytes(endpoint)}
    elements = endpoint.vllm.mrv2_warmup_sampler + FLASHINFER_TOP_K_FIRST
    return tuple(cells * sizes[element] for element in elements)


@dataclass(frozen=True)
class ProfiledBudget:
    """What ``determine_available_memory`` takes out of the requested budget on one device, and the KV bytes left."""

    requested_bytes: int
    weights_bytes: int
    buffers_bytes: int  # the runner's persistent buffers made while loading (V2 sampler state)
    activation_bytes: int  # the profile run's transient peak
    cuda_graph_bytes: int  # the graphs' estimate taken out of the budget (0 where the runner takes none)
    process_bytes: int = 0  # CPU: the worker's resident set beside its tensors, which its budget counts
    lora_slots_bytes: int = 0  # the LoRA adapter slots, made inside load_model (``lora_slots``)

    @property
    def kv_bytes(self) -> int:
        """The budget less the weights, the LoRA slots, the buffers, the profiled activations, the graphs' estimate
        and (CPU) the process's own resident memory."""
        used = self.weights_bytes + self.lora_slots_bytes + self.buffers_bytes + self.activation_bytes
        return self.requested_bytes - used - self.cuda_graph_bytes - self.process_bytes


def profiled_budget(endpoint: Endpoint, model: ModelArch, total_memory_bytes: int) -> ProfiledBudget:
    """vLLM's profiled budget on a device of ``total_memory_bytes``: the one definition of the KV budget. On CPU
    (``cpu_worker.py``: ``determine_available_memory``) the KV cache gets ``ceil(gpu_memory_utilization x the node's
    memory)`` less the worker's whole resident set after its warm-up profile run: the process's own memory
    (``hardware.reserve_gib``) is in it."""
    graphs = cuda_graph_bytes(endpoint, model) if graphs_in_budget(endpoint, model) else 0
    process = int(endpoint.hardware.reserve_gib * GIB) if runner(endpoint, model) == "cpu" else 0
    return ProfiledBudget(
        requested_memory(endpoint, total_memory_bytes),
        weights_bytes(endpoint, model),
        sampler_buffers_bytes(endpoint, model),
        profile_activation_bytes(endpoint, model),
        graphs,
        process,
        lora_slots(endpoint, model).total,
    )
