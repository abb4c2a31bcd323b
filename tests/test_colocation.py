"""The trainer and vLLM on one device (``sim.service.colocation``), pinned to the code each rule comes from.

CUDA sleep mode cannot run on these CPU machines and the GPU machine has no vLLM, so nothing here is measured: each
test holds a mechanism to SkyRL 0.4.0's or vLLM's code (the order of the switches, the sleep levels, the refusals),
or calls vLLM's own function on the same inputs (its start-up budget check, its KV-block refusal, its page size).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from project_paths import SCENARIOS
from scenario_text import run_one_client
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.architecture import resolve_model
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.units import GIB, format_size
from skyrl_sim_plugins.sim.service.colocation import (
    NO_KV_MEMORY,
    NO_SYNCED_WEIGHTS,
    ColocatedDevice,
    colocated,
    request_memory_error,
    sleep_level,
)
from skyrl_sim_plugins.sim.service.inference.kv_cache import bytes_per_block
from skyrl_sim_plugins.sim.service.inference.vllm_budget import requested_memory
from skyrl_sim_plugins.sim.service.trainer_backload import backload_pieces


def endpoint_body(**sections: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"name": "colocated", "model": "qwen3-8b", "hardware": {"profile": "h200", "devices": 1}}
    for key, value in sections.items():
        body[key] = {**body[key], **value} if isinstance(body.get(key), dict) else value
    return body


def device(**sections: Any) -> ColocatedDevice:
    endpoint = Endpoint.model_validate(endpoint_body(**sections))
    return ColocatedDevice(endpoint, resolve_model(endpoint.model, Path(".")))


def steps(d: ColocatedDevice, kind: str, named: bool = False) -> list[str]:
    switch = d.before(kind, named_save=named)
    assert not switch.failed, switch.message
    return [t.step + (f" ({t.detail})" if t.detail.startswith(("level", "kv")) else "") for t in switch.transitions]


def run(tmp_path: Path, requests: list[dict[str, Any]], **sections: Any) -> RunResult:
    return run_one_client(tmp_path, "colocation", endpoint_body(**sections), requests)


SAMPLE = {"type": "sample", "prompt_tokens": 64, "max_tokens": 16}
FB = {"type": "forward_backward", "lengths": [512]}


def test_the_switches_come_in_skyrls_order() -> None:
    """save (lazy start, level-2 sleep, merged sync), sample (awake already), forward_backward (level-1 sleep with
    LoRA, backload), optim_step, a named save (sync, then the HF export's sleep and backload), sample (wake)."""
    d = device()
    assert steps(d, "forward_backward") == []  # before vLLM exists the trainer is the trainer-only model's
    assert steps(d, "save_weights_for_sampler") == [
        "trainer_offload",  # _ensure_inference_engines: offload_for_sampling before the engines start
        "vllm_start",
        "vllm_sleep (level 2)",  # _create_new_inference_client: sleep() at its default level
        "trainer_backload",  # _prepare_for_weight_sync: the model only (the optimizer stays offloaded)
        "weight_sync",  # wake_up(tags=["weights"]) and the broadcast while both copies are resident
        "trainer_offload",  # _finish_weight_sync
        "vllm_wake (kv_cache)",  # wake_up(tags=["kv_cache"])
    ]
    assert steps(d, "sample") == []  # the sync left the engines awake
    assert steps(d, "forward_backward") == ["vllm_sleep (level 1)", "trainer_backload"]
    assert steps(d, "optim_step") == []  # model and optimizer already back
    assert steps(d, "save_weights_for_sampler", named=True) == [
        # already asleep and the model is resident: only the optimizer goes back to the host (offload_after_step)
        "trainer_offload",
        "weight_sync",
        "trainer_offload",
        "vllm_wake (kv_cache)",
        "vllm_sleep (level 1)",  # save_sampler_checkpoint(persist=True): sleep before save_hf_model
        "trainer_backload",
        "hf_export",
    ]
    assert steps(d, "sample") == ["trainer_offload", "vllm_wake"]  # _wake_inference_engines_for_sampling


def test_sleep_levels_follow_lora_and_the_weight_sync_mode() -> None:
    merged = Endpoint.model_validate(endpoint_body())
    adapters = Endpoint.model_validate(endpoint_body(lora={"merge_lora": False}, inference={"enable_lora": True}))
    full = Endpoint.model_validate(endpoint_body(trainer={"train_base_weights": True}))
    assert [sleep_level(merged, m) for m in ("start", "training", "sync")] == [2, 1, 2]
    assert [sleep_level(adapters, m) for m in ("start", "training", "sync")] == [1, 1, 1]  # the client clamps to 1
    assert [sleep_level(full, m) for m in ("start", "training", "sync")] == [2, 2, 2]
    override = Endpoint.model_validate(endpoint_body(inference={"sleep_level": 1}))
    assert [sleep_level(override, m) for m in ("start", "training", "sync")] == [1, 1, 1]


def test_adapter_only_sync_keeps_vllm_awake_and_never_backloads() -> None:
    d = device(lora={"merge_lora": False}, inference={"enable_lora": True})
    # no eager sleep after the start: the adapter loads onto awake engines
    assert steps(d, "save_weights_for_sampler") == ["trainer_offload", "vllm_start"]
    assert steps(d, "forward_backward") == ["vllm_sleep (level 1)", "trainer_backload"]
    assert steps(d, "save_weights_for_sampler") == ["trainer_offload", "vllm_wake"]


def test_a_sample_before_any_sync_is_refused_as_skyrl_refuses_it(tmp_path: Path) -> None:
    result = run(tmp_path, [SAMPLE, {"type": "save_weights_for_sampler"}, SAMPLE])
    first, second = result.request(1), result.request(3)
    assert first.error == f"Waking up inference engines failed: {NO_SYNCED_WEIGHTS}"
    assert second.error is None  # the sync gave the engines weights and woke them
    assert result.calls[0].kind == "prepare_for_sampling" and result.calls[0].oom is None


def test_request_memory_is_vllms_check_on_the_same_inputs() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.worker.utils import request_memory

    e = Endpoint.model_validate(endpoint_body(inference={"gpu_memory_utilization": 0.97}))
    total = int(e.hardware.device_memory_gib * GIB)
    cache = SimpleNamespace(gpu_memory_utilization=e.inference.gpu_memory_utilization)
    fits = SimpleNamespace(total_memory=total, free_memory=total, device_="cuda:0")
    assert request_memory(fits, cache) == requested_memory(e, total)
    short = SimpleNamespace(total_memory=total, free_memory=requested_memory(e, total) - 1, device_="cuda:0")
    with pytest.raises(ValueError) as info:
        request_memory(short, cache)
    assert str(info.value) == request_memory_error(e, short.free_memory, total)


def test_no_kv_memory_is_vllms_own_refusal() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory

    with pytest.raises(ValueError) as info:
        _check_enough_kv_cache_memory(0, lambda: 1, 1, lambda _: 0)
    assert str(info.value) == NO_KV_MEMORY


def test_a_blocks_bytes_are_vllms_page_size() -> None:
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    e = Endpoint.model_validate(endpoint_body(inference={"block_size": 16}))
    model = resolve_model(e.model, Path("."))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=model.num_kv_heads, head_size=model.head_dim, dtype=torch.bfloat16)
    layers = sum(kind == "full_attention" for kind in model.layer_types)
    assert bytes_per_block(e, model) == layers * spec.page_size_bytes


def test_vllm_start_fails_at_high_utilization_and_passes_lower() -> None:
    scenario = load_scenario(SCENARIOS / "colocated_vllm_start.yaml")
    host = PluginHost()
    high = host.run(scenario.resolve("util-0.99"), "sim")
    low = host.run(scenario.resolve("util-0.90"), "sim")
    starved = host.run(scenario.resolve("util-0.40"), "sim")
    first = high.oom_calls[0]
    assert first.kind == "save_weights_for_sampler" and first.oom is not None
    assert first.oom.where["phase"] == "vllm_start" and first.oom.where["check"] == "request_memory"
    assert first.oom.where["on_device"]["trainer"] == "offloaded"  # SkyRL offloads before the engines start
    assert "is less than desired GPU memory utilization (0.99" in first.oom.message
    assert {r.error for r in high.requests if r.type == "sample"} == {first.oom.message}  # each retries the start
    assert not low.oom_calls and all(r.error is None for r in low.requests)
    assert starved.oom_calls[0].oom is not None and starved.oom_calls[0].oom.message == NO_KV_MEMORY
    steps = low.inference["colocation"]["steps"]
    assert steps["vllm_start"] == 1 and steps["weight_sync"] == 2
    assert low.summary()["switch_s"] > 0 and 0 < low.summary()["switch_share"] < 1


def test_an_optim_step_beside_awake_engines_fails_its_backload(tmp_path: Path) -> None:
    """optim_step backloads the optimizer without sleeping the engines (``worker_dispatch.optim_step``)."""
    requests = [FB, {"type": "save_weights_for_sampler"}, SAMPLE, {"type": "optim_step"}]
    tight = run(tmp_path, requests, inference={"gpu_memory_utilization": 0.95})
    optim = next(c for c in tight.calls if c.kind == "optim_step")
    assert optim.oom is not None and optim.oom.where["phase"] == "backload"
    assert optim.oom.where["on_device"]["vllm"] == "awake"
    assert "CUDA out of memory" in optim.oom.message
    assert run(tmp_path, requests).request(4).error is None  # SkyRL's default 0.8 leaves room


def test_a_merged_sync_needs_both_copies_on_the_device(tmp_path: Path) -> None:
    requests = [{"type": "save_weights_for_sampler"}]
    small = {"device_memory_gib": 36.0}  # qwen3-8b: 15.3 GiB of trainer weights beside vLLM's 15.3, its graphs, a bucket
    result = run(tmp_path, requests, hardware=small, inference={"gpu_memory_utilization": 0.85})
    sync = result.calls[0]
    assert sync.oom is not None and sync.oom.where["phase"] == "weight_sync"
    inference = {"enable_lora": True, "gpu_memory_utilization": 0.85}
    adapters = run(tmp_path, requests, hardware=small, lora={"merge_lora": False}, inference=inference)
    assert adapters.calls[0].oom is None  # adapter-only sync never backloads the base weights


def test_training_only_runs_never_switch(tmp_path: Path) -> None:
    result = run(tmp_path, [FB, {"type": "optim_step"}, FB])
    assert all("switches" not in c.extra for c in result.calls)
    assert "switch_s" not in result.summary() and result.inference == {}


def test_separate_devices_have_no_shared_state_and_forward_samples(tmp_path: Path) -> None:
    e = Endpoint.model_validate(endpoint_body(placement={"colocate_all": False}))
    assert not colocated(e)
    requests = [{"type": "save_weights_for_sampler"}, SAMPLE, FB]
    apart = run(tmp_path, requests, placement={"colocate_all": False})
    assert apart.inference["mode"] == "forwarded" and "colocation" not in apart.inference
    assert all("switches" not in c.extra for c in apart.calls)
    save = next(c for c in apart.calls if c.kind == "save_weights_for_sampler")
    shared = run(tmp_path, requests)
    shared_save = next(c for c in shared.calls if c.kind == "save_weights_for_sampler")
    assert 0 < save.duration_s < shared_save.duration_s  # an NCCL broadcast, without vLLM's start on the call


def test_cpu_profiles_are_not_colocated() -> None:
    """vLLM's CPU platform has no sleep mode (``vllm/config/model.py`` refuses ``enable_sleep_mode``)."""
    e = Endpoint.model_validate(endpoint_body(hardware={"profile": "cpu", "device_memory_gib": 16.0, "reserve_gib": 0.5}))
    assert not colocated(e)


def test_explain_says_what_was_on_the_device_and_collapses_repeats() -> None:
    from skyrl_sim.reports.memory_explain import explain_table

    result = PluginHost().run(load_scenario(SCENARIOS / "colocated_vllm_start.yaml").resolve("util-0.99"), "sim")
    first, *rest = explain_table(result)
    title = str(first.title)
    assert "OOM in vllm_start (request_memory)" in title and "fails requests 1" in title
    assert "Free memory on device cuda:0" in title
    assert [str(c.header) for c in first.columns] == ["on the device", "state", "GiB"]
    assert rest and all("the same vllm_start failure as call 0" in str(t.title) for t in rest)


def test_the_trace_shows_each_switch_inside_its_call() -> None:
    from skyrl_sim.reports.trace import trace_events

    result = PluginHost().run(load_scenario(SCENARIOS / "colocated_vllm_start.yaml").resolve("util-0.90"), "sim")
    events = trace_events([result])
    save = next(e for e in events if e.get("cat") == "call" and e["name"] == "save_weights_for_sampler")
    switches = [e for e in events if e.get("cat") == "switch" and save["ts"] <= e["ts"] < save["ts"] + save["dur"]]
    assert [e["name"] for e in switches][:2] == ["switch: trainer_offload", "switch: vllm_start"]
    assert sum(e["dur"] for e in switches) <= save["dur"] + 1e-6  # the switches are part of the call's time
    assert save["args"]["switch_s"] > 0


def test_a_sweep_moves_utilization_and_placement() -> None:
    from skyrl_sim.commands.sweep import find_max_in_grid, parse_grid, run_sweep

    util, placement = "inference.gpu_memory_utilization", "placement.colocate_all"
    axes = parse_grid([f"{util}=0.9,0.974,0.975", f"{placement}=true,false"])
    path = str(SCENARIOS / "colocated_vllm_start.yaml")
    sweep = run_sweep(path, axes, variant="util-0.90", require="completed", workers=1)
    by = {(p.settings[util], p.settings[placement]): p for p in sweep.points}
    assert by[(0.974, True)].passed and not by[(0.975, True)].passed  # free 136.18 GiB against the budget
    assert by[(0.975, True)].oom
    # vLLM's own devices hold no trainer, but an awake engine near its whole device leaves no room for the merged
    # sync's packed receive buckets (SkyRL PR #1934): from 0.974 the broadcast runs out there
    assert by[(0.9, False)].passed and not by[(0.974, False)].passed and by[(0.974, False)].oom
    # the switches (vLLM's start among them) are on the shared engine's calls; forwarded, they are not
    assert by[(0.9, True)].summary["makespan_s"] > by[(0.9, False)].summary["makespan_s"]
    best = {row["others"][placement]: row["max_passing"] for row in find_max_in_grid(sweep, util)}
    assert best == {True: 0.974, False: 0.9}


def test_advise_fixes_a_colocated_start_within_its_devices_and_pays_for_more() -> None:
    """By default the search keeps the endpoint's four GPUs: it lowers vLLM's utilization and never moves vLLM to
    devices of its own. Allowed eight, it tries separate devices (four more), ranks them by GPU-seconds, and labels
    them with what they cost."""
    from skyrl_sim.commands.advise_search import TIE, advise, priced
    from skyrl_sim.commands.advise_space import changes, settings_labels

    path = str(SCENARIOS / "colocated_vllm_start.yaml")
    util, placement = "inference.gpu_memory_utilization", "placement.colocate_all"
    shared = advise(path, variant="util-0.99", workers=1, released_only=True)
    assert shared.baseline.oom_calls and shared.recommended is not None
    assert shared.recommended.settings[util] <= 0.974  # what the start needs beside the offloaded trainer
    assert all(c.devices == 4 and c.settings.get(placement, True) for c in shared.candidates)
    assert shared.device_limit == shared.devices == 4
    roomy = advise(path, variant="util-0.99", workers=1, released_only=True, devices=8)
    separate = [c for c in roomy.candidates if c.settings.get(placement) is False]
    assert separate and all(c.devices == 8 for c in separate)
    for c in separate:  # eight GPUs are paid for: the objective is GPU-seconds
        assert c.objective("makespan") == pytest.approx(8 * c.summary["makespan_s"])
    assert roomy.recommended is not None
    # the best of the safe configurations whose costs are all priced (eager vLLM's slower decode is not: ranked after)
    ranked = priced(roomy.candidates, roomy.base_endpoint)
    assert roomy.recommended in ranked
    fastest = min(c.objective("makespan") for c in ranked)  # of those within TIE, the fewest changes
    assert roomy.recommended.objective("makespan") <= fastest * (1 + TIE)
    moved = min((c for c in separate if c.safe), key=lambda c: c.objective("makespan"))
    assert settings_labels(changes(moved.settings, roomy.base_endpoint), "0.4.0")[placement].startswith(
        "vLLM on devices of its own"
    )


def test_a_mismatched_engine_count_is_warned_about(tmp_path: Path) -> None:
    body = {"hardware": {"devices": 2}, "parallelism": {"dp": 2}}
    result = run(tmp_path, [{"type": "save_weights_for_sampler"}], **body)
    assert any("SkyRL 0.4.0 refuses this" in line for line in result.log)
    matched = run(tmp_path, [{"type": "save_weights_for_sampler"}], inference={"num_engines": 2}, **body)
    assert not any("SkyRL 0.4.0 refuses this" in line for line in matched.log)


def test_a_cache_vllm_cannot_start_with_fails_its_start_and_leaves_training_alone(tmp_path: Path) -> None:
    """A KV cache too small for one longest sequence is vLLM's start failing, never bad input: training runs, the
    save that starts vLLM fails at ``vllm_start`` with the bytes one longest sequence needs, and later training runs
    on."""
    tight = {"num_gpu_blocks_override": 50, "max_model_len": 4096}
    assert run(tmp_path, [FB, {"type": "optim_step"}], inference=tight).request(1).error is None
    result = run(tmp_path, [FB, {"type": "save_weights_for_sampler"}, FB], inference=tight)
    assert result.request(1).status == result.request(3).status == "completed"
    assert result.request(2).status == "failed" and "max seq len (4096)" in (result.request(2).error or "")
    [failed] = result.oom_calls
    assert failed.oom is not None and failed.oom.where["phase"] == "vllm_start"
    assert failed.oom.where["check"] == "kv_cache_size"
    endpoint = Endpoint.model_validate(endpoint_body(inference=tight))
    per_block = bytes_per_block(endpoint, resolve_model("qwen3-8b", Path(".")))
    assert failed.oom.attempted_bytes == (4096 // 16 + 1) * per_block  # one 4,096-token request in 16-token blocks


def test_on_devices_of_its_own_a_vllm_that_cannot_start_fails_each_sample_with_its_words(tmp_path: Path) -> None:
    """Separate devices (``colocate_all: false``): vLLM's profile leaves nothing for the cache at a low utilization;
    the sync that starts it fails at ``vllm_start`` (SkyRL's ``_ensure_inference_engines`` runs before every sync),
    every sample fails with vLLM's start-up message, training is untouched, and the run's inference section says
    why (no engine counters: none started)."""
    low = {"gpu_memory_utilization": 0.1}
    requests = [FB, {"type": "save_weights_for_sampler", "checkpoint": "c"}, {**SAMPLE, "checkpoint": "c"}, FB]
    result = run(tmp_path, requests, inference=low, placement={"colocate_all": False})
    assert [r.status for r in result.requests] == ["completed", "failed", "failed", "completed"]
    [sync] = result.oom_calls
    assert sync.oom is not None and sync.oom.where["phase"] == "vllm_start" and sync.oom.message == NO_KV_MEMORY
    assert "vLLM could not start: No available memory for the cache blocks" in (result.request(3).error or "")
    assert result.inference is not None and "start_refused" in result.inference and "engines" not in result.inference
    started = run(tmp_path, requests, placement={"colocate_all": False})  # the default utilization starts it
    assert all(r.status == "completed" for r in started.requests)


def test_a_checkpoint_sleeps_the_engines_first_on_0_4_0_and_not_on_the_seeds_revision() -> None:
    """SkyRL PR #2065 (in 0.4.0): save_checkpoint and load_checkpoint sleep colocated engines at the training level
    before the dispatch backloads model and optimizer; the seed's revision backloads beside awake engines."""
    small = {"preset": "qwen3-8b", "hidden_size": 1024, "ffn_hidden_size": 3072, "num_layers": 28, "vocab_size": 151936}
    for kind in ("save_weights", "load_weights"):
        d = device(model=small, trainer={"train_base_weights": True}, inference={"gpu_memory_utilization": 0.9})
        steps(d, "save_weights_for_sampler")
        assert steps(d, kind) == ["vllm_sleep (level 2)", "trainer_backload"]  # full fine-tuning: level 2
        assert d.before("sample").error == NO_SYNCED_WEIGHTS  # the level-2 sleep discarded the synced weights
        full, util = {"train_base_weights": True}, {"gpu_memory_utilization": 0.9}
        seed = device(model=small, skyrl_version="pr1874", trainer=full, inference=util)
        steps(seed, "save_weights_for_sampler")
        assert seed.vllm == "awake"
        switch = seed.before(kind)
        assert switch.oom is not None and switch.oom.where["phase"] == "backload"  # beside the awake engines
    lora = device()
    steps(lora, "save_weights_for_sampler")
    assert steps(lora, "save_weights") == ["vllm_sleep (level 1)", "trainer_backload"]


def test_a_failed_start_names_its_step_and_what_stays_while_vllm_sleeps_is_one_named_term() -> None:
    d = device(hardware={"device_memory_gib": 40.0}, inference={"gpu_memory_utilization": 0.9, "vllm_version": "0.26.0"})
    floor = d.while_vllm_sleeps()
    assert floor["vllm_context_bytes"] == floor["trainer_context_bytes"] == int(d.endpoint.hardware.reserve_gib * GIB)
    assert floor["total_bytes"] == sum(v for k, v in floor.items() if k != "total_bytes")
    assert d.training_memory().total_bytes == d.sizes.total - floor["vllm_context_bytes"]
    switch = d.before("save_weights_for_sampler")
    assert switch.oom is not None, "vLLM 0.26.0 at 0.9 of 40 GiB: its graphs and warm-up go past its context + budget"
    where = switch.oom.where
    assert where["phase"] == "vllm_start" and where["start_step"] == where["op"].split(": ")[1]
    assert where["start"]["steps"][0]["step"] == "load_weights" and "while_vllm_sleeps" in where["on_device"]


def test_a_trainer_backload_beside_awake_engines_names_each_process_as_pytorch_does() -> None:
    """PyTorch's message lists every process on the device (``reportProcessMemoryInfo``): the trainer's own memory as
    "this process", vLLM's engine worker on a line of its own, and the device's free memory beside both. Before SkyRL
    PR #2065 a checkpoint's backload ran beside awake engines: the trainer process held its context, not vLLM's
    pools."""
    scenario = load_scenario(SCENARIOS / "public" / "skyrl-pr2065-checkpoint-beside-awake-engines.yaml")
    result = PluginHost().run(scenario.resolve("before-pr2065"), "sim")
    (call,) = [c for c in result.calls if c.oom is not None]
    where, message = call.oom.where, call.oom.message
    device = where["on_device"]
    assert where["step"] == "trainer_backload"
    placed = where["placed_bytes"]  # what the backload placed before its piece that ran out
    free = device["total_bytes"] - device["trainer_bytes"] - device["vllm_bytes"] - placed
    assert where["free_bytes"] == free
    assert f"of which {format_size(free)} is free." in message
    assert f"Process (vLLM's engine worker) has {format_size(device['vllm_bytes'])} memory in use." in message
    assert f"this process has {format_size(device['trainer_bytes'] + placed)} memory in use." in message


def test_a_backload_runs_out_at_its_first_piece_that_crosses_the_free_memory() -> None:
    """SkyRL's ``backload_to_gpu`` (``MegatronStrategy``: ``load_megatron_model_to_gpu``, then
    ``load_megatron_grads_to_gpu``, then ``load_megatron_optimizer``) allocates the DDP parameter buffer, the gradient
    buffer, each fp32 main parameter's shard, then each parameter's two Adam moments. Qwen3-8B full fine-tuning at TP 2
    and DP 2 on a 40 GB card, a checkpoint once the engines sleep (level 2): PyTorch names the allocation that crosses
    the free memory, not the whole 45 GiB backload, and the free memory left once the pieces before it are placed."""
    full = {"train_base_weights": True}
    engines = {"gpu_memory_utilization": 0.7, "tensor_parallel_size": 2, "num_engines": 2}
    d = device(
        hardware={"profile": "a100-40gb", "devices": 4}, trainer=full, parallelism={"tp": 2, "dp": 2}, inference=engines
    )
    steps(d, "save_weights_for_sampler")
    room = d.sizes.total - d.trainer_bytes() - d.vllm_bytes("asleep2")
    whole = d.sizes.trainer_model + d.sizes.trainer_optimizer
    switch = d.before("save_weights")
    assert switch.oom is not None and switch.oom.where["phase"] == "backload"
    pieces = backload_pieces(d.model, d.endpoint, model_part=True, optimizer_part=True)
    assert [p.what for p in pieces[:2]] == ["the DDP parameter buffer", "the DDP gradient buffer"]
    assert pieces[0].count == 1 and pieces[0].nbytes <= d.sizes.trainer_model  # one resize of the whole buffer
    flat = [(p.what, p.nbytes) for p in pieces for _ in range(p.count)]
    placed, index = 0, 0
    while placed + flat[index][1] <= room:  # the pieces one by one, as the allocator sees them
        placed += flat[index][1]
        index += 1
    attempted = switch.oom.attempted_bytes
    assert attempted == flat[index][1] < room < whole
    assert switch.oom.where["piece"] == flat[index][0] == "an Adam moment"
    assert switch.oom.where["free_bytes"] == room - placed < attempted
    assert f"Tried to allocate {format_size(attempted)}." in switch.oom.message
    assert f"of which {format_size(room - placed)} is free." in switch.oom.message
    assert d.trainer_state() == "offloaded"  # a failed switch leaves the state where it failed
