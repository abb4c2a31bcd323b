"""The allocation walk: hand-computed tensor sizes, Megatron's activation formula, properties, and the seed verdicts."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_sim.cli import main
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.architecture import PRESETS, ModelArch
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.endpoint_files import load_endpoint
from skyrl_sim.units import GIB, format_size
from skyrl_sim_plugins.sim.bound.memory import AllocationWalk
from skyrl_sim_plugins.sim.description.trainers import lora_params_per_rank, static_bytes
from skyrl_sim_plugins.sim.reference.allocator import CPU_EXACT, CUDA_CACHING, round_allocated, round_reserved
from skyrl_sim_plugins.sim.reference.memory_ops import Dims, layer_graph
from skyrl_sim_plugins.sim.reference.segments import build_segments

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "queue_drain_17.yaml"

# The n=16 call of the 17-request drain: the 16 requests after the warm-up one.
N16 = [5363, 4319, 3097, 3940, 3494, 3659, 3967, 35000, 5271, 3861, 4449, 3660, 4075, 4969, 5111, 4011]


def endpoint(name: str, **trainer: object) -> Endpoint:
    data, _ = load_endpoint(name, SCENARIO)
    data = dict(data)
    data["trainer"] = {**data["trainer"], **trainer}
    return Endpoint.model_validate(data)


def tiny_endpoint(**trainer: object) -> Endpoint:
    return Endpoint.model_validate(
        {
            "model": "tiny-dense",
            "hardware": {"profile": "cpu", "device_memory_gib": 4, "reserve_gib": 0, "devices": 1},
            "parallelism": {"tp": 1, "sequence_parallel": False},
            "trainer": {"recompute": {"granularity": "none"}, **trainer},
        }
    )


def test_every_tensor_of_one_layer_of_a_tiny_model() -> None:
    """tiny-dense (h 128, ffn 352, 4 heads x 32, 2 KV heads), b=2, s=16, TP 1, bf16, LoRA rank 8 on all four."""
    # with Qwen3's q/k norms (the preset, like the real backend's model, has none), so they are checked too
    model = ModelArch(**{**PRESETS["tiny-dense"].__dict__, "extra": {"qk_layernorm": True}})
    d = Dims.of(tiny_endpoint(), model, rows=2, seq=16, logits_width=0)
    g = layer_graph(d, model, "full_attention", moe=False)
    s, b, h, r = 16, 2, 128, 8
    qkv = 4 * 32 + 2 * 2 * 32
    expected = {
        "self_attention.norm": (s, b, h),
        "self_attention.linear_qkv.base": (s, b, qkv),
        "self_attention.linear_qkv.lora_a": (s, b, r),
        "self_attention.linear_qkv.lora_b": (s, b, qkv),
        "self_attention.linear_qkv.lora_scale": (s, b, qkv),
        "self_attention.linear_qkv.lora_add": (s, b, qkv),
        "self_attention.q_layernorm": (s, b, 128),
        "self_attention.k_layernorm": (s, b, 64),
        "self_attention.rotary_q": (s, b, 128),
        "self_attention.rotary_k": (s, b, 64),
        "self_attention.core_attention.flash": (s, b, 128),
        "self_attention.linear_proj.base": (s, b, h),
        "self_attention.linear_proj.lora_a": (s, b, r),
        "self_attention.linear_proj.lora_b": (s, b, h),
        "self_attention.linear_proj.lora_scale": (s, b, h),
        "self_attention.linear_proj.lora_add": (s, b, h),
        "self_attention.residual_add": (s, b, h),
        "mlp.norm": (s, b, h),
        "mlp.linear_fc1.base": (s, b, 2 * 352),
        "mlp.linear_fc1.lora_a": (s, b, r),
        "mlp.linear_fc1.lora_b": (s, b, 2 * 352),
        "mlp.linear_fc1.lora_scale": (s, b, 2 * 352),
        "mlp.linear_fc1.lora_add": (s, b, 2 * 352),
        "mlp.swiglu": (s, b, 352),
        "mlp.linear_fc2.base": (s, b, h),
        "mlp.linear_fc2.lora_a": (s, b, r),
        "mlp.linear_fc2.lora_b": (s, b, h),
        "mlp.linear_fc2.lora_scale": (s, b, h),
        "mlp.linear_fc2.lora_add": (s, b, h),
        "mlp.residual_add": (s, b, h),
    }
    got = {op.out: g.tensors[op.out].shape for op in g.ops}
    assert got == expected
    for key, shape in expected.items():
        assert g.tensors[key].nbytes == math.prod(shape) * 2
    # With grad (no recompute, frozen base): what each op keeps for backward, by hand.
    saved = set(g.saved_storages(grad=True, selective=False))
    assert saved == {
        "in",  # the input norm's input
        "self_attention.norm",  # LoRA-A of qkv
        "self_attention.linear_qkv.lora_a",  # LoRA-B of qkv
        "self_attention.linear_qkv.lora_add",  # q/k/v views: q/k norms and flash attention
        "self_attention.rotary_q",
        "self_attention.rotary_k",
        "self_attention.core_attention.flash",  # its output (with the softmax statistics)
        "self_attention.linear_proj.lora_a",
        "self_attention.residual_add",  # the MLP norm's input
        "mlp.norm",
        "mlp.linear_fc1.lora_a",
        "mlp.linear_fc1.lora_add",  # the fused SwiGLU's input
        "mlp.swiglu",  # LoRA-A of fc2
        "mlp.linear_fc2.lora_a",
    }
    steps = g.forward_steps(grad=True, keep=("mlp.residual_add",))
    kept = sum(x.nbytes for x in steps)
    by_hand = sum(round_allocated(g.tensors[k].nbytes) for k in saved - {"in"}) + round_allocated(s * b * h * 2)
    assert kept == by_hand


def test_matches_korthikanti_activation_formula() -> None:
    """Full fine-tuning, no recompute, no SP, TP 1, 16-bit, MHA, no rotary, local spec, SwiGLU with ffn = 8h/3.

    Korthikanti et al. give s*b*h*(34 + 5*a*s/h) bytes per layer; 2*s*b*h of it are the two dropout masks and
    3*a*s^2*b the attention dropout's mask and output. Megatron runs these models without dropout, so the comparable
    formula is s*b*h*(32 + 2*a*s/h). SwiGLU with ffn = 8h/3 keeps 2h + 6*ffn = 18h per token, as GeLU's 4h MLP does.
    """
    h, a, s, b = 192, 6, 512, 2
    model = ModelArch(
        name="korthikanti",
        hidden_size=h,
        ffn_hidden_size=8 * h // 3,
        num_layers=2,
        num_attention_heads=a,
        num_kv_heads=a,
        head_dim=h // a,
        vocab_size=1024,
        extra={"qk_layernorm": False, "position_embedding": "none"},
    )
    ep = Endpoint.model_validate(
        {
            "model": "tiny-dense",
            "hardware": {"devices": 1},
            "parallelism": {"tp": 1, "sequence_parallel": False},
            "lora": {"targets": []},
            "trainer": {"recompute": {"granularity": "none"}, "layer_spec": "local", "train_base_weights": True},
        }
    )
    d = Dims.of(ep, model, rows=b, seq=s, logits_width=0)
    g = layer_graph(d, model, "full_attention", moe=False)
    per_layer = sum(step.nbytes for step in g.forward_steps(grad=True, keep=("mlp.residual_add",)))
    formula = s * b * h * (32 + 2 * a * s / h)
    # megatron-core's unfused softmax in fp32 (no fused kernel, 16-bit activations) keeps the fp32 softmax output
    # (4as^2b) for its backward and the 16-bit copy the context product reads (2as^2b) instead of one 16-bit output
    unfused_fp32_softmax = formula + 4 * a * s * s * b
    # the local spec's norms are torch's composite RMSNorm (no fused kernel): a trained weight's multiply keeps the
    # fp32 normalized input (4sbh) of each of the layer's two norms for the weight's gradient
    torch_rms_norms = 2 * 4 * s * b * h
    assert per_layer == pytest.approx(unfused_fp32_softmax + torch_rms_norms, rel=0.05)
    # The raw formula differs exactly by the dropout terms.
    assert s * b * h * (34 + 5 * a * s / h) - formula == 2 * s * b * h + 3 * a * s * s * b


def test_static_memory_of_the_seed_endpoint() -> None:
    ep = endpoint("qwen3.6-27b-h200-tp4")
    model = PRESETS["qwen3.6-27b"]
    static = static_bytes(model, ep)
    assert static["weights"] / GIB == pytest.approx(26.896e9 * 2 / 4 / GIB, rel=1e-3)  # 12.52 GiB
    vl = static_bytes(model, endpoint("qwen3.6-27b-h200-tp4-vl-defaults"))
    assert vl["weights"] - static["weights"] == pytest.approx(model.vision_params / 4 * 2, abs=4)  # vision tower, TP-sharded
    # LoRA: 16 attention layers (qkv, proj) + 64 MLPs (fc1, fc2), B sharded by TP: about 9.0 M params per rank.
    assert lora_params_per_rank(model, ep, list(range(64))) == pytest.approx(9.0e6, rel=0.01)
    offload = endpoint("qwen3.6-27b-h200-tp4", optimizer_offload=True)
    assert static_bytes(model, offload)["adapters"] < static["adapters"] / 2


def test_allocator_rounding_and_message() -> None:
    assert round_allocated(1) == 512
    assert round_allocated(513) == 1024
    assert round_reserved(3 << 20) == 4 << 20
    assert round_reserved(1000) == 1024
    assert format_size(9.08 * GIB) == "9.08 GiB"


def test_a_cpu_walk_counts_exact_storage_bytes_with_nothing_reserved_beyond_them() -> None:
    """On a cpu profile each tensor is its own exact allocation (no caching allocator): a call fits a capacity of
    exactly its peak, which a CUDA profile of the same call passes (512-byte blocks, 2 MiB pages reserved)."""
    assert CPU_EXACT.allocated(513) == CPU_EXACT.reserved(513) == 513
    assert CUDA_CACHING.allocated(513) == 1024 and CUDA_CACHING.reserved(3 << 20) == 4 << 20
    cpu = endpoint("tiny-cpu-tp1")
    shape = shape_call("forward_backward", [97, 301, 45], cpu, MEGATRON)
    peak = AllocationWalk().evaluate(shape, cpu, PRESETS["tiny-dense"]).peak_bytes
    at_peak = cpu.model_copy(update={"memory_limit_gib": peak / GIB})
    assert at_peak.capacity_bytes == peak
    assert AllocationWalk().evaluate(shape, at_peak, PRESETS["tiny-dense"]).oom is None
    one_less = cpu.model_copy(update={"memory_limit_gib": (peak - 1) / GIB})
    assert AllocationWalk().evaluate(shape, one_less, PRESETS["tiny-dense"]).oom is not None
    hardware = cpu.hardware.model_copy(update={"profile": "h200"})
    cuda = at_peak.model_copy(update={"hardware": hardware})
    assert AllocationWalk().evaluate(shape, cuda, PRESETS["tiny-dense"]).oom is not None


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_the_row_copies_backward_peaks_where_autograd_does(rows: int) -> None:
    """The real backend's re-expansion (one row copied at a time into a zeroed [b, W, V]) and its backward, with a
    49,152-entry vocabulary so the head's tensors dominate. Over what the head backward starts with (the arriving
    gradient, the softmax it was written into), autograd holds the logits' gradient A [b, s, V] plus: one row, its
    CopySlices copy [b, W, V] and the row's clone; two rows, the same for the last row processed (no zeroed
    destination); three rows or more, the larger of a middle row's CopySlices moment (the copy, the clone, the zeroed
    destination) and its accumulation (the select backward's gradient and the new sum, both [b, s, V]). Measured with
    scripts/trace_call_memory.py: 4 x 121 holds 4 [4, 121, 49152] fp32 at its peak, 2 x 201 two and a half."""
    ep = endpoint("tiny-cpu-tp1-vocab49k")
    model = dataclasses.replace(PRESETS["tiny-dense"], hidden_size=256, vocab_size=49152)  # the endpoint's model
    seq, vocab = 121, 49152
    d = Dims.of(ep, model, rows, seq, seq)
    head = build_segments(d, model, ep, {("full_attention", False)}).head_backward.array
    full = rows * seq * vocab * 4  # W = s here: the copy and the logits' gradients are the same size
    row = seq * vocab * 4
    expected = {1: full + row, 2: full + full + row}.get(rows, full + max(full + 2 * row, 2 * full))
    assert head.peak_allocated == pytest.approx(expected, rel=0.01)


def test_a_forward_call_walks_a_forward_only_pass() -> None:
    """A ``forward`` call runs megatron's forward-only schedule under no_grad: no backward, nothing saved, each layer's
    input freed when the layer returns. Its walk has only forward rows, peaks below the same rows' forward_backward,
    and runs out of memory (when it does) in the forward; the fast path and the step-by-step walk agree."""
    ep = endpoint("tiny-cpu-tp1")
    model = PRESETS["tiny-dense"]
    lengths = [300, 250, 280, 120]
    reports = {}
    for kind in ("forward", "forward_backward"):
        shape = shape_call(kind, lengths, ep, MEGATRON)
        fast = AllocationWalk().evaluate(shape, ep, model)
        stepped = AllocationWalk().walk(shape, ep, model)
        assert fast.peak_bytes == stepped.peak_bytes
        reports[kind] = stepped
    forward = reports["forward"]
    assert {row["phase"] for row in forward.resolve_timeline()} == {"forward"}
    assert {row["phase"] for row in reports["forward_backward"].resolve_timeline()} >= {"forward", "backward"}
    assert forward.peak_bytes < reports["forward_backward"].peak_bytes
    tight = ep.model_copy(update={"memory_limit_gib": (forward.peak_bytes - 1) / GIB})
    oom = AllocationWalk().evaluate(shape_call("forward", lengths, tight, MEGATRON), tight, model).oom
    assert oom is not None and oom.where["phase"] == "forward"


def test_a_forward_only_head_frees_the_decoder_output_once_the_final_norm_replaced_it() -> None:
    """In a forward-only pass the decoder's output is dead once the final norm has made its normed copy (megatron's
    block rebinds it): the head frees it there, not when the head ends."""
    from skyrl_sim_plugins.sim.bound.memory import PlanCache
    from skyrl_sim_plugins.sim.reference.segments import head_specs

    ep = endpoint("tiny-cpu-tp1")
    d = Dims.of(ep, PRESETS["tiny-dense"], 2, 100, 100)
    [spec] = head_specs(d, PRESETS["tiny-dense"], forward_only=True)
    steps = PlanCache().compile(spec.graph, spec.recipes).sized(spec.graph).steps
    frees = [s.op for s in steps if s.key == "in"]
    assert frees == ["final_layernorm"]  # its only reader
    assert steps[-1].key != "in"


@pytest.mark.parametrize("granularity", ["full", "none"])
def test_a_micro_batch_leaves_nothing_behind_for_the_next_one(granularity: str) -> None:
    """The first layer's backward hands its input's gradient on to the (frozen) embedding, which drops it: a call of
    two equal micro-batches peaks where a call of one does, on both walks."""
    full = {"granularity": "full", "method": "uniform", "num_layers": 1}
    recompute = full if granularity == "full" else {"granularity": "none"}
    ep = endpoint("tiny-cpu-tp1").model_copy(deep=True)
    ep.trainer.micro_train_batch_size_per_gpu = 2
    ep.trainer.recompute = type(ep.trainer.recompute).model_validate(recompute)
    peaks = []
    for rows in (2, 4):
        shape = shape_call("forward_backward", [100] * rows, ep, MEGATRON)
        assert len(shape.microbatches) == rows // 2
        fast = AllocationWalk().evaluate(shape, ep, PRESETS["tiny-dense"]).peak_bytes
        assert AllocationWalk().walk(shape, ep, PRESETS["tiny-dense"]).peak_bytes == fast
        peaks.append(fast)
    assert peaks[0] == peaks[1]


def walk(ep: Endpoint, lengths: list[int]) -> object:
    shape = shape_call("forward_backward", lengths, ep, MEGATRON)
    return AllocationWalk().evaluate(shape, ep, PRESETS["qwen3.6-27b"])


def test_seed_verdicts_per_endpoint() -> None:
    fused = walk(endpoint("qwen3.6-27b-h200-tp4"), N16)
    assert fused.oom is not None
    assert fused.oom.where["phase"] == "backward" and "fc1" in fused.oom.where["op"]
    assert fused.oom.where["shape"] == [35004, 16, 8704]
    assert fused.oom.attempted_bytes == pytest.approx(9.08 * GIB, rel=0.01)
    assert fused.oom.message.startswith(
        "CUDA out of memory. Tried to allocate 9.08 GiB. GPU 0 has a total capacity of 139.80"
    )
    assert 0.0 < fused.progress < 1.0

    vl = walk(endpoint("qwen3.6-27b-h200-tp4-vl-defaults"), N16)
    assert vl.oom is not None and vl.oom.where["phase"] == "forward" and vl.oom.where["op"] == "output_layer.logits"
    assert vl.oom.attempted_bytes / GIB == pytest.approx(64.76, abs=0.01)

    h100 = walk(endpoint("qwen3.6-27b-h100-tp4-vl-defaults"), N16)
    assert h100.oom is not None and h100.oom.where["phase"] == "forward"
    assert h100.oom.where["op"].startswith("mlp.linear_fc1") and isinstance(h100.oom.where["layer"], int)
    assert h100.oom.attempted_bytes / GIB == pytest.approx(9.08, rel=0.01)

    for name in ("qwen3.6-27b-h200-tp4", "qwen3.6-27b-h200-tp4-vl-defaults", "qwen3.6-27b-h100-tp4-vl-defaults"):
        ep = endpoint(name)
        ep.engine.cap_aware_padding = True
        one = walk(ep, [35000])
        assert one.oom is None
        assert (ep.capacity_bytes - one.peak_bytes) / GIB >= 10
        assert set(one.breakdown) >= {"weights", "adapters", "saved_activations", "logits", "transient"}


def test_check_exits_zero_on_the_17_request_drain(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(SCENARIO), "--quiet", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" in out and "mlp.linear_fc1.lora_b" in out


BIG = endpoint("qwen3.6-27b-h200-tp4")
BIG.hardware.device_memory_gib = 100_000.0  # room for every shape: peaks are compared, never cut short by an OOM
lengths_st = st.lists(st.integers(min_value=1, max_value=20_000), min_size=1, max_size=40)


@settings(max_examples=25, deadline=None)
@given(lengths=lengths_st, extra=st.integers(min_value=1, max_value=20_000), grow=st.integers(min_value=1, max_value=5_000))
def test_peak_never_decreases_when_rows_or_length_grow(lengths: list[int], extra: int, grow: int) -> None:
    base = walk(BIG, lengths).peak_bytes
    assert walk(BIG, [*lengths, extra]).peak_bytes >= base
    longer = [*lengths]
    longer[-1] += grow
    assert walk(BIG, longer).peak_bytes >= base


@settings(max_examples=25, deadline=None)
@given(lengths=lengths_st)
def test_cap_aware_padding_never_increases_the_peak(lengths: list[int]) -> None:
    aware = BIG.model_copy(deep=True)
    aware.engine.cap_aware_padding = True
    assert walk(aware, lengths).peak_bytes <= walk(BIG, lengths).peak_bytes


def test_local_spec_counts_rotary_cos_sin_mask_and_table_that_tp_does_not_split() -> None:
    """megatron-core's unfused path (layer_spec local) makes fp32 rotary cos/sin per q and k, kept for backward, and each
    micro-batch holds a [s, s] bool causal mask and the rotary table; the fused TE path makes none of them."""
    from skyrl_sim_plugins.sim.reference.memory_ops import microbatch_inputs

    model = PRESETS["tiny-dense"]
    s, head_dim = 16, model.head_dim
    for tp in (1, 2):
        for spec in ("local", "transformer_engine"):
            endpoint = Endpoint.model_validate(
                {
                    "model": "tiny-dense",
                    "hardware": {"profile": "cpu", "device_memory_gib": 4, "reserve_gib": 0, "devices": tp},
                    "parallelism": {"tp": tp, "sequence_parallel": False},
                    "trainer": {"recompute": {"granularity": "none"}, "layer_spec": spec},
                }
            )
            d = Dims.of(endpoint, model, rows=2, seq=s, logits_width=0)
            g = layer_graph(d, model, "full_attention", moe=False)
            rotary = {op.out for op in g.ops if op.out.endswith(("_cos", "_sin"))}
            inputs = {name: (shape, dtype) for name, shape, dtype in microbatch_inputs(d, model)}
            if spec == "local":
                assert rotary == {f"self_attention.rotary_{w}_{f}" for w in "qk" for f in ("cos", "sin")}
                for name in rotary:
                    assert g.tensors[name].shape == (s, 1, 1, head_dim)  # not split by TP
                    assert g.tensors[name].nbytes == s * head_dim * 4
                assert inputs["rotary_table"] == ((s, 1, 1, head_dim), "fp32")
                mask = next(v for k, v in inputs.items() if "mask" in k)
                assert math.prod(mask[0]) == s * s and mask[1] == "bool"
            else:
                assert rotary == set()
                assert inputs == {}


@pytest.mark.parametrize(("spec", "attention"), [("local", "flash"), ("transformer_engine", "unfused")])
def test_trainer_attention_decides_the_core_attention_and_layer_spec_the_rest(spec: str, attention: str) -> None:
    """trainer.attention (not layer_spec) picks the core attention's tensors; the layer spec still decides the rotary
    tables. The default follows the spec, so each spec's walk with its own default kernel is unchanged."""
    model = PRESETS["tiny-dense"]

    def graph(**trainer: object):
        d = Dims.of(tiny_endpoint(layer_spec=spec, **trainer), model, rows=2, seq=16, logits_width=0)
        return layer_graph(d, model, "full_attention", moe=False)

    g = graph(attention=attention)
    names = {op.out for op in g.ops}
    scores = "self_attention.core_attention.scores" in names
    assert scores == (attention == "unfused")
    flash = {
        "local": "self_attention.core_attention.sdpa_flash",
        "transformer_engine": "self_attention.core_attention.flash",
    }
    assert (flash[spec] in names) == (attention == "flash")
    assert any(name.endswith("_cos") for name in names) == (spec == "local")
    default = {op.out for op in graph().ops}
    assert ("self_attention.core_attention.scores" in default) == (spec == "local")
