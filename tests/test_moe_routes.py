"""MoE accounting: R3 route bytes per training call and wire bytes per sample, checked against hand computation.

The scenario is scenarios/moe_r3.yaml on Qwen3.6-35B-A3B (40 layers, all MoE, 256 experts, top 8) with TP 2, PP 2,
DP 2, micro 2 and THD packing: each PP stage owns 20 MoE layers, expert ids fit uint8.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from rich.console import Console

from skyrl_sim.engine.pipeline import pipeline_stages, stage_layers
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.reports.report import moe_line, moe_sample_line, print_run
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.architecture import PRESETS, from_hf_config
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.sim.description import moe_routes

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "moe_r3.yaml"

# Hand computation, written out once.
LAYERS, STAGE_LAYERS, TOPK = 40, 20, 8
FRAMING = len('{"data":"') + len('","shape":[') + len('],"dtype":"') + len("uint8") + len('"}')  # 38 + the shape digits


def b64(nbytes: int) -> int:
    return 4 * ((nbytes + 2) // 3)


def wire(tokens: int) -> int:
    """One sequence's routed experts as {data, shape, dtype}: uint8 ids, base64, orjson framing."""
    return FRAMING + len(f"{tokens},{LAYERS},{TOPK}") + b64(tokens * LAYERS * TOPK)


def json_lists(tokens: int) -> int:
    """Ids 0..255 spread uniformly (10 of one digit, 90 of two, 156 of three per 256); a comma between siblings at
    every level; a bracket pair per list."""
    ids = tokens * LAYERS * TOPK
    digits = ids * (10 * 1 + 90 * 2 + 156 * 3) // 256
    commas = tokens * LAYERS * (TOPK - 1) + tokens * (LAYERS - 1) + (tokens - 1)
    brackets = 2 * (1 + tokens + tokens * LAYERS)
    return digits + commas + brackets


@pytest.fixture(scope="module")
def runs() -> dict[str, RunResult]:
    scenario = load_scenario(SCENARIO)
    host = PluginHost()
    return {name: host.run(scenario.resolve(name), "sim") for name in scenario.variant_names}


def sample_moe(result: RunResult) -> list[dict]:
    """Each sample request's routed-expert bytes (continuous sampling: in the request's outputs)."""
    return [r.outputs["moe"] for r in result.requests if r.type == "sample" and "moe" in r.outputs]


def test_per_sample_wire_bytes_compact_vs_json(runs: dict[str, RunResult]) -> None:
    samples = sample_moe(runs["compact"])
    assert len(samples) == 4
    tokens = 1024 + 3072
    for moe in samples:
        assert moe["dtype"] == "uint8"
        assert moe["wire_bytes"] == 47 + b64(4096 * 40 * 8) == 1_747_675
        assert moe["wire_bytes"] == wire(tokens)
        assert moe["json_list_bytes"] == 3_368_960 + 1_310_719 + 335_874 == json_lists(tokens)
    # the int32-all-layers switch changes the trainer's layout, not what vLLM ships
    assert [moe["wire_bytes"] for moe in sample_moe(runs["int32-all-layers"])] == [1_747_675] * 4
    # with replay off vLLM is not asked for routes
    assert sample_moe(runs["off"]) == []
    assert all(r.status == "completed" for r in runs["off"].requests)


def test_per_call_route_bytes_compact_vs_int32_all_layers(runs: dict[str, RunResult]) -> None:
    compact = [c for c in runs["compact"].calls if c.kind == "forward_backward"]
    expanded = [c for c in runs["int32-all-layers"].calls if c.kind == "forward_backward"]
    assert [c.padded_rows for c in compact] == [4, 4]
    # Call 1: four rows of 4,096; DP 2 x micro 2 -> each rank one micro-batch of 2 rows packed = 8,192 slots.
    # Call 2: rows 8,192 and 6,144 padded to 4 with copies of row 0: rank 1 holds 2 x 8,192 = 16,384 slots.
    for call_c, call_e, slots, rows in (
        (compact[0], expanded[0], 8192, [4096] * 4),
        (compact[1], expanded[1], 16384, [8192, 6144]),
    ):
        rc, re_ = call_c.extra["moe"]["routes"], call_e.extra["moe"]["routes"]
        assert call_c.extra["moe"]["stage_moe_layers"] == STAGE_LAYERS
        # both hold int32 ids (megatron's replay takes them so); compact slices the stage's own layers first
        assert rc["replay_mb_bytes"] == slots * STAGE_LAYERS * TOPK * 4
        assert re_["replay_mb_bytes"] == slots * LAYERS * TOPK * 4
        assert rc["padding_mask_mb_bytes"] == re_["padding_mask_mb_bytes"] == slots
        assert rc["replay_mb_peak_bytes"] == slots * STAGE_LAYERS * TOPK * 4 + slots
        assert re_["replay_mb_bytes"] == 2 * rc["replay_mb_bytes"]  # 2x the layers
        # both layouts report both sizes, so a user sees the saving from either run
        assert rc["replay_mb_int32_all_layers_bytes"] == re_["replay_mb_bytes"]
        assert rc["host_wire_bytes"] == re_["host_wire_bytes"] == sum(wire(t) for t in rows)
        assert rc["host_json_list_bytes"] == sum(json_lists(t) for t in rows)
    assert compact[0].extra["moe"]["routes"]["replay_mb_bytes"] == 5_242_880
    assert expanded[0].extra["moe"]["routes"]["replay_mb_bytes"] == 10_485_760
    assert compact[1].extra["moe"]["routes"]["host_wire_bytes"] == (47 + 3_495_256) + (47 + 2_621_440)
    off = [c for c in runs["off"].calls if c.kind == "forward_backward"][0].extra["moe"]["routes"]
    assert off["replay_mb_peak_bytes"] == off["host_wire_bytes"] == 0
    assert off["replay_mb_compact_bytes"] == 5_242_880


def test_moe_numbers_reach_the_result_json_and_the_table(runs: dict[str, RunResult]) -> None:
    data = orjson.loads(runs["compact"].to_json())
    fb = [c for c in data["calls"] if c["kind"] == "forward_backward"][0]
    assert fb["extra"]["moe"]["routes"]["replay_mb_bytes"] == 5_242_880
    back = RunResult.from_dict(data)
    line = moe_line(next(c for c in back.calls if c.kind == "forward_backward"))
    assert line is not None and "compact" in line and "int32-all-layers 10.00 MiB (2.0x)" in line
    first = next(r for r in back.requests if r.type == "sample")
    sample_line = moe_sample_line(first.id, first.outputs["moe"])
    assert "JSON lists" in sample_line and sample_line.startswith(f"sample #{first.id}: 1 samples")
    assert moe_line(next(c for c in back.calls if c.kind == "optim_step")) is None
    assert back.inference["routed_experts"] is True


def test_layer_terms_by_hand() -> None:
    scenario = load_scenario(SCENARIO)
    variant = scenario.resolve("compact")
    terms = moe_routes.moe_layer_terms(8192, variant.endpoint, variant.model)
    local = 8192 // 2  # sequence-parallel shard of TP 2
    pairs = 8192 * 8
    assert terms["router_logits"] == terms["routing_probs"] == local * 256 * 4
    assert terms["router_probs"] == terms["topk_values"] == local * 8 * 4  # the softmax runs over the top k
    assert terms["topk_indices"] == 0  # replayed: the router gathers the held ids, topk makes none
    assert terms["routing_map"] == local * 256
    assert terms["sorted_indices"] == pairs * 8 and terms["permuted_probs"] == pairs * 4
    assert terms["dispatched_tokens"] == terms["expert_fc2_out"] == pairs * 2048 * 2
    assert terms["expert_fc1_out"] == pairs * 2 * (512 // 2) * 2
    assert terms["shared_act_out"] == 8192 * (512 // 2) * 2


def test_stage_slicing_and_dense_models() -> None:
    assert [len(r) for r in pipeline_stages(40, 3)] == [14, 13, 13]
    with pytest.raises(ValueError, match="exceeds"):
        pipeline_stages(2, 4)
    scenario = load_scenario(SCENARIO)
    variant = scenario.resolve("compact")
    shape = shape_call("forward_backward", [100], variant.endpoint, MEGATRON)
    assert moe_routes.moe_call_extra(shape, variant.endpoint, PRESETS["qwen3-8b"]) is None
    # a model whose odd layers only are MoE: stage 0 of 2 owns layers 0..19, ten of them MoE
    sparse = from_hf_config(
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 40,
            "vocab_size": 100,
            "intermediate_size": 128,
            "num_experts": 300,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 2,
        },
        name="sparse",
    )
    assert moe_routes.moe_layer_count(sparse) == 20
    assert moe_routes.stage_moe_layers(sparse, 2) == 10
    assert moe_routes.compact_dtype(sparse) == "int16"  # 300 experts: ids up to 299


def test_hf_reader_qwen3_5_moe_config() -> None:
    """A Qwen3.5/3.6-MoE style config (text_config with layer_types and a shared expert) reads as the preset does."""
    text = {
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "num_hidden_layers": 40,
        "vocab_size": 248320,
        "attn_output_gate": True,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",  # the family's configs keep the recurrent state in fp32 (vLLM reads it)
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "model_type": "qwen3_5_moe_text",  # its MoE block gates the shared expert (shared_expert_gate)
    }
    config = {"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": False}
    arch = from_hf_config(config, name="qwen3.6-35b-a3b")
    preset = PRESETS["qwen3.6-35b-a3b"]
    assert arch.moe == preset.moe
    assert arch.layer_types == preset.layer_types
    assert arch.linear_attention == preset.linear_attention
    assert (arch.hidden_size, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (2048, 2, 256, 248320)


def test_run_table_shows_the_r3_lines(runs: dict[str, RunResult]) -> None:
    console = Console(width=250, record=True, color_system=None)
    print_run(console, runs["compact"])
    text = console.export_text()
    assert "routed-expert replay (R3)" in text
    assert "compact 5.00 MiB vs int32-all-layers 10.00 MiB (2.0x)" in text
    plain = Console(width=250, record=True, color_system=None)
    print_run(plain, runs["off"])
    assert "trainer receives" not in plain.export_text()


@pytest.mark.real
def test_megatron_moe_probe_replays_routes() -> None:
    """The real part: megatron-core trains a tiny MoE on CPU and replays routes decoded from the R3 wire format."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "probe_moe_megatron.py")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "routers used exactly the recorded ids: True" in out.stdout
    assert "PROBE OK" in out.stdout


def test_tiny_cpu_twin_by_hand() -> None:
    """The same workload on the tiny CPU MoE endpoint: 2 layers, 8 experts, top 2, one stage, BSHD micro 4."""
    scenario = load_scenario(SCENARIO, endpoint="tiny-moe-cpu")
    host = PluginHost()
    compact = host.run(scenario.resolve("compact"), "sim")
    expanded = host.run(scenario.resolve("int32-all-layers"), "sim")
    fb_c = next(c for c in compact.calls if c.kind == "forward_backward").extra["moe"]["routes"]
    fb_e = next(c for c in expanded.calls if c.kind == "forward_backward").extra["moe"]["routes"]
    slots = 4 * 4096  # four rows of 4,096 in one BSHD micro-batch of 4
    # one stage: compact keeps every layer, so both hold the same int32 ids
    assert fb_c["replay_mb_bytes"] == fb_e["replay_mb_bytes"] == slots * 2 * 2 * 4 == 262_144
    sample = sample_moe(compact)[0]
    ids = 4096 * 2 * 2
    assert sample["wire_bytes"] == len('{"data":"","shape":[4096,2,2],"dtype":"uint8"}') + 4 * ((ids + 2) // 3)
    # ids 0..7 are one digit each
    assert sample["json_list_bytes"] == ids + (4096 * 2 * 1 + 4096 * 1 + 4095) + 2 * (1 + 4096 + 4096 * 2)


def test_the_walk_and_the_replay_share_one_pipeline_split() -> None:
    """The memory walk follows the last stage of the same split the replay sizes its stages from (uneven: the first
    stages hold one more layer, so the last stage of 40 layers over 3 is layers 27..39)."""
    model = PRESETS["qwen3.6-35b-a3b"]
    endpoint = load_scenario(SCENARIO).resolve("compact").endpoint
    endpoint.parallelism.pp = 3
    assert model.num_layers == 40
    assert stage_layers(model, endpoint) == list(range(27, 40))
    assert stage_layers(model, endpoint) == list(pipeline_stages(40, 3)[-1])
