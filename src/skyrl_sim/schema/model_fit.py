"""What an endpoint and its model must agree on, checked once both are read."""

from __future__ import annotations

from skyrl_sim.errors import ScenarioError, UserError
from skyrl_sim.schema.architecture import ModelArch
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.quantization import fp8_refusal


def check_fit(endpoint: Endpoint, model: ModelArch) -> None:
    """What the endpoint and its model must agree on: TP splits the attention heads and the KV groups evenly, the
    pipeline stages have layers, vLLM's TP splits the attention heads (vLLM checks it; more ranks than KV heads
    replicate them), vLLM's step budget holds its longest sequence when chunked prefill is off, the hardware profile
    exists, an FP8 vLLM is one vLLM and SkyRL run (``quantization.fp8_refusal``). Raises ScenarioError with the
    endpoint key (the caller adds the file)."""
    if endpoint.parallelism.pp > model.num_layers:
        reason = f"pipeline parallel size {endpoint.parallelism.pp} exceeds the model's {model.num_layers} layers"
        raise ScenarioError("", "parallelism.pp", reason)
    tp = endpoint.parallelism.tp
    for what, count in (("num_attention_heads", model.num_attention_heads), ("num_kv_heads", model.num_kv_heads)):
        if count % tp:
            raise ScenarioError("", "parallelism.tp", f"tp {tp} does not divide the model's {what} ({count})")
    vllm_tp = endpoint.inference.tensor_parallel_size
    if endpoint.runs_vllm and model.num_attention_heads % vllm_tp:
        reason = (
            f"vLLM's tensor parallel size {vllm_tp} does not divide the model's {model.num_attention_heads} attention "
            "heads: vLLM refuses to start (vllm/config/model.py: verify_with_parallel_config)"
        )
        raise ScenarioError("", "inference.tensor_parallel_size", reason)
    given, limit = endpoint.inference.max_model_len, model.extra.get("max_position_embeddings")
    unscaled = isinstance(limit, int) and not model.extra.get("rope_scaling")  # vLLM derives the context itself
    if endpoint.runs_vllm and given is not None and unscaled and given > limit:
        reason = (  # vllm/config/model.py: _get_and_verify_max_len, vLLM's words
            f"User-specified max_model_len ({given}) is greater than the derived max_model_len "
            f"(max_position_embeddings={limit} in the model's config): vLLM refuses to start unless "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (vllm/config/model.py: _get_and_verify_max_len); lower "
            "inference.max_model_len"
        )
        raise ScenarioError("", "inference.max_model_len", reason)
    context = endpoint.vllm_max_model_len(model)
    budget = endpoint.inference.max_num_batched_tokens
    if endpoint.runs_vllm and not endpoint.inference.enable_chunked_prefill and context is not None and budget < context:
        reason = (  # vllm/config/scheduler.py: SchedulerConfig.verify_max_model_len, vLLM's words
            f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({context}) with chunked prefill off: "
            "vLLM refuses to start (vllm/config/scheduler.py: verify_max_model_len); raise "
            "inference.max_num_batched_tokens, lower inference.max_model_len, or keep enable_chunked_prefill true"
        )
        raise ScenarioError("", "inference.enable_chunked_prefill", reason)
    refusal = fp8_refusal(endpoint, model)  # also reads the FP8 checkpoint, refusing what vLLM refuses
    if refusal is not None:
        raise refusal
    from skyrl_sim.schema.hardware import load_profile  # hardware reads its files through this module

    try:
        load_profile(endpoint.hardware.profile)
    except UserError as exc:
        raise ScenarioError("", "hardware.profile", str(exc)) from None
