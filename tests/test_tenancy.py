"""Multi-tenancy as SkyRL 0.4.0 runs it: the adapter registry's rules, pinned to SkyRL's own code where it is
installed (the service venv), and the simulator's host memory, swaps, refusals and per-tenant reports."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import yaml

from project_paths import ROOT, SCENARIOS
from skyrl_sim.engine.tenancy import (
    SWAPPING_KINDS,
    AdapterRegistry,
    TenancyError,
    lora_signature,
    signature_mismatch_error,
)
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.reports.trace import trace_events
from skyrl_sim.results.result import RunResult
from skyrl_sim.results.tenants import fairness_p95, tenancy_summary, tenant_rows
from skyrl_sim.schema.scenario import load_scenario

SERVICE = Path(os.environ.get("SKYRL_SERVICE_VENV", ROOT / ".venv-skyrl-service"))
SKYRL = next(iter(sorted(SERVICE.glob("lib/python3*/site-packages/skyrl"))), None)


def registry(**kwargs: object) -> AdapterRegistry:
    reg = AdapterRegistry(lora_signature(8, 32.0), slot_bytes=100, **kwargs)  # type: ignore[arg-type]
    reg.start(["a", "b", "c"])
    return reg


# --------------------------------------------------------------------------- the rules


def test_the_first_model_owns_the_live_adapter_and_others_swap_in_both_ways():
    reg = registry()
    assert reg.live == "a" and reg.host_bytes == 4 * 100  # three slots and the pristine one
    assert reg.swap_for("forward_backward", "a") is None
    swap = reg.swap_for("forward_backward", "b")
    assert (swap.saved, swap.restored, swap.copies) == ("a", "b", 2)
    assert reg.swap_for("optim_step", "b") is None
    assert reg.swap_for("sample", "c") is None  # sampling runs on vLLM, not the trainer's live adapter
    assert reg.swap_for("save_weights_for_sampler", "c").restored == "c"


def test_unloading_the_live_model_leaves_a_stale_state_that_the_next_swap_only_overwrites():
    reg = registry()
    assert reg.unload("a") == "adapter"
    assert reg.live is None and reg.stale
    assert reg.create("d", lora_signature(8, 32)) == "adapter"
    assert reg.live is None  # seeded from pristine; the stale live state is not adopted
    swap = reg.swap_for("forward", "d")
    assert (swap.saved, swap.copies) == (None, 1)
    assert reg.unload("nope") is None


def test_the_last_unload_keeps_the_runtime_warm_unless_told_otherwise():
    warm = registry()
    for model in "abc":
        warm.unload(model)
    assert warm.runtime_up and warm.host_bytes == 100  # the pristine slot stays with the runtime
    assert warm.create("d", lora_signature(8, 32)) == "adapter"
    cold = registry(keep_warm=False)
    assert [cold.unload(m) for m in "abc"] == ["adapter", "adapter", "runtime"]
    assert cold.host_bytes == 0
    assert cold.create("d", lora_signature(8, 32)) == "runtime"
    assert cold.live == "d" and cold.host_bytes_peak == 400


def test_a_different_signature_a_duplicate_or_a_full_host_is_refused():
    reg = registry(host_limit_bytes=450)
    with pytest.raises(TenancyError, match=r"got \(rank, alpha\)=\(16, 32\), first adapter registered with \(8, 32\)"):
        reg.create("d", lora_signature(16, 32.0))
    with pytest.raises(TenancyError, match="Model 'a' already exists"):
        reg.create("a", lora_signature(8, 32))
    with pytest.raises(TenancyError, match=r"5 adapter slots .* tenancy.host_memory_gib"):
        reg.create("d", lora_signature(8, 32))
    assert reg.registered == ["a", "b", "c"]


@pytest.mark.skipif(SKYRL is None, reason="SkyRL's service venv is not installed")
def test_the_refusal_is_skyrls_text_and_alpha_counts_as_an_integer():
    """SkyRL's own message, evaluated from its source, equals ours; and its signature is (int(rank), int(alpha))."""
    from types import SimpleNamespace

    source = (SKYRL / "backends" / "skyrl_train_backend.py").read_text()
    message = next(
        node.exc.args[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Raise) and "LoRA signature mismatch" in ast.unparse(node)
    )
    names = {"model_id": "m", "new_signature": (16, 32), "self": SimpleNamespace(_base_lora_signature=(8, 32))}
    assert eval(compile(ast.Expression(message), "skyrl", "eval"), names) == signature_mismatch_error("m", (16, 32), (8, 32))
    assert "return (int(lora_config.rank), int(lora_config.alpha))" in source
    assert lora_signature(8, 32.9) == (8, 32)


@pytest.mark.skipif(SKYRL is None, reason="SkyRL's service venv is not installed")
def test_the_swapping_operations_are_those_that_call_ensure_active_adapter():
    tree = ast.parse((SKYRL / "backends" / "skyrl_train" / "workers" / "worker_dispatch.py").read_text())
    callers = {
        f.name
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        and any(isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "ensure_active_adapter" for n in ast.walk(f))
    }
    # the dispatch functions each Tinker request type reaches (set_lr comes with optim_step)
    dispatched = {
        "forward": "forward",
        "forward_backward": "forward_backward",
        "optim_step": "optim_step",
        "save_weights": "save_checkpoint",
        "load_weights": "load_checkpoint",
        "save_weights_for_sampler": "save_weights_for_sampler",
    }
    assert set(dispatched) == SWAPPING_KINDS
    assert set(dispatched.values()) <= callers
    assert callers - set(dispatched.values()) == {"forward_from_staged", "forward_backward_from_staged", "set_lr"}


# --------------------------------------------------------------------------- the simulator


def tenants_scenario(tmp_path: Path, clients: list[dict], endpoint: str = "tiny-cpu-tp1", **workload: object) -> Path:
    data = {
        "name": "tenants",
        "endpoint": endpoint,
        "workload": {"clients": clients, **workload},
        "variants": {"default": {"expect": {"completed": 0}}},
    }
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    (tmp_path / "endpoints").mkdir(exist_ok=True)
    for name in (endpoint,):
        (tmp_path / "endpoints" / f"{name}.yaml").write_text((SCENARIOS / "endpoints" / f"{name}.yaml").read_text())
    return path


def tenant(name: str, start: float, requests: list[dict]) -> dict:
    return {"name": name, "model_id": name, "start_s": start, "submit": {"mode": "back_to_back", "gap_s": 0.001},
            "requests": requests}


STEP = [{"type": "forward_backward", "datums": [40, 30]}, {"type": "optim_step"}]


def test_interleaved_tenants_swap_before_each_others_calls_and_the_time_is_in_the_calls(tmp_path):
    path = tenants_scenario(tmp_path, [tenant("a", 0.0, STEP), tenant("b", 0.01, STEP), tenant("c", 0.02, STEP)])
    result = PluginHost().run(load_scenario(path).resolve("default"), "sim")
    swaps = [(c.kind, c.model_id, c.extra["swap"]["saved"]) for c in result.calls if c.extra.get("swap")]
    # one forward_backward call per tenant, then the optim_steps in id order: a is live at the start
    assert swaps == [
        ("forward_backward", "b", "a"),
        ("forward_backward", "c", "b"),
        ("optim_step", "a", "c"),
        ("optim_step", "b", "a"),
        ("optim_step", "c", "b"),
    ]
    summary = tenancy_summary(result)
    slot = result.tenancy["slot_bytes"]
    assert slot == 499_712  # tiny-cpu-tp1's fp32 adapters: 31,232 parameters x 16 bytes
    assert summary["swaps"] == 5 and summary["swap_bytes"] == 10 * slot
    assert summary["host_bytes_peak"] == 4 * slot
    assert 0 < summary["swap_share_of_engine"] < 0.05
    fb = [c for c in result.calls if c.kind == "forward_backward"]
    assert fb[1].duration_s - fb[0].duration_s == pytest.approx(fb[1].extra["swap"]["seconds"], rel=1e-9)
    events = [e for e in trace_events([result]) if e.get("cat") == "swap"]
    assert len(events) == 5 and events[0]["ts"] == round(fb[1].start_s * 1e6, 3)
    assert set(summary["tenants"]) == {"a", "b", "c"} and summary["fairness_p95"] >= 1.0


def test_a_later_create_model_registers_an_adapter_and_the_first_builds_the_runtime(tmp_path):
    clients = [
        tenant("a", 0.0, [{"type": "create_model"}, {"type": "create_model", "lora_config": {"rank": 4, "alpha": 32}}]),
        tenant("b", 0.01, [{"type": "create_model"}, {"type": "unload_model"}]),
    ]
    path = tenants_scenario(tmp_path, clients, loaded_models=[])
    result = PluginHost().run(load_scenario(path).resolve("default"), "sim")
    kinds = [(c.model_id, c.extra.get("tenancy"), c.error) for c in result.calls]
    assert kinds[0] == ("a", "runtime", None)
    assert kinds[1][2] == "Model 'a' already exists"
    assert kinds[2] == ("b", "adapter", None)
    assert kinds[3] == ("b", "adapter", None)  # the unload frees b's slot
    build, register = result.calls[0].duration_s, result.calls[2].duration_s
    assert build > 5.0 > 0.1 > register  # the profile's create_model (base weights) against one slot's registration


def test_a_create_model_past_the_host_memory_fails_with_the_reason_and_its_model_stays_unloaded(tmp_path):
    clients = [
        tenant("a", 0.0, [{"type": "forward_backward", "datums": [20]}]),
        tenant("b", 0.01, [{"type": "create_model"}, {"type": "forward_backward", "datums": [20]}]),
    ]
    path = tenants_scenario(tmp_path, clients, loaded_models=["a"])
    over = {"tenancy.host_memory_gib": 2.5 * 499_712 / 2**30}  # a and the pristine slot fit, a third does not
    result = PluginHost().run(load_scenario(path).resolve("default", over), "sim")
    create = next(c for c in result.calls if c.kind == "create_model")
    assert "host memory per worker exhausted: 3 adapter slots" in create.error
    assert result.request(create.request_ids[0]).status == "failed"
    assert result.request(3).error.startswith("Model b not loaded")


def test_models_loaded_at_the_start_that_do_not_fit_are_bad_input(tmp_path):
    path = tenants_scenario(tmp_path, [tenant("a", 0.0, STEP), tenant("b", 0.01, STEP)])
    from skyrl_sim.errors import UserError

    with pytest.raises(UserError, match="do not fit: create_model b: host memory per worker exhausted: 3 adapter"):
        PluginHost().run(load_scenario(path).resolve("default", {"tenancy.host_memory_gib": 2.5 * 499_712 / 2**30}), "sim")


def test_other_strategies_keep_no_adapter_store(tmp_path):
    path = tenants_scenario(tmp_path, [tenant("a", 0.0, STEP), tenant("b", 0.01, STEP)], endpoint="skyrl-jax-cpu")
    result = PluginHost().run(load_scenario(path).resolve("default"), "sim")
    assert not any(c.extra.get("swap") for c in result.calls) and result.tenancy.get("slot_bytes") is None


# --------------------------------------------------------------------------- per-tenant rows


def test_tenant_rows_fairness_and_the_json_round_trip():
    times = [(0.0, 0.1, 1.0, "completed"), (0.0, 0.2, 3.0, "completed"), (0.0, None, None, "failed")]
    rows = tenant_rows(["a", "b", "b"], times)
    assert rows["a"] == {"requests": 1, "completed": 1, "failed": 0, "latency_p50_s": 1.0, "latency_p95_s": 1.0,
                         "queue_wait_p95_s": 0.1}
    assert rows["b"]["failed"] == 1 and rows["b"]["latency_p95_s"] == 3.0
    assert fairness_p95(rows) == 3.0
    assert fairness_p95({"a": rows["a"]}) is None
    result = RunResult("s", "v", "sim", "e", tenancy={"slot_bytes": 5, "host_bytes_peak": 10, "host_memory_bytes": None})
    back = RunResult.from_dict(json.loads(result.to_json()))
    assert back.tenancy == result.tenancy and back.summary()["tenancy"]["slot_bytes"] == 5


def test_the_tenant_suite_validates_and_its_summary_states_the_swaps(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("validate_script", ROOT / "scripts" / "validate.py")
    validate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(validate)
    assert validate.TENANT_SUITES["tiny-cpu-tp2-tenants"] == "tiny-cpu-tp2"
    out = tmp_path / "tiny-cpu-tp1-tenants"
    measured = [validate.Measured(SCENARIOS / name) for name in validate.TENANT_SCENARIOS]
    summary = validate.validate_endpoint("tiny-cpu-tp1", measured, out, "sim", 0.3, suite="tiny-cpu-tp1-tenants")
    assert summary["calls_identical"] and summary["swaps_identical"]
    assert summary["swaps"] == 20 and summary["tenants"] == 5  # 10 per variant; the lifecycle clients' model ids too
    md = (out / "summary.md").read_text()
    assert "| adapter swaps identical | yes (20 swaps, 5 model ids) | 100% |" in md
    assert "scripts/validate.py --suite tiny-cpu-tp1-tenants" in md


def test_expected_swaps_and_host_memory_are_checked(tmp_path):
    from skyrl_sim.results.expectations import unmet
    from skyrl_sim.schema.expect import Expectations, Range

    path = tenants_scenario(tmp_path, [tenant("a", 0.0, STEP), tenant("b", 0.01, STEP)])
    result = PluginHost().run(load_scenario(path).resolve("default"), "sim")
    slot_gib = 499_712 / 2**30
    assert unmet(result, Expectations(swaps=3, host_memory_peak_gib=Range(min=2.9 * slot_gib, max=3.1 * slot_gib))) == []
    problems = unmet(result, Expectations(swaps=2, host_memory_peak_gib=Range(max=slot_gib)))
    assert problems[0] == "expected 2 adapter swaps, got 3"
    assert "host memory peak 0.001 GiB, expected within [None" in problems[1]


def test_the_real_adapter_store_swaps_state_with_copies_and_seeds_from_pristine():
    torch = pytest.importorskip("torch")
    from skyrl_sim_plugins.megatron_vllm.adapter_store import AdapterStore

    live = [torch.zeros(4), torch.zeros(2, 3)]
    storages = [t.untyped_storage().data_ptr() for t in live]
    store = AdapterStore(live, lora_signature(8, 32), host_limit_bytes=None, keep_warm=True)
    for model in ("a", "b"):
        store.create(model, lora_signature(8, 32))
    assert store.slot_bytes == 40 and store.host_bytes == 120
    live[0] += 1.0  # a's training
    assert store.swap_to("forward_backward", "b")["saved"] == "a"
    assert live[0].tolist() == [0.0] * 4  # b starts from the pristine adapter
    live[1] += 2.0
    swap = store.swap_to("optim_step", "a")
    assert (swap["saved"], swap["restored"], swap["bytes"]) == ("b", "a", 80)
    assert live[0].tolist() == [1.0] * 4 and live[1].tolist() == [[0.0] * 3] * 2
    assert [t.untyped_storage().data_ptr() for t in live] == storages  # copies into the same storage
    assert store.swap_to("forward", "a") is None
    store.unload("a")
    store.create("c", lora_signature(8, 32))
    assert store.swap_to("forward", "c")["saved"] is None  # the unloaded a's live state is not saved anywhere
    assert live[0].tolist() == [0.0] * 4
    store.swap_to("forward", "b")
    assert live[1].tolist() == [[2.0] * 3] * 2
