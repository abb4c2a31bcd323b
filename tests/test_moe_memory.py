"""MoE in the allocation walk: the routed-expert replay (R3) held per micro-batch, and MoE layer tensors.

The scenario is scenarios/moe_r3.yaml on Qwen3.6-35B-A3B (40 layers, all MoE, 256 experts, top 8) with TP 2, PP 2,
DP 2, micro 2 and THD packing; the walked stage owns 20 MoE layers and expert ids fit uint8. The layer-level checks
use the tiny-moe preset (hidden 128, 8 experts, top 2, expert FFN 64) on one rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.architecture import PRESETS
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.sim.bound.memory import AllocationWalk
from skyrl_sim_plugins.sim.description.moe_routes import moe_layer_dims, moe_layer_terms
from skyrl_sim_plugins.sim.reference.allocator import round_allocated
from skyrl_sim_plugins.sim.reference.device_memory import endpoint_allocator
from skyrl_sim_plugins.sim.reference.memory_ops import Dims, layer_graph
from skyrl_sim_plugins.sim.reference.segments import build_segments, replay_segments

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "moe_r3.yaml"
ALL_LAYERS, STAGE_LAYERS, TOPK = 40, 20, 8
# The two forward_backward calls of moe_r3 (the first and the second -> slots of the busiest DP rank's micro-batch,
# by hand):
# first: four rows of 4,095 + 1 tokens, DP 2 x micro 2, so each rank packs two rows: 2 x 4,096 = 8,192 slots.
# second: rows of 8,192 and 6,144 padded to 4 rows (pad rows copy row 0): rank 0 packs 14,336, rank 1 2 x 8,192.
# (the weight sync and the rollouts before them are not passes: the rollouts run on vLLM, continuous sampling)
PEAK_SLOTS = {0: 8192, 1: 16384}


def compact_bytes(slots: int) -> int:
    return slots * STAGE_LAYERS * TOPK * 4  # the stage's own MoE layers, sliced before the one int32 conversion


def int32_bytes(slots: int) -> int:
    return slots * ALL_LAYERS * TOPK * 4  # int32, every MoE layer


@pytest.fixture(scope="module")
def runs() -> dict[str, RunResult]:
    scenario = load_scenario(SCENARIO)
    host = PluginHost()
    return {name: host.run(scenario.resolve(name), "sim") for name in scenario.variant_names}


def passes(result: RunResult) -> dict[int, object]:
    """The run's forward_backward calls by their order among themselves (0: the first)."""
    return dict(enumerate(c for c in result.calls if c.kind == "forward_backward"))


def test_compact_peak_is_lower_by_exactly_the_replay_difference(runs: dict[str, RunResult]) -> None:
    compact, expanded = passes(runs["compact"]), passes(runs["int32-all-layers"])
    assert set(compact) == set(expanded) == set(PEAK_SLOTS)
    for index, slots in PEAK_SLOTS.items():
        by_hand = round_allocated(int32_bytes(slots)) - round_allocated(compact_bytes(slots))
        assert expanded[index].peak_bytes - compact[index].peak_bytes == by_hand  # type: ignore[attr-defined]
        assert by_hand == slots * TOPK * 4 * (ALL_LAYERS - STAGE_LAYERS)


def test_breakdown_names_the_replay_term(runs: dict[str, RunResult]) -> None:
    for variant, ids in (("compact", compact_bytes), ("int32-all-layers", int32_bytes)):
        for index, call in passes(runs[variant]).items():
            slots = PEAK_SLOTS[index]
            breakdown = call.memory["breakdown"]  # type: ignore[attr-defined]
            # the ids plus a one-byte padding mask per slot, held while the peak is reached
            assert breakdown["routed_expert_replay"] == round_allocated(ids(slots)) + round_allocated(slots)
    off = passes(runs["off"])
    compact = passes(runs["compact"])
    for index, call in off.items():
        assert "routed_expert_replay" not in call.memory["breakdown"]  # type: ignore[attr-defined]
        held = round_allocated(compact_bytes(PEAK_SLOTS[index])) + round_allocated(PEAK_SLOTS[index])
        assert compact[index].peak_bytes - call.peak_bytes == held  # type: ignore[attr-defined]


def test_replay_is_held_from_first_forward_to_last_backward(runs: dict[str, RunResult]) -> None:
    call = passes(runs["compact"])[1]
    timeline = call.memory["timeline"]  # type: ignore[attr-defined]
    # megatron's global buffer grows first (the all-gather dispatcher's gathered tokens, TP 2 x EP 2), then the replay
    assert timeline[0]["layer"] == "global_memory_buffer" and timeline[0]["op"] == "mlp.dispatch.gather_tokens"
    assert timeline[1]["layer"] == timeline[-1]["layer"] == "routed_expert_replay"
    assert (timeline[1]["phase"], timeline[-1]["phase"]) == ("forward", "backward")
    held = round_allocated(compact_bytes(16384)) + round_allocated(16384)
    assert timeline[-2]["allocated"] - timeline[-1]["allocated"] == held  # the release frees exactly what was held


def tiny_moe_endpoint(layout: str = "compact", **trainer: object) -> Endpoint:
    return Endpoint.model_validate(
        {
            "model": "tiny-moe",
            "hardware": {"profile": "cpu", "device_memory_gib": 24, "reserve_gib": 0, "devices": 1},
            "parallelism": {"tp": 1, "sequence_parallel": False},
            "trainer": {
                "recompute": {"granularity": "none"},
                "params_dtype": "fp32",
                "routed_expert_replay": layout,
                # the real backend's stack: megatron-core's local spec (SequentialMLP experts), unfused SwiGLU
                "layer_spec": "local",
                "bias_activation_fusion": False,
                **trainer,
            },
        }
    )


def test_replay_setup_slices_then_converts_once_and_holds_the_int32_ids() -> None:
    """tiny-moe: 2 MoE layers, top 2, 8 experts (uint8 on the wire). The routes arrive compact, are sliced to the
    stage's layers, laid out and reordered (each copy dying as the next is made), converted to int32 once; the ids and
    a one-byte padding mask per slot stay. One stage owns every layer, so compact and int32-all-layers are equal."""
    slots = 1000
    wire = slots * 2 * 2  # one uint8 copy of every layer's ids
    ids = 4 * wire  # their int32 conversion
    exact = endpoint_allocator(tiny_moe_endpoint()).allocated  # a cpu profile: each tensor its exact bytes
    for layout in ("compact", "int32-all-layers"):
        setup, release = replay_segments(slots, tiny_moe_endpoint(layout), PRESETS["tiny-moe"])  # type: ignore[misc]
        assert setup.array.peak_allocated == exact(wire) + exact(ids)  # the last uint8 copy and its conversion
        assert setup.array.end_allocated == exact(ids) + exact(slots)
        # without recompute megatron's backward FIFO keeps the ids until the schedule ends: only the mask goes
        assert release.array.end_allocated == -exact(slots)
    full = tiny_moe_endpoint(recompute={"granularity": "full", "method": "uniform", "num_layers": 1})
    setup, release = replay_segments(slots, full, PRESETS["tiny-moe"])  # type: ignore[misc]
    assert release.array.end_allocated == -setup.array.end_allocated  # the recompute pops them: freed per micro-batch
    assert replay_segments(slots, tiny_moe_endpoint("off"), PRESETS["tiny-moe"]) is None
    assert replay_segments(slots, tiny_moe_endpoint("compact"), PRESETS["tiny-dense"]) is None


def test_without_recompute_each_micro_batch_finds_the_earlier_ids_held() -> None:
    """Two equal micro-batches of one call: without recompute the second one's peak holds both micro-batches' ids
    (and its own mask); with full recompute only its own."""
    model = PRESETS["tiny-moe"]
    walk = AllocationWalk()
    slots = 64
    ids = slots * 2 * 2 * 4  # a cpu profile: each tensor its exact bytes
    for recompute, held in (({"granularity": "none"}, 2 * ids), ({"granularity": "full", "method": "uniform"}, ids)):
        endpoint = tiny_moe_endpoint(recompute=recompute, micro_train_batch_size_per_gpu=1)
        shape = shape_call("forward_backward", [slots - 1] * 2, endpoint, MEGATRON)
        assert [mb.slots for mb in shape.microbatches] == [slots, slots]
        report = walk.walk(shape, endpoint, model)
        assert report.breakdown["routed_expert_replay"] == held + slots, recompute


def test_moe_layer_tensors_are_sized_by_the_terms() -> None:
    """Each MoE tensor of the layer graph has exactly the bytes moe_layer_terms gives it, and those by hand."""
    model = PRESETS["tiny-moe"]
    endpoint = tiny_moe_endpoint("off", moe_routing={"spread": "even"})  # balanced: 25 pairs per expert
    rows, seq = 2, 50
    tokens = rows * seq
    d = Dims.of(endpoint, model, rows, seq, 0)
    terms = moe_layer_terms(tokens, endpoint, model)
    g = layer_graph(d, model, "full_attention", True, moe_layer_dims(tokens, endpoint, model))
    named = {
        "router_logits": ["mlp.router.logits"],
        "topk_values": ["mlp.router.topk_values"],
        "topk_indices": ["mlp.router.topk_indices"],
        "router_probs": ["mlp.router.probs"],
        "routing_probs": ["mlp.router.routing_probs"],
        "routing_map": ["mlp.router.routing_map"],
        "sorted_indices": ["mlp.dispatch.sorted_indices"],
        "dispatched_tokens": ["mlp.dispatch.permute"],
        "permuted_probs": ["mlp.dispatch.permuted_probs"],
        # SequentialMLP: one tensor per local expert, together the pairs
        "expert_fc1_out": [f"mlp.experts.local_experts.{e}.linear_fc1.lora_add" for e in range(8)],
        "expert_act_out": [f"mlp.experts.local_experts.{e}.swiglu_mul" for e in range(8)],
        "expert_scaled_out": [f"mlp.experts.local_experts.{e}.probs_scale" for e in range(8)],
        "expert_fc2_out": [f"mlp.experts.local_experts.{e}.linear_fc2.lora_add" for e in range(8)],
        "unpermuted": ["mlp.dispatch.unpermute"],
    }
    assert set(terms) == set(named)  # tiny-moe has no shared expert
    for term, tensors in named.items():
        assert sum(g.tensors[t].nbytes for t in tensors) == terms[term], term
    # fp32 activations, hidden 128, 8 experts, top 2, expert FFN 64: 200 pairs, 25 per expert under balanced routing
    assert g.tensors["mlp.router.logits"].nbytes == tokens * 8 * 4
    assert g.tensors["mlp.dispatch.permute"].nbytes == tokens * 2 * 128 * 4
    assert g.tensors["mlp.experts.local_experts.3.linear_fc1.base"].shape == (25, 1, 128)
    assert g.tensors["mlp.router.topk_indices"].requires_grad is False
    # What the layer keeps for backward: the routing (ids, top-k softmax), the permutation and the permuted tokens
    # (fc1's LoRA-A input), the transposed probabilities the permuted ones were masked from, each expert's SwiGLU
    # tensors and the activation the probabilities scaled (fc2's LoRA-A input)
    saved = set(g.saved_storages(grad=True, selective=False))
    assert {
        "mlp.router.probs",
        "mlp.router.topk_indices",
        "mlp.dispatch.sorted_indices",
        "mlp.dispatch.permute",
        "mlp.dispatch.probs_t",
        "mlp.experts.local_experts.0.swiglu_mul",
        "mlp.experts.local_experts.7.probs_scale",
    } <= saved
    assert "mlp.experts.local_experts.0.linear_fc2.lora_add" not in saved  # the concatenation keeps no input
    replayed = layer_graph(d, model, "full_attention", True, moe_layer_dims(tokens, tiny_moe_endpoint(), model))
    assert "mlp.router.topk_indices" not in replayed.tensors and "mlp.router.replay_gather" in replayed.tensors


def test_shared_expert_and_sequence_parallel_terms() -> None:
    """Qwen3.6-35B-A3B at TP 2 with SP: the router on the shard, the shared expert over the gathered sequence, the
    experts as TransformerEngine's grouped GEMM (one group of every pair)."""
    model = PRESETS["qwen3.6-35b-a3b"]
    endpoint = load_scenario(SCENARIO).resolve("compact").endpoint
    d = Dims.of(endpoint, model, 1, 4096, 0)
    terms = moe_layer_terms(4096, endpoint, model)
    g = layer_graph(d, model, "full_attention", True, moe_layer_dims(4096, endpoint, model))
    assert g.tensors["mlp.router.logits"].shape == (2048, 256)
    assert g.tensors["mlp.shared_experts.linear_fc1.base"].nbytes == terms["shared_fc1_out"] == 4096 * 512 * 2
    assert g.tensors["mlp.shared_experts.swiglu"].nbytes == terms["shared_act_out"] == 4096 * 256 * 2
    assert g.tensors["mlp.dispatch.gather_tokens"].shape == (8192, 2048)  # the TP x EP group's shards, all-gathered
    assert g.tensors["mlp.dispatch.permute"].shape == (4096 * 8, 1, 2048)  # EP 2: half the experts, half the pairs
    assert g.tensors["mlp.dispatch.reduce_scatter"].shape == (2048, 2048)
    with pytest.raises(ValueError, match="moe_dims"):
        layer_graph(d, model, "full_attention", True)


@pytest.mark.parametrize("granularity", ["none", "full"])
def test_moe_tensors_in_forward_recompute_and_backward(granularity: str) -> None:
    model = PRESETS["tiny-moe"]
    endpoint = tiny_moe_endpoint(recompute={"granularity": granularity})
    d = Dims.of(endpoint, model, 2, 50, 0)
    arrays = build_segments(d, model, endpoint, {("full_attention", True)})
    forward = arrays.forward[("full_attention", True)]
    backward = arrays.backward[("full_attention", True)]
    ops = [s.op for s in forward.array.steps]
    assert "mlp.router.logits" in ops and "mlp.dispatch.permute" in ops
    recompute = [s.op for s in backward.array.steps[: backward.recompute_steps]]
    assert ("mlp.dispatch.permute" in recompute) == (granularity == "full")
    grads = {s.op for s in backward.array.steps[backward.recompute_steps :]}
    assert {"mlp.dispatch.unpermute.backward", "mlp.dispatch.permute.backward", "mlp.router.probs.backward"} <= grads
    # Without recompute the forward keeps the routing and the token copies; a fully recomputed one keeps its output.
    output = round_allocated(2 * 50 * 128 * 4)
    if granularity == "full":
        assert forward.array.end_allocated == output
    else:
        assert forward.array.end_allocated > output + round_allocated(2 * 50 * 2 * 128 * 4)


def test_peak_grows_with_micro_batch_tokens_and_one_stage_holds_every_layer() -> None:
    """One micro-batch of 4 rows (BSHD: 4 x width slots) on tiny-moe: with one stage compact keeps every MoE layer, so
    both layouts hold the same int32 ids at every size, and the peak grows with the tokens."""
    model = PRESETS["tiny-moe"]
    walk = AllocationWalk()
    previous = 0
    for width in (64, 256, 1024):
        peaks = {}
        for layout in ("compact", "int32-all-layers"):
            endpoint = tiny_moe_endpoint(layout, micro_train_batch_size_per_gpu=4)
            shape = shape_call("forward_backward", [width - 1] * 4, endpoint, MEGATRON)
            assert [mb.slots for mb in shape.microbatches] == [4 * width]
            peaks[layout] = walk.evaluate(shape, endpoint, model).peak_bytes
        assert peaks["int32-all-layers"] == peaks["compact"] > previous
        previous = peaks["compact"]


def test_expert_parallel_ranks_hold_their_own_experts_and_their_adapters_optimizer_state() -> None:
    """tiny-moe on DP 2: with EP 2 a rank holds 4 of the 8 experts' weights (and their adapters), and an expert's
    Adam moments are sharded over its DP / EP = 1 replicas, the other adapters' over DP = 2."""
    from skyrl_sim_plugins.sim.description.trainers import lora_params_per_rank, static_bytes

    model = PRESETS["tiny-moe"]
    whole, split = (tiny_moe_endpoint().model_copy(deep=True) for _ in range(2))
    for endpoint, ep in ((whole, 1), (split, 2)):
        endpoint.parallelism.dp, endpoint.parallelism.ep = 2, ep
    expert = 3 * 128 * 64  # one expert's fc1 (gate and up) and fc2
    assert static_bytes(model, whole)["weights"] - static_bytes(model, split)["weights"] == 2 * 4 * expert * 4
    layers = [0, 1]
    dense = lora_params_per_rank(model, split, layers, experts=False)
    routed = lora_params_per_rank(model, split, layers, experts=True)
    assert dense == 2 * (8 * (128 + 256) + 8 * (128 + 128))  # qkv and proj A + B per layer
    assert routed == 2 * 4 * (8 * (128 + 128) + 8 * (64 + 128))  # 4 local experts' fc1 and fc2 A + B per layer
    # fp32 adapters: parameter + main gradient (8 bytes), two Adam moments (8 bytes) sharded over the replicas
    assert static_bytes(model, split)["adapters"] == dense * (8 + 4) + routed * (8 + 8)


def test_the_shared_experts_adapters_are_counted_once_per_rank() -> None:
    """SkyRL's Megatron-Bridge LoRA wraps a shared expert's ``linear_fc1`` / ``linear_fc2`` as it wraps a dense MLP's
    (by name; SkyRL 0.4.0 patches their TP reduce, Megatron-Bridge PR #6089), and the real backend does the same: a
    64-wide shared expert on tiny-moe's two MoE layers adds rank 8 x ((128 + 128) + (64 + 128)) adapter parameters
    per layer, on every expert-parallel rank alike (it is no routed expert). The real backend's meter moves by those
    7,168 fp32 parameters x 16 bytes (weight, gradient, two Adam moments) in every call
    (``tests/real/test_moe_backend.py``)."""
    from dataclasses import replace

    from skyrl_sim_plugins.sim.description.trainers import lora_params_per_rank

    base = PRESETS["tiny-moe"]
    assert base.moe is not None
    shared = replace(base, moe=replace(base.moe, shared_expert_ffn_hidden_size=64))
    for ep in (1, 2):
        endpoint = tiny_moe_endpoint()
        if ep == 2:
            endpoint = load_scenario(ROOT / "scenarios" / "moe_r3_tiny_ep2.yaml").resolve("compact").endpoint
        added = lora_params_per_rank(shared, endpoint, [0, 1]) - lora_params_per_rank(base, endpoint, [0, 1])
        assert added == 2 * 8 * ((128 + 128) + (64 + 128))
        assert lora_params_per_rank(shared, endpoint, [0, 1], experts=True) == lora_params_per_rank(
            base, endpoint, [0, 1], experts=True
        )
