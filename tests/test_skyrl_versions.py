"""SkyRL versions as data (``schema/skyrl_versions.py``) and the 0.4.0 trainer rules in the memory walk.

Each rule of the table is checked on the op graph it changes: the chunked log-prob backward (a list and a
concatenation at the seed's revision, one preallocated buffer in 0.4.0), the unchunked ``DistributedLogprob`` of a
short call, ``all-linear`` LoRA on the gated-DeltaNet projections, the dummy rows under token batching, the reserve
``empty_cuda_cache`` leaves, the Triton fused head and the RL path's entropy.
"""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from project_paths import ROOT
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.architecture import PRESETS
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.schema.skyrl_versions import (
    DEFAULT_VERSION,
    PR_SETTING_LABEL,
    VERSIONS,
    labelled,
    pr_settings_in_use,
    table_rows,
)
from skyrl_sim.units import GIB
from skyrl_sim_plugins.sim.bound.memory import AllocationWalk
from skyrl_sim_plugins.sim.description.layer_ops import layer_kind
from skyrl_sim_plugins.sim.reference.allocator import round_allocated
from skyrl_sim_plugins.sim.reference.memory_graph import Graph, nbytes
from skyrl_sim_plugins.sim.reference.memory_logprob import TRITON_DLOGITS_SPLIT
from skyrl_sim_plugins.sim.reference.memory_ops import Dims, head_graph, layer_graph
from skyrl_sim_plugins.sim.reference.memory_walk import reserved_after_call
from skyrl_sim_plugins.sim.reference.static_memory import static_bytes

QWEN = PRESETS["qwen3.6-27b"]
ENDPOINTS = ROOT / "scenarios" / "endpoints"


def endpoint(version: str = "0.4.0", model: str = "qwen3.6-27b", tp: int = 4, **trainer: Any) -> Endpoint:
    """A Qwen3.6-27B endpoint (TP 4, non-fused head, fp32 output, chunk 1024) on ``version``."""
    lora = trainer.pop("lora", {})
    return Endpoint.model_validate(
        {
            "skyrl_version": version,
            "model": model,
            "hardware": {"profile": "h200", "device_memory_gib": 139.8, "reserve_gib": 1.8, "devices": tp},
            "parallelism": {"tp": tp},
            "lora": lora,
            "trainer": {
                "micro_train_batch_size_per_gpu": 16,
                "remove_microbatch_padding": False,
                "fused_lm_head_logprob": False,
                **trainer,
            },
        }
    )


def head(ep: Endpoint, rows: int, width: int, rl: bool = False) -> Graph:
    return head_graph(Dims.of(ep, QWEN, rows=rows, seq=width, logits_width=width, rl=rl), QWEN)


def head_backward_steps(g: Graph) -> list[Any]:
    last = g.output()
    plan = g.backward_plan(last, keep_forward=(last,), free_after=("in", last), grad_input="in", seed_external=False)
    return g.steps(plan)


def live_at_peak(steps: list[Any], op: str | None = None) -> dict[str, int]:
    """The tensors these steps allocate that are alive when the steps' own allocations peak (while ``op`` runs, when
    given), by key (frees of what was allocated before them are left out)."""
    if op is not None:
        last = max(i for i, step in enumerate(steps) if step.op == op)
        steps = steps[: last + 1]
    live: dict[str, int] = {}
    best: dict[str, int] = {}
    top = 0
    for step in steps:
        if step.nbytes > 0:
            live[step.key] = live.get(step.key, 0) + step.nbytes
        elif step.key in live:
            live[step.key] += step.nbytes
            if live[step.key] <= 0:
                del live[step.key]
        if sum(live.values()) > top:
            top, best = sum(live.values()), dict(live)
    return best


def test_the_table_has_a_row_for_every_version_and_rule() -> None:
    assert set(VERSIONS) == {"0.4.0", "pr1874"} and DEFAULT_VERSION == "0.4.0"
    assert VERSIONS["0.4.0"].released and not VERSIONS["pr1874"].released
    rows = dict(table_rows())
    assert rows["logprob_backward"] == {"pr1874": "list_concat", "0.4.0": "preallocated_buffer"}
    assert rows["engine_settings"]["0.4.0"] == "none"
    assert set(rows) >= {"entropy", "lora_all_linear", "token_batching_pads_rows", "empty_cuda_cache", "loss_fns"}


def test_no_version_name_is_tested_outside_the_table() -> None:
    """Versions are data: no module but the table compares ``skyrl_version`` with a version's name."""
    offenders = []
    for path in (ROOT / "src").rglob("*.py"):
        if path.name == "skyrl_versions.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                names = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                if any(name in VERSIONS for name in names):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_shipped_endpoints_model_the_seeds_revision_and_new_ones_the_release() -> None:
    for path in sorted(ENDPOINTS.glob("*.yaml")):
        version = Endpoint.model_validate(__import__("yaml").safe_load(path.read_text())).skyrl_version
        release = (  # written for SkyRL 0.4.0: its JAX backend, the new model families and trainers
            "skyrl-jax-cpu",
            "tiny-mla-moe-cpu",
            "gpt-oss-20b-h100",
            "tiny-cpu-fsdp",
            "tiny-cpu-fsdp-dp2",
            "tiny-cpu-full",
            "tiny-cpu-full-dp2",
        )
        assert version == ("0.4.0" if path.stem in release else "pr1874"), path.name
    assert Endpoint.model_validate({"model": "tiny-dense", "hardware": {"devices": 1}}).skyrl_version == "0.4.0"


def test_pr_settings_are_labelled_where_the_version_lacks_them() -> None:
    ep = endpoint("0.4.0")
    ep.engine.forward_backward_max_request_count = 2
    assert pr_settings_in_use("0.4.0", ep.engine) == ["engine.forward_backward_max_request_count"]
    assert pr_settings_in_use("pr1874", ep.engine) == []
    assert labelled("0.4.0", "engine.cap_aware_padding") == f"engine.cap_aware_padding ({PR_SETTING_LABEL})"
    assert labelled("pr1874", "engine.cap_aware_padding") == "engine.cap_aware_padding"


def test_settings_a_version_does_not_have_are_refused() -> None:
    with pytest.raises(ValueError, match="fused_lm_head_logprob_backend is not a setting of SkyRL pr1874"):
        endpoint("pr1874", fused_lm_head_logprob_backend="triton")
    with pytest.raises(ValueError, match="vocab_entropy_chunk_memory_mb is not a setting of SkyRL pr1874"):
        endpoint("pr1874", vocab_entropy_chunk_memory_mb=64)
    endpoint("0.4.0", fused_lm_head_logprob_backend="triton", vocab_entropy_chunk_memory_mb=64)


# ----------------------------------------------------------------------------------------- log-prob backward


def test_seed_backward_holds_the_chunk_list_and_its_concatenation_0_4_0_one_buffer() -> None:
    rows, width = 2, 4000
    vocab = QWEN.vocab_size // 4
    full = round_allocated(nbytes((rows, width, vocab), "fp32"))
    chunk = round_allocated(nbytes((rows, 1024, vocab), "fp32"))
    op = "chunked_logprob.backward"
    seed = live_at_peak(head_backward_steps(head(endpoint("pr1874"), rows, width)), op)
    release = live_at_peak(head_backward_steps(head(endpoint("0.4.0"), rows, width)), op)
    # at the seed's peak: the saved fp32 logits, the list of chunk gradients and their concatenation (x's gradient)
    assert seed["chunked_logprob.backward.chunk_grad_list"] == full
    assert seed["grad:recover_left_padding"] == full
    # in 0.4.0: the saved logits, one preallocated gradient buffer, three chunk-sized temporaries
    assert "chunked_logprob.backward.chunk_grad_list" not in release
    assert release["grad:recover_left_padding"] == full
    temps = [k for k in release if k.startswith("chunked_logprob.backward.")]
    assert sorted(temps) == sorted(
        f"chunked_logprob.backward.{n}" for n in ("previous_chunk_grad", "chunk_shifted", "chunk_log_softmax")
    )
    assert sum(release.values()) == sum(seed.values()) - full + 3 * chunk


def test_bf16_logits_add_the_chunks_fp32_cast_to_the_buffered_backward() -> None:
    g = head(endpoint("0.4.0", fp32_output=False), 2, 4000)
    op = next(op for op in g.ops if op.name == "chunked_logprob")
    assert ("chunk_fp32_cast", (2, 1024, QWEN.vocab_size // 4), "fp32") in op.backward_extra
    assert op.grad_before_workspaces  # the buffer is made before the first chunk (torch.empty), then streamed into


@pytest.mark.parametrize("version", ["0.4.0", "pr1874"])
def test_a_call_no_longer_than_the_chunk_takes_the_unchunked_distributed_logprob(version: str) -> None:
    ep = endpoint(version)
    short, long = head(ep, 2, 1024), head(ep, 2, 1025)
    assert "distributed_logprob" in {op.name for op in short.ops} and "chunked_logprob" not in {o.name for o in short.ops}
    assert "chunked_logprob" in {op.name for op in long.ops}
    # it keeps the fp32 softmax for backward, not the logits: after the forward the logits are gone
    plan = short.forward_plan(True, keep=(short.output(),))
    freed = {spec.key for spec in plan if spec.sign < 0}
    assert "recover_left_padding" in freed and "distributed_logprob.softmax" not in freed
    # backward: the gradient (softmax.neg()) beside the saved softmax, and nothing else of that size
    full = round_allocated(nbytes((2, 1024, QWEN.vocab_size // 4), "fp32"))
    steps = head_backward_steps(short)
    live = live_at_peak(steps, "distributed_logprob.backward")
    assert live["grad:distributed_logprob.softmax"] == full  # beside the softmax the forward saved
    assert sum(1 for size in live.values() if size >= full) == 1
    # x's gradient is that tensor (fp32 logits): the softmax op's backward allocates nothing
    assert not [s for s in steps if s.op == "distributed_logprob.softmax.backward" and s.nbytes > 0]


# ------------------------------------------------------------------------------------------------ LoRA targets


def test_all_linear_adds_the_gated_deltanet_projections_in_0_4_0() -> None:
    assert endpoint("pr1874").adapted_targets(QWEN) == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    assert endpoint("0.4.0").adapted_targets(QWEN) == {
        "linear_qkv",
        "linear_proj",
        "linear_fc1",
        "linear_fc2",
        "in_proj",
        "out_proj",
    }
    listed = ["linear_fc1"]
    assert endpoint("0.4.0", lora={"targets": listed}).adapted_targets(QWEN) == {"linear_fc1"}


def test_a_fused_in_proj_checkpoint_keeps_in_proj_out_of_all_linear() -> None:
    assert QWEN.linear_attention is not None
    next_style = replace(QWEN, linear_attention=replace(QWEN.linear_attention, fused_in_proj_checkpoint=True))
    assert "in_proj" not in endpoint("0.4.0").adapted_targets(next_style)
    assert "out_proj" in endpoint("0.4.0").adapted_targets(next_style)
    assert "in_proj" in endpoint("0.4.0", lora={"targets": ["in_proj"]}).adapted_targets(next_style)


def test_a_qwen3_next_config_is_read_as_a_fused_in_proj_checkpoint() -> None:
    from skyrl_sim.schema.architecture import from_hf_config

    config = {
        "model_type": "qwen3_next",
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "full_attention_interval": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 32,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 32,
    }
    assert from_hf_config(config, "next").linear_attention.fused_in_proj_checkpoint  # type: ignore[union-attr]
    config["model_type"] = "qwen3_5_text"
    assert not from_hf_config(config, "qwen35").linear_attention.fused_in_proj_checkpoint  # type: ignore[union-attr]


def test_0_4_0_gated_deltanet_layers_carry_lora_on_both_projections() -> None:
    d_seed = Dims.of(endpoint("pr1874"), QWEN, rows=1, seq=4096, logits_width=0)
    d_new = Dims.of(endpoint("0.4.0"), QWEN, rows=1, seq=4096, logits_width=0)
    seed_ops = {op.name for op in layer_graph(d_seed, QWEN, "linear_attention", False).ops}
    new_ops = {op.name for op in layer_graph(d_new, QWEN, "linear_attention", False).ops}
    added = new_ops - seed_ops
    assert {"self_attention.in_proj.lora_b", "self_attention.out_proj.lora_b"} <= added
    assert all(".in_proj." in name or ".out_proj." in name for name in added)
    # the adapters' static state grows by exactly the two projections' A and B on each of the 48 DeltaNet layers
    gdn = layer_kind(QWEN, "linear_attention", False).attention
    per_layer = sum(linear.adapter_parameters_per_rank(8, 4) for linear in (gdn.in_proj, gdn.out_proj))  # type: ignore[union-attr]
    grown = static_bytes(QWEN, endpoint("0.4.0"))["adapters"] - static_bytes(QWEN, endpoint("pr1874"))["adapters"]
    layers = QWEN.layer_types.count("linear_attention")
    assert grown == layers * per_layer * (2 + 4) + layers * per_layer * 12  # bf16 + fp32 grad, Adam: master + 2 moments


# ------------------------------------------------------------------------------------------ token batching rows


@pytest.mark.parametrize("packed", [False, True])
def test_token_batching_pads_every_microbatch_to_the_same_row_count(packed: bool) -> None:
    ep = endpoint("0.4.0", model="tiny-dense", tp=2, remove_microbatch_padding=packed, max_tokens_per_microbatch=1000)
    lengths = [900, 100, 120, 130, 700, 90]
    shape = shape_call("forward_backward", lengths, ep, MEGATRON)
    rows = {mb.rows for mb in shape.microbatches}
    assert len(rows) == 1 and len(shape.microbatches) > 1
    most = rows.pop()
    for mb in shape.microbatches:
        assert len(mb.row_tokens) + mb.dummy_rows == most
        real = sum(-(-t // 2) * 2 for t in mb.row_tokens) if packed else max(mb.row_tokens)
        assert mb.width == (real + 2 * mb.dummy_rows if packed else -(-real // 2) * 2)
    # the walk sees the dummy rows: a padded micro-batch of more rows costs more than it would without them
    assert any(mb.dummy_rows for mb in shape.microbatches)


def test_row_counts_under_a_row_micro_size_are_not_padded_by_the_token_rule() -> None:
    ep = endpoint("0.4.0", model="tiny-dense", tp=2, micro_train_batch_size_per_gpu=4)
    shape = shape_call("forward_backward", [100] * 6, ep, MEGATRON)
    assert all(mb.dummy_rows == 0 for mb in shape.microbatches)


# -------------------------------------------------------------------------------------------- empty_cuda_cache


def test_empty_cuda_cache_returns_the_reserve_to_what_stays_allocated() -> None:
    ep = endpoint("0.4.0")
    walk = AllocationWalk()
    big = walk.evaluate(shape_call("forward_backward", [4000, 3000], ep, MEGATRON), ep, QWEN)
    static = static_bytes(QWEN, ep)
    assert big.oom is None and big.breakdown["reserved"] > (static["weights"] + static["adapters"]) * 1.2
    after = reserved_after_call(big, ep, QWEN)
    assert static["weights"] + static["adapters"] <= after < static["weights"] + static["adapters"] + GIB // 100
    kept = ep.model_copy(update={"trainer": ep.trainer.model_copy(update={"empty_cuda_cache": False})})
    assert reserved_after_call(big, kept, QWEN) == big.breakdown["reserved"]


def test_a_call_that_raised_never_empties_the_cache() -> None:
    ep = endpoint("0.4.0")
    failed = AllocationWalk().evaluate(shape_call("forward_backward", [35000] * 16, ep, MEGATRON), ep, QWEN)
    assert failed.oom is not None
    assert reserved_after_call(failed, ep, QWEN) == failed.breakdown["reserved"]


# -------------------------------------------------------------------------------------------- fused head, Triton


def test_the_triton_fused_head_keeps_a_weight_dtype_copy_and_a_logit_gradient_tile() -> None:
    ep = endpoint("0.4.0", fused_lm_head_logprob=True, fused_lm_head_logprob_backend="triton")
    g = head(ep, 2, 4000)
    names = {op.name: op for op in g.ops}
    cast = g.tensors["fused_lm_head.hidden_cast"]
    assert (cast.shape, cast.dtype) == ((2 * 4000, QWEN.hidden_size), "bf16")  # the fp32 hidden states cast to bf16
    fused = names["fused_lm_head_logprob"]
    assert "fused_lm_head.hidden_cast" in fused.saves and "recover_left_padding" not in fused.saves
    extra = {name: (shape, dtype) for name, shape, dtype in fused.backward_extra}
    assert extra["dlogits_tile"] == ((8000, TRITON_DLOGITS_SPLIT), "bf16")
    # backward hands a bf16 gradient to the cast, whose backward makes the fp32 gradient of the hidden states
    live = live_at_peak(head_backward_steps(g))
    assert "grad:fused_lm_head.hidden_cast" in live or "grad:recover_left_padding" in live
    torch_head = head(endpoint("0.4.0", fused_lm_head_logprob=True), 2, 4000)
    assert "fused_lm_head.hidden_cast" not in torch_head.tensors


# ---------------------------------------------------------------------------------------------------- RL path


def test_the_rl_path_adds_a_no_grad_entropy_over_the_action_logits() -> None:
    ep = endpoint("0.4.0")
    g = head(ep, 2, 4000, rl=True)
    ops = {op.name: op for op in g.ops}
    assert g.output() == "policy_loss" and not g.tensors["vocab_parallel_entropy"].requires_grad
    # 0.4.0 chunks it: 512 MiB / (2 rows x 62,080 x 4 bytes x 4) = 270 tokens -> 256
    (name, shape, dtype), = ops["vocab_parallel_entropy"].temps
    assert (shape, dtype) == ((2, 256, QWEN.vocab_size // 4), "fp32")
    seed = {op.name: op for op in head(endpoint("pr1874"), 2, 4000, rl=True).ops}
    assert seed["vocab_parallel_entropy"].temps[0][1] == (2, 3999, QWEN.vocab_size // 4)  # the seed's: unchunked
    assert "vocab_parallel_entropy" not in {op.name for op in head(ep, 2, 4000).ops}  # cross-entropy: no entropy


def test_the_entropy_chunk_follows_its_settings() -> None:
    sized = {op.name: op for op in head(endpoint("0.4.0", vocab_entropy_chunk_size=100), 2, 4000, rl=True).ops}
    assert sized["vocab_parallel_entropy"].temps[0][1][1] == 100
    whole = {op.name: op for op in head(endpoint("0.4.0", vocab_entropy_chunk_size=None), 2, 4000, rl=True).ops}
    assert whole["vocab_parallel_entropy"].temps[0][1][1] == 3999


def test_the_fused_head_recomputes_each_entropy_chunk_from_the_hidden_states() -> None:
    g = head(endpoint("0.4.0", fused_lm_head_logprob=True), 2, 4000, rl=True)
    op = next(op for op in g.ops if op.name == "fused_entropy")
    shapes = {name: shape for name, shape, _ in op.temps}
    assert shapes["chunk_logits"] == (2, 1024, QWEN.vocab_size // 4) and len(shapes) == 5  # with the bf16 hidden cast


def peak_during(g: Graph, op: str) -> int:
    """The head forward's allocated total at its highest while ``op`` runs."""
    total, top = 0, 0
    for step in g.forward_steps(True, keep=(g.output(),)):
        total += step.nbytes
        if step.op == op:
            top = max(top, total)
    return top


def test_the_entropy_copies_the_whole_action_span_on_the_seed_and_a_chunk_in_0_4_0() -> None:
    rows, width = 2, 4000
    vocab = QWEN.vocab_size // 4
    entropy = round_allocated(nbytes((rows, width - 1, vocab), "fp32"))
    chunks = 3 * round_allocated(nbytes((rows, 1024, vocab), "fp32"))
    per_token = round_allocated(nbytes((rows, width - 1), "fp32"))  # the entropy's output
    for version, copy in (("pr1874", entropy), ("0.4.0", round_allocated(nbytes((rows, 256, vocab), "fp32")))):
        rl = head(endpoint(version), rows, width, rl=True)
        # both beside the logits and the log-probs: while the log-prob runs its three chunks, while the entropy runs
        # its shifted copy (the seed's: the whole action span) and its output
        assert peak_during(rl, "vocab_parallel_entropy") - peak_during(rl, "chunked_logprob") == copy + per_token - chunks


def test_a_loss_the_version_lacks_fails_at_submission_as_its_api_refuses_it(tmp_path: Path) -> None:
    from skyrl_sim.plugin_host.host import PluginHost

    path = tmp_path / "rl.yaml"
    path.write_text(
        f"name: rl\nendpoint: {ENDPOINTS / 'tiny-cpu-tp1.yaml'}\nworkload:\n  clients:\n    - requests:\n"
        "        - {type: forward_backward, loss_fn: gspo, datums: [10], loss_fn_inputs: {logprobs: -1, advantages: 1}}\n"
        "        - {type: forward_backward, loss_fn: ppo, datums: [10], loss_fn_inputs: {logprobs: -1, advantages: 1}}\n"
    )
    scenario = load_scenario(path)
    seed = PluginHost().run(scenario.resolve("default"), "sim")
    first, second = seed.requests
    assert first.error is not None and "HTTP 422" in first.error and "gspo" in first.error and first.started_s is None
    assert second.error is None
    release = PluginHost().run(scenario.resolve("default", {"skyrl_version": "0.4.0"}), "sim")
    assert all(r.error is None for r in release.requests)


def test_the_time_model_prices_the_rl_paths_entropy() -> None:
    from skyrl_sim_plugins.sim.bound.timing import RooflineTimeModel
    from skyrl_sim_plugins.sim.reference.time_model import RL_KIND, pass_kind

    for fused in (False, True):
        ep = endpoint("0.4.0", fused_lm_head_logprob=fused)
        bound = RooflineTimeModel().bind(ep, QWEN)
        ce = shape_call("forward_backward", [3000, 3500], ep, MEGATRON)
        rl = shape_call("forward_backward", [3000, 3500], ep, MEGATRON, "importance_sampling")
        assert pass_kind(rl) == RL_KIND and pass_kind(ce) == "forward_backward"
        extra = bound.call(rl).bytes - bound.call(ce).bytes
        logits = 16 * 3501 * (QWEN.vocab_size / 4)  # 16 padded rows x the global width, one rank's vocabulary
        # the entropy's fp32 passes over the action logits (six; eight with the fused head's recompute, plus its GEMM)
        passes = 8 if fused else 6
        gemm_io = 2 * (QWEN.hidden_size * QWEN.vocab_size / 4 + 16 * 3501 * QWEN.hidden_size + logits) if fused else 0
        assert extra == pytest.approx(4 * passes * logits + gemm_io, rel=1e-9)
        assert bound.call(rl).flops - bound.call(ce).flops == pytest.approx(
            2 * 16 * 3501 * QWEN.hidden_size * QWEN.vocab_size / 4 if fused else 0.0, rel=1e-9
        )
    forward = shape_call("forward", [3000], ep, MEGATRON, "ppo")
    assert not forward.rl_path  # a forward never takes a loss on the SkyRL backend


# ------------------------------------------------------------------------------ labels: check, sweep, advise, JSON

TINY_SCENARIO = str(ROOT / "scenarios" / "queue_drain_17_tiny.yaml")


def test_check_and_the_json_label_the_pr_settings_on_a_release(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import orjson

    from skyrl_sim.cli import main

    out = tmp_path / "run.json"
    main(["check", TINY_SCENARIO, "--variant", "cap-aware", "--set", "skyrl_version=0.4.0", "--json", str(out)])
    printed = capsys.readouterr().out
    assert printed.count(PR_SETTING_LABEL) == 2  # the cap and cap-aware padding
    notes = orjson.loads(out.read_bytes())["runs"][0]["notes"]  # --json: {schema, runs: [...]}
    assert len([n for n in notes if PR_SETTING_LABEL in n]) == 2
    main(["check", TINY_SCENARIO, "--variant", "cap-aware"])
    assert PR_SETTING_LABEL not in capsys.readouterr().out  # the seed's revision has them


def test_a_sweep_labels_the_pr_settings_it_sweeps_on_a_release() -> None:
    from skyrl_sim.commands.sweep import parse_grid, run_sweep, sweep_table

    axes = parse_grid(["engine.forward_backward_max_request_count=1,2"])
    release = run_sweep(TINY_SCENARIO, axes, variant="cap-aware", sets={"skyrl_version": "0.4.0"}, workers=1)
    assert list(release.labels) == ["engine.forward_backward_max_request_count"]
    assert release.labels["engine.forward_backward_max_request_count"].startswith(PR_SETTING_LABEL)
    assert release.to_dict()["labels"] == release.labels
    assert PR_SETTING_LABEL in str(sweep_table(release).caption)
    seed = run_sweep(TINY_SCENARIO, axes, variant="cap-aware", workers=1)
    assert seed.labels == {} and "labels" not in seed.to_dict()


def test_advise_changes_only_what_the_version_has_unless_asked_for_what_ifs() -> None:
    from skyrl_sim.commands.advise_search import advise
    from skyrl_sim.commands.advise_space import settings_labels

    sets = {"skyrl_version": "0.4.0", "trainer.micro_train_batch_size_per_gpu": 4}
    # every structural axis held: the search is the PR's two settings (or, released only, nothing to search)
    fixed = [
        "trainer.max_tokens_per_microbatch",
        "trainer.remove_microbatch_padding",
        "trainer.recompute.granularity",
        "parallelism.tp",
    ]
    options: dict[str, Any] = dict(variant="no-cap", workers=1, rounds=1, fixed=fixed)
    released = advise(TINY_SCENARIO, sets=sets, released_only=True, **options)
    by_default = advise(TINY_SCENARIO, sets=sets, **options)  # 0.4.0's own settings: the same as released only
    for advice in (released, by_default):
        for candidate in advice.candidates:
            assert candidate.settings.get("engine.forward_backward_max_request_count") is None
            assert not candidate.settings.get("engine.cap_aware_padding")
        assert advice.reference is None and advice.labels() == {}
    assert released.to_dict()["released_only"] is True and released.to_dict()["mode"] == "released"
    assert by_default.to_dict()["mode"] == "version"
    what_if = advise(TINY_SCENARIO, sets=sets, what_if=True, **options)
    labelled_candidates = [c for c in what_if.candidates if settings_labels(c.settings, "0.4.0")]
    assert labelled_candidates  # the PR's settings are searched as a what-if, and labelled
    assert all("labels" in c.to_dict("makespan", what_if.base_endpoint, "0.4.0") for c in labelled_candidates)
    with pytest.raises(Exception, match="--released-only"):
        advise(TINY_SCENARIO, sets={**sets, "engine.cap_aware_padding": True}, released_only=True, **options)
    with pytest.raises(Exception, match="--what-if searches it"):
        advise(TINY_SCENARIO, sets={**sets, "engine.cap_aware_padding": True}, **options)


def test_advise_released_only_leaves_out_the_pr_settings_of_an_unreleased_revision() -> None:
    """On the seed's revision (pr1874) the PR's cap is a setting, searched by default and labelled with where it is
    written; ``--released-only`` leaves it out, because no SkyRL release has it."""
    from skyrl_sim.commands.advise_search import advise

    options: dict[str, Any] = dict(variant="no-cap", workers=1, rounds=1, fixed=["trainer.recompute.granularity"])
    seed = advise(TINY_SCENARIO, **options)
    assert any(c.settings.get("engine.forward_backward_max_request_count") for c in seed.candidates)
    released = advise(TINY_SCENARIO, released_only=True, **options)
    assert not any(c.settings.get("engine.forward_backward_max_request_count") for c in released.candidates)
    assert not any(c.settings.get("engine.cap_aware_padding") for c in released.candidates)
    with pytest.raises(Exception, match="contradict"):
        advise(TINY_SCENARIO, released_only=True, what_if=True, **options)


def test_the_docs_show_the_table_as_the_code_has_it() -> None:
    text = (ROOT / "docs" / "skyrl-versions.md").read_text()
    for rule, values in table_rows():
        assert f"| `{rule}` | {values['pr1874']} | {values['0.4.0']} |" in text, rule
