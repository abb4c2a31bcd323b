"""The trainer axis: Megatron and FSDP, LoRA or full fine-tuning (``sim/description/trainers.py``), the FSDP trainer's
walk (``memory_fsdp``, ``memory_ops_hf``), the optimizer left on the GPU in a colocated run, and ``from-skyrl``'s
mapping of each setting."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from project_paths import SCENARIOS
from skyrl_sim.cli import main
from skyrl_sim.commands.from_skyrl import convert, validated
from skyrl_sim.engine.shapes import FSDP, MEGATRON, shape_call
from skyrl_sim.errors import UserError
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.sim.bound.memory import default_memory_model
from skyrl_sim_plugins.sim.description.trainers import (
    after_backward,
    after_optim_step,
    fsdp_terms,
    fsdp_units,
    hf_end_params,
    hf_layer_params,
    megatron_terms,
    shard_numel,
    static_bytes,
    trainer_of,
)

FSDP_MIX = SCENARIOS / "tiny_fsdp_mix.yaml"


def variant(path: Path, endpoint: str | None = None, name: str = "roomy", overrides: dict | None = None):
    scenario = load_scenario(path, endpoint)
    return scenario.resolve(name, overrides or {})


def test_each_endpoint_picks_its_trainer() -> None:
    fsdp = variant(FSDP_MIX).endpoint
    assert trainer_of(fsdp).key == "fsdp-lora"
    full = fsdp.model_copy(update={"trainer": fsdp.trainer.model_copy(update={"train_base_weights": True})})
    assert trainer_of(full).key == "fsdp-full"
    mega = variant(SCENARIOS / "queue_drain_17_tiny.yaml", name="cap-aware").endpoint
    assert trainer_of(mega).key == "megatron-lora"


def test_megatron_full_fine_tuning_keeps_gradients_and_a_dp_shard_of_the_optimizer() -> None:
    v = variant(SCENARIOS / "queue_drain_17_tiny.yaml", name="cap-aware", overrides={"trainer.train_base_weights": True})
    ep, model = v.endpoint, v.model
    def terms_of(endpoint):
        out: dict[str, int] = {}
        for t in megatron_terms(model, endpoint):
            out[t.category] = out.get(t.category, 0) + t.nbytes
        return out

    terms = terms_of(ep)
    params = terms["weights"] // 4  # fp32 weights
    assert "adapters" not in terms and ep.adapted_targets(model) == frozenset()
    assert terms["gradients"] == params * 4  # grad_reduce_in_fp32
    assert terms["optimizer_state"] == params * 8  # fp32 weights: no master copy, two moments, DP 1
    moments = [t for t in megatron_terms(model, ep) if t.lazy]
    assert [t.category for t in moments] == ["optimizer_state"]  # Adam's moments come with the first optim_step
    assert static_bytes(model, ep).get("optimizer_state", 0) == 0
    overrides = {"trainer.train_base_weights": True, "trainer.params_dtype": "bf16", "trainer.grad_reduce_in_fp32": False}
    bf16 = variant(SCENARIOS / "queue_drain_17_tiny.yaml", name="cap-aware", overrides=overrides).endpoint
    half = terms_of(bf16)
    assert half["gradients"] == params * 2 and half["optimizer_state"] == params * 8
    assert half["master_weights"] == params * 4  # 16-bit weights: the optimizer's fp32 main parameters
    offload = ep.model_copy(update={"trainer": ep.trainer.model_copy(update={"optimizer_offload": True})})
    assert terms_of(offload)["optimizer_state"] == 0
    dp2 = variant(
        SCENARIOS / "queue_drain_17_tiny.yaml",
        name="cap-aware",
        overrides={"trainer.train_base_weights": True, "parallelism.dp": 2, "hardware.devices": 2},
    ).endpoint
    assert terms_of(dp2)["optimizer_state"] == math.ceil(params * 8 / 2)


def test_fsdp_shards_every_parameter_padded_and_makes_gradients_and_moments_on_the_way() -> None:
    v1, v2 = variant(FSDP_MIX), variant(SCENARIOS / "tiny_fsdp_mix_dp2.yaml")
    model = v1.model
    one = {t.category: t for t in fsdp_terms(model, v1.endpoint)}
    two = {t.category: t for t in fsdp_terms(model, v2.endpoint)}
    lora = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})  # all-linear
    params = hf_end_params(model) + hf_layer_params(model, 8, lora) * model.num_layers
    for world, terms in ((1, one), (2, two)):
        assert terms["weights"].nbytes == 4 * sum(shard_numel(p.shape, world) for p in params if not p.lora)
        assert terms["adapters"].nbytes == 4 * sum(shard_numel(p.shape, world) for p in params if p.lora)
    assert shard_numel((5, 3), 2) == 9 and shard_numel((4,), 2) == 2  # ceil(d0 / W) rows
    assert one["gradients"].lazy and one["optimizer_state"].lazy and not one["weights"].lazy
    assert static_bytes(model, v1.endpoint) == {"weights": one["weights"].nbytes, "adapters": one["adapters"].nbytes}
    held = after_backward({}, model, v1.endpoint)
    assert held == {"gradients": one["gradients"].nbytes}
    stepped = after_optim_step(held, model, v1.endpoint)
    assert stepped == {"optimizer_state": one["optimizer_state"].nbytes}  # zero_grad frees the gradients
    offload = variant(FSDP_MIX, overrides={"trainer.fsdp.cpu_offload": True}).endpoint
    assert all(t.nbytes == 0 for t in fsdp_terms(model, offload))


def test_fsdp_units_are_a_layer_the_embedding_and_the_root_in_the_compute_dtype() -> None:
    v = variant(FSDP_MIX)
    units = fsdp_units(v.model, v.endpoint)
    lora = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
    layer = sum(math.prod(p.shape) for p in hf_layer_params(v.model, 8, lora))
    assert units.layer.unsharded == layer * 4 and units.layer.flat == 0  # one rank: no flat all-gather output
    assert units.embedding is not None and units.embedding.unsharded == v.model.vocab_size * v.model.hidden_size * 4
    assert units.root.grad_unsharded == 0  # LoRA: the output layer does not train
    two = fsdp_units(v.model, variant(SCENARIOS / "tiny_fsdp_mix_dp2.yaml").endpoint)
    assert two.layer.flat == two.layer.unsharded and two.layer.reduce_scatter > 0


def test_fsdp_micro_batches_keep_the_calls_width() -> None:
    ep = variant(FSDP_MIX).endpoint
    lengths = [1200, 1100, 400, 300, 200, 100, 50, 40]
    shape = shape_call("forward_backward", lengths, ep, FSDP)
    assert [mb.width for mb in shape.microbatches] == [1201, 1201]
    trimmed = shape_call("forward_backward", lengths, ep, MEGATRON)
    assert trimmed.microbatches[-1].width == 201  # Megatron trims to the micro-batch's longest row


def test_an_fsdp_walk_names_the_hugging_face_model_and_fsdp_units_never_megatron() -> None:
    v = variant(FSDP_MIX, name="tight")
    shape = shape_call("forward_backward", [700, 650, 600, 550], v.endpoint, FSDP)
    report = default_memory_model().evaluate(shape, v.endpoint, v.model)
    assert report.oom is not None
    ops = [str(row["op"]) for row in report.resolve_timeline()]
    assert any(op.startswith("fsdp.") for op in ops) and any("lora_" in op for op in ops)
    assert not any("linear_qkv" in op or "linear_fc1" in op or "core_attention" in op for op in ops)
    assert report.breakdown.get("fsdp_units", 0) > 0 or report.oom is not None


def test_fsdp_fp32_log_probs_unbind_the_logits_into_views_and_stack_only_the_gradients() -> None:
    # SkyRL's logprobs_from_logits_v2 loops over the fp32 logits (Tensor.__iter__: unbind, views): its forward and
    # the entropy chunks after it hold no logits-sized copy; the unbind's backward stacks the rows' gradients. The six-
    # row call under the tight limit therefore fits its entropy chunk and is refused at the gather backward's
    # scatter_add of the first micro-batch's [4, 1201, 512] fp32, where the real FSDP trainer is refused.
    v = variant(FSDP_MIX, name="tight")
    shape = shape_call("forward_backward", [1200, 1100, 400, 300, 200, 100], v.endpoint, FSDP)
    report = default_memory_model().evaluate(shape, v.endpoint, v.model)
    assert report.oom is not None
    assert report.oom.where["op"] == "logprobs.gather.backward.scatter_add"
    assert report.oom.attempted_bytes == 4 * 1201 * 512 * 4
    rows: dict[str, dict] = {}
    for row in report.resolve_timeline():
        if row["microbatch"] == 0:
            rows.setdefault(str(row["op"]), row)  # each op's first step
    logits = 4 * 1201 * 512 * 4
    assert rows["entropy.chunk_0"]["allocated"] < rows["lm_head.logits"]["allocated"] + logits // 100
    assert rows["logprobs.unbind.backward"]["bytes"] == logits


def test_fsdp_gradients_appear_after_a_backward_and_go_at_optim_step() -> None:
    result = PluginHost().run(variant(FSDP_MIX), "sim")
    calls = result.calls
    grads = [c.memory["breakdown"].get("gradients", 0) for c in calls if c.memory and c.kind == "forward_backward"]
    assert grads[0] == 0 and grads[1] > 0  # the first call makes them; the next finds them
    moments = [c.memory["breakdown"].get("optimizer_state", 0) for c in calls if c.memory]
    assert moments[-1] > 0 and moments[0] == 0  # AdamW's moments exist from the first optim_step on
    assert calls[-1].memory["breakdown"].get("gradients", 0) == 0  # the call after optim_step: zero_grad freed them


def test_a_model_the_fsdp_walk_does_not_describe_is_refused_with_the_key() -> None:
    scenario = load_scenario(SCENARIOS / "moe_r3_tiny.yaml")
    moe = scenario.resolve(scenario.variant_names[0], {"trainer.strategy": "fsdp"})
    with pytest.raises(UserError, match="trainer.strategy"):
        PluginHost().run(moe, "sim")


def test_the_optimizer_left_on_the_gpu_fails_the_wake_and_offloaded_passes(capsys) -> None:
    assert main(["check", str(SCENARIOS / "colocated_optimizer_on_gpu.yaml")]) == 0  # both variants' expectations
    scenario = load_scenario(SCENARIOS / "colocated_optimizer_on_gpu.yaml")
    on_gpu = PluginHost().run(scenario.resolve("on-gpu"), "sim")
    failed = [c for c in on_gpu.calls if c.oom is not None]
    assert len(failed) == 1 and failed[0].oom.where["phase"] == "wake"
    assert failed[0].oom.where["on_device"]["trainer"] == "model offloaded, optimizer resident"
    offloaded = PluginHost().run(scenario.resolve("offloaded"), "sim")
    assert not [c for c in offloaded.calls if c.oom is not None]


def test_from_skyrl_maps_fsdp_full_fine_tuning_and_the_optimizer_settings(tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 4, "num_attention_heads": 8,
                "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 32000, "tie_word_embeddings": False,
                "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            }
        )
    )
    backend = {
        "trainer.policy.model.lora.rank": 0,
        "trainer.policy.fsdp_config.cpu_offload": True,
        "trainer.policy.fsdp_config.reshard_after_forward": False,
        "trainer.policy.fsdp_config.mixed_precision.param_dtype": "bfloat16",
        "trainer.policy.fsdp_config.mixed_precision.reduce_dtype": "fp32",
        "trainer.policy.fsdp_config.fsdp_size": -1,
        "trainer.policy.optimizer_config.offload_after_step": False,
    }
    conversion = convert(str(config), "fsdp", backend, gpus=2)
    endpoint = validated(conversion)
    t = endpoint.trainer
    assert endpoint.full_fine_tune and t.fsdp.cpu_offload and not t.fsdp.reshard_after_forward
    assert t.params_dtype == "bf16" and t.fsdp.reduce_dtype == "fp32" and not t.offload_after_step
    assert endpoint.parallelism.dp == 2
    unmapped = {key for key, _, _ in conversion.unmapped}
    assert unmapped == {"trainer.policy.fsdp_config.fsdp_size"}
    mega = validated(
        convert(
            str(config),
            "megatron",
            {
                "trainer.policy.megatron_config.ddp_config.grad_reduce_in_fp32": False,
                "trainer.policy.megatron_config.optimizer_config_kwargs.optimizer_cpu_offload": True,
            },
            gpus=1,
            lora_rank=0,
        )
    )
    assert mega.full_fine_tune and not mega.trainer.grad_reduce_in_fp32 and mega.trainer.optimizer_offload


def test_advise_searches_the_trainers_memory_levers() -> None:
    from skyrl_sim.commands.advise_space import search_axes

    fsdp = {axis.name for axis in search_axes(variant(FSDP_MIX), ())}
    assert {"FSDP CPU offload", "FSDP reshard after forward"} <= fsdp
    full = variant(SCENARIOS / "tiny_full_mix.yaml")
    assert "optimizer on the host" in {axis.name for axis in search_axes(full, ())}
    colocated = load_scenario(SCENARIOS / "colocated_optimizer_on_gpu.yaml").resolve("on-gpu")
    axes = {axis.name: axis for axis in search_axes(colocated, ())}
    assert axes["optimizer offload after step"].values == (
        {"trainer.offload_after_step": False},
        {"trainer.offload_after_step": True},
    )


def test_the_time_model_prices_fsdps_unit_collectives_and_full_fine_tunings_reduction() -> None:
    from skyrl_sim_plugins.sim.bound.timing import default_time_model
    from skyrl_sim_plugins.sim.reference.time_model import TimeReference

    two = variant(SCENARIOS / "tiny_fsdp_mix_dp2.yaml")
    reference = TimeReference(two.endpoint, two.model)
    assert reference.unit_forward_s > 0 and reference.unit_backward_s > reference.unit_forward_s
    shape = shape_call("forward_backward", [120, 110, 100, 90], two.endpoint, FSDP)
    assert reference.unit_collectives_s(shape) == 1 * (reference.unit_forward_s + reference.unit_backward_s)
    bound = default_time_model().call_cost(shape, two.endpoint, two.model)
    assert bound.comm_s == pytest.approx(reference.call(shape).comm_s)  # the bound model adds the same terms
    one = variant(FSDP_MIX)
    assert TimeReference(one.endpoint, one.model).unit_forward_s == 0.0  # one rank: nothing to gather
    mega = variant(SCENARIOS / "tiny_full_mix.yaml", overrides={"parallelism.dp": 2, "hardware.devices": 2})
    full = TimeReference(mega.endpoint, mega.model)
    assert full.gradient_all_reduce_s > 0 and full.optim_step_comm_s > 0 and full.unit_forward_s == 0.0


def test_a_full_fine_tunes_backward_computes_every_weights_gradient() -> None:
    """Trained base linears (and the output layer) cost their weight's gradient GEMM in backward beside the input's:
    a full fine-tune's backward has twice LoRA-off frozen linears' GEMM FLOPs; its forward the same."""
    from skyrl_sim_plugins.sim.description.layer_ops import Work
    from skyrl_sim_plugins.sim.reference.time_model import TimeReference

    full = variant(SCENARIOS / "tiny_full_mix.yaml")
    frozen = variant(SCENARIOS / "tiny_full_mix.yaml", overrides={"trainer.train_base_weights": False, "lora.targets": []})
    work = Work(tokens=4 * 121.0, pairs=4 * 121.0**2 / 2)

    def gemm_flops(kind: str, backward: bool) -> float:
        reference = TimeReference(kind.endpoint, kind.model)
        ops, _ = reference.layers_direct(work, backward)
        return sum(op.flops * count for op, count in ops if op.unit == "matmul")

    assert gemm_flops(full, False) == pytest.approx(gemm_flops(frozen, False))
    recompute = gemm_flops(full, False)  # full recompute: every layer's forward again in backward
    assert gemm_flops(full, True) - 2 * recompute == pytest.approx(2 * (gemm_flops(frozen, True) - 2 * recompute))
