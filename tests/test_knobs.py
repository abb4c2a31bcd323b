"""The knob table (``commands.knobs``): every knob is a SkyRL setting with its true SkyRL key and versions, none is a
modelling mode, devices are counted, and ``advise`` recommends only what the version has, labelled, within
``--devices``."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from project_paths import ROOT, SCENARIOS
from scenario_text import run_cli
from skyrl_sim.commands.advise_space import search_axes, settings_labels
from skyrl_sim.commands.from_skyrl import MAPPED
from skyrl_sim.commands.knobs import (
    BACKEND_CONFIG,
    BY_KEY,
    CAP,
    CAP_AWARE,
    DERIVED,
    JAX_BACKEND_CONFIG,
    KNOBS,
    MODELLING,
    devices_needed,
    label,
    modelling_notes,
)
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.schema.skyrl_versions import PR_SETTING_LABEL

SERVICE = Path(os.environ.get("SKYRL_SERVICE_VENV", ROOT / ".venv-skyrl-service"))
SKYRL = next(iter(sorted(SERVICE.glob("lib/python3*/site-packages/skyrl"))), None)
COLOCATED = str(SCENARIOS / "colocated_vllm_start.yaml")
PLACEMENT = "placement.colocate_all"


def endpoint_field(dotted: str) -> bool:
    """Whether ``dotted`` names a field of the endpoint schema."""
    model: Any = Endpoint
    for part in dotted.split("."):
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return False
        model = fields[part].annotation
        model = next((a for a in getattr(model, "__args__", ()) if hasattr(a, "model_fields")), model)
    return True


def test_every_knob_key_is_an_endpoint_key_and_none_is_a_modelling_mode():
    keys = [key for knob in KNOBS for key in knob.skyrl_keys]
    assert len(keys) == len(set(keys)), "an endpoint key belongs to one knob"
    for key in keys:
        assert endpoint_field(key), key
        assert key not in MODELLING, key
    for key in MODELLING:
        assert endpoint_field(key), key
    assert "engine.sampling" in MODELLING


def test_the_skyrl_keys_agree_with_endpoints_from_skyrl():
    """``endpoints from-skyrl`` reads SkyRL's keys into endpoint keys; the knobs write them back the same way."""
    for knob in KNOBS:
        for key, skyrl_key in knob.skyrl_keys.items():
            if skyrl_key in MAPPED:
                assert MAPPED[skyrl_key][0] == key, (skyrl_key, key)


@pytest.mark.skipif(SKYRL is None, reason="the skyrl==0.4.0 wheel is not installed (.venv-skyrl-service)")
def test_every_released_knob_is_a_field_of_skyrl_0_4_0():
    """Each SkyRL key a knob names on 0.4.0 is a field of that wheel's config (SkyRL-Train's dataclasses, the
    transformer config's defaults, or the JAX backend's config)."""
    assert SKYRL is not None
    config = (SKYRL / "train" / "config" / "config.py").read_text()
    jax = (SKYRL / "backends" / "jax.py").read_text()
    for knob in KNOBS:
        if not knob.available("0.4.0"):
            continue
        for key in knob.skyrl_keys:
            for skyrl_key in knob.skyrl_settings(key, "full" if key.endswith("granularity") else 1):
                name = skyrl_key.rsplit(".", 1)[-1]
                text = jax if knob.where == JAX_BACKEND_CONFIG else config
                assert re.search(rf"^\s+{name}: ", text, re.M) or f'"{name}":' in text, (knob.name, skyrl_key)


def test_version_labels_are_per_key_and_true():
    """SkyRL 0.4.0 has colocate_all (PlacementConfig); only PR #1874's two settings are in no release."""
    assert label(PLACEMENT, "0.4.0") == "" and BY_KEY[PLACEMENT].available("0.4.0") and BY_KEY[PLACEMENT].released
    for key in (CAP, CAP_AWARE):
        assert label(key, "0.4.0").startswith(PR_SETTING_LABEL) and "SkyRL 0.4.0 has no such setting" in label(key, "0.4.0")
        assert label(key, "pr1874") == "" and not BY_KEY[key].released
    assert "not a SkyRL setting" in label("engine.sampling", "0.4.0")
    micro = "trainer.micro_train_batch_size_per_gpu"
    labels = settings_labels({CAP: 2, CAP_AWARE: True, PLACEMENT: False, micro: 2}, "0.4.0")
    assert set(labels) == {CAP, CAP_AWARE, PLACEMENT}  # one footnote per key that needs one
    assert labels[PLACEMENT].startswith("vLLM on devices of its own") and PR_SETTING_LABEL not in labels[PLACEMENT]
    assert settings_labels({CAP: None, CAP_AWARE: False, PLACEMENT: True}, "0.4.0") == {}  # held off: nothing to say


def test_recompute_and_parallelism_are_written_as_skyrl_writes_them():
    recompute = BY_KEY["trainer.recompute.granularity"]
    assert recompute.skyrl_settings("trainer.recompute.granularity", "none") == {"trainer.gradient_checkpointing": False}
    assert recompute.skyrl_settings("trainer.recompute.num_layers", 32) == {
        "trainer.policy.megatron_config.transformer_config_kwargs.recompute_num_layers": 32
    }
    tp = BY_KEY["parallelism.tp"]
    assert tp.skyrl_settings("parallelism.tp", 2) == {"trainer.policy.megatron_config.tensor_model_parallel_size": 2}
    assert tp.skyrl_keys["parallelism.dp"] == DERIVED and tp.skyrl_settings("parallelism.dp", 2) == {}


def test_devices_needed_counts_vllm_on_devices_of_its_own():
    shared = load_scenario(COLOCATED).resolve("util-0.90").endpoint
    assert devices_needed(shared) == shared.hardware.devices == 4
    separate = load_scenario(COLOCATED).resolve("util-0.90", {PLACEMENT: False, "inference.tensor_parallel_size": 2})
    assert devices_needed(separate.endpoint) == 4 + 4 * 2  # four engines of two devices each beside the trainer


def sampling_variant(**sets: Any) -> Any:
    return load_scenario(COLOCATED).resolve("util-0.90", sets)


@pytest.mark.parametrize("strategy", ["megatron", "fsdp", "jax"])
def test_no_modelling_mode_is_ever_searched(strategy):
    variant = sampling_variant(**{"trainer.strategy": strategy})
    for axis in search_axes(variant, []):
        for value in axis.values:
            assert not set(value) & set(MODELLING), (axis.name, value)
    names = {axis.name for axis in search_axes(variant, [])}
    # SkyRL caps a sample batch by sample_max_num_sequences on the JAX backend only (tinker/engine.py)
    assert ("sample batch" in names) is (strategy == "jax")
    assert ("placement" in names) is (strategy != "jax")


def test_check_notes_a_modelling_mode(capsys):
    variant = sampling_variant(**{"engine.sampling": "serial"})
    assert [note.split(":")[0] for note in modelling_notes(variant.endpoint)] == ["engine.sampling=serial"]
    assert modelling_notes(sampling_variant().endpoint) == []
    code, out = run_cli(["check", COLOCATED, "--variant", "util-0.90", "--set", "engine.sampling=serial"], capsys)
    assert code == 0 and "note: engine.sampling=serial: the simulator's sampling mode, not a SkyRL setting" in out


def test_advise_released_only_on_the_colocated_start(tmp_path, capsys):
    """The issue's command: only SkyRL 0.4.0 settings, each with its SkyRL key, no modelling mode, no PR setting, and
    no more GPUs than the endpoint's four."""
    out = tmp_path / "advice.json"
    code, text = run_cli(["advise", COLOCATED, "--released-only", "--jobs", "1", "--json", str(out)], capsys)
    assert code == 0
    advice = orjson.loads(out.read_bytes())
    assert advice["mode"] == "released" and advice["devices"] == advice["device_limit"] == 4
    for candidate in advice["candidates"]:
        assert candidate["devices"] <= 4
        assert not set(candidate["settings"]) & {*MODELLING, CAP, CAP_AWARE}
    assert advice["recommended"]["devices"] == 4 and advice["labels"] == {}
    known = {s for knob in KNOBS for key in knob.skyrl_keys for s in knob.skyrl_settings(key, "full")}
    assert advice["skyrl_settings"]
    for row in advice["skyrl_settings"]:
        assert row["where"] == BACKEND_CONFIG and row["label"] == "" and row["skyrl"], row
        assert set(row["skyrl"]) <= known | {"trainer.gradient_checkpointing"}, row
    assert "SkyRL 0.4.0 settings:" in text and "needs 4 GPUs, no more than now (--devices 4)" in text
    for wrong in ("PR #1874", "engine.sampling", "sampling=", "has no such setting"):
        assert wrong not in text, wrong
    # eager vLLM looks faster to the time model (it prices graphs' capture and pools, not their faster decode): a
    # configuration with CUDA graphs passes here, so eager mode is not recommended
    assert "inference.enforce_eager" not in advice["recommended"]["changes"], advice["recommended"]["changes"]
    assert "enforce_eager" not in text.split("recommended:")[1].split("search:")[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--devices", "3"], "--devices 3: the starting configuration already needs 4 devices"),
        (["--devices", "0"], "--devices"),
        (["--devices", "two"], "--devices"),
        (["--released-only", "--what-if"], "contradict"),
    ],
)
def test_advise_device_limit_and_modes_bad_input(argv, needle, capsys):
    code, out = run_cli(["advise", COLOCATED, "--jobs", "1", *argv], capsys)
    assert code == 2 and needle in out


def test_a_sweep_labels_a_modelling_mode_and_counts_each_points_devices():
    """A sweep of the sampling mode says it is no SkyRL setting; a sweep of the placement shows each point's GPUs."""
    from skyrl_sim.commands.sweep import parse_grid, run_sweep, sweep_table

    axes = parse_grid(["placement.colocate_all=true,false", "engine.sampling=continuous,serial"])
    sweep = run_sweep(COLOCATED, axes, variant="util-0.90", require="completed", workers=1)
    assert set(sweep.labels) == {"engine.sampling"} and "not a SkyRL setting" in sweep.labels["engine.sampling"]
    assert {p.settings[PLACEMENT]: p.devices for p in sweep.points} == {True: 4, False: 8}
    assert all(point["devices"] in (4, 8) for point in sweep.to_dict()["points"])
    table = sweep_table(sweep)
    assert [c.header for c in table.columns][:2] == ["colocate_all", "sampling *"]
    assert "GPUs" in [c.header for c in table.columns]
    assert "* engine.sampling: the simulator's sampling mode" in str(table.caption)
    same = run_sweep(COLOCATED, parse_grid(["inference.gpu_memory_utilization=0.9,0.8"]), variant="util-0.90", workers=1)
    assert same.labels == {} and "GPUs" not in [c.header for c in sweep_table(same).columns]


def test_a_value_whose_cost_is_not_priced_ranks_after_every_priced_safe_configuration():
    """Eager vLLM (``unpriced_changes``) is recommended only when no configuration with CUDA graphs passes, however
    much faster the time model finds it, and it is footnoted with what it costs."""
    from skyrl_sim.commands.advise_search import best, recommend
    from skyrl_sim.commands.advise_space import settings_labels
    from skyrl_sim.commands.knobs import EAGER_COST, unpriced_changes
    from test_advise import fake

    base = {"inference": {"enforce_eager": False}}
    eager = fake({"inference.enforce_eager": True}, 20, makespan=1.0)
    graphs = fake({"inference.enforce_eager": False}, 20, makespan=3.0)
    graphs_oom = fake({"inference.enforce_eager": False}, 20, oom=1, makespan=3.0)
    assert unpriced_changes({"inference.enforce_eager": True}) == {"inference.enforce_eager": EAGER_COST}
    assert unpriced_changes({"inference.enforce_eager": False}) == {}
    assert best([eager, graphs], "makespan", base) is graphs
    assert recommend([eager, graphs], "makespan", base) is graphs
    assert recommend([eager, graphs_oom], "makespan", base) is eager  # the only safe one
    # an endpoint already eager changes nothing by staying so: ranked on its objective alone
    assert recommend([eager, graphs], "makespan", {"inference": {"enforce_eager": True}}) is eager
    assert settings_labels({"inference.enforce_eager": True}, "0.4.0") == {"inference.enforce_eager": EAGER_COST}


def test_a_vllm_the_skyrl_version_does_not_pin_is_said_to_be_a_what_if(tmp_path, capsys):
    """``inference.vllm_version`` other than the SkyRL revision's pin: ``check`` notes it under the variant, a sweep of
    it footnotes the key; the pinned version itself, or none given, says nothing."""
    from skyrl_sim.commands.sweep import parse_grid, run_sweep
    from skyrl_sim.schema.vllm_versions import PIN_LABEL, SKYRL_VLLM_PINS

    set_version = ["check", COLOCATED, "--variant", "util-0.90", "--set"]
    code, out = run_cli([*set_version, "inference.vllm_version=0.23.0"], capsys)
    assert code == 0
    assert "note: inference.vllm_version=0.23.0: SkyRL 0.4.0 pins vLLM 0.30.0 (its pyproject.toml), so this run is a " \
        "what-if" in out
    code, out = run_cli([*set_version, f"inference.vllm_version={SKYRL_VLLM_PINS['0.4.0']}"], capsys)
    assert code == 0 and "vllm_version" not in out
    # check --json's verdict carries what the text prints under the variant and the RunResult's notes do not
    path = tmp_path / "check.json"
    code, _ = run_cli([*set_version, "inference.vllm_version=0.23.0", "--quiet", "--json", str(path)], capsys)
    verdict = orjson.loads(path.read_bytes())["runs"][0]["verdict"]
    assert code == 0 and verdict["status"] == "PASS"
    assert [note.split(":")[0] for note in verdict["setting_notes"]] == ["inference.vllm_version=0.23.0"]
    sweep = run_sweep(COLOCATED, parse_grid(["inference.vllm_version=0.23.0,0.30.0"]), variant="util-0.90", workers=1)
    assert sweep.labels == {"inference.vllm_version": PIN_LABEL} and "0.4.0: 0.30.0" in PIN_LABEL


def test_a_vllm_setting_of_a_run_without_vllm_is_said_to_change_nothing(capsys):
    """An ``inference.*`` key given to a run where vLLM never starts (no sample and no weight sync, or the JAX backend)
    is noted under the variant; one given where vLLM runs is not."""
    from skyrl_sim.commands.knobs import idle_vllm_notes
    from skyrl_sim.schema.scenario import load_scenario

    drain = str(SCENARIOS / "queue_drain_17_tiny.yaml")
    code, out = run_cli(["check", drain, "--variant", "cap-aware", "--set", "inference.enforce_eager=true"], capsys)
    assert code == 0 and "note: inference.enforce_eager: changes nothing in this run: the workload has no sample" in out
    mixed = SCENARIOS / "sampling_mixed_tiny.yaml"
    on_jax = load_scenario(mixed, "skyrl-jax-cpu")
    notes = idle_vllm_notes(on_jax.resolve(on_jax.variant_names[0], {"inference.max_num_seqs": 8}))
    assert "inference.max_num_seqs: changes nothing in this run: trainer.strategy jax samples without vLLM" in notes
    on_vllm = load_scenario(mixed)
    assert idle_vllm_notes(on_vllm.resolve(on_vllm.variant_names[0], {"inference.max_num_seqs": 8})) == []
    code, out = run_cli(["check", COLOCATED, "--variant", "util-0.90", "--quiet"], capsys)
    assert "changes nothing" not in out


def test_a_derived_key_is_said_to_be_derived_not_written_in_the_backend_config():
    """DP follows from the GPUs and TP: the recommendation says SkyRL derives it (it said "nothing to write; SkyRL-Train's
    --backend-config"); cap-aware padding, PR #1874's code with no key, says so."""
    from types import SimpleNamespace

    from skyrl_sim.commands.advise_report import skyrl_lines
    from skyrl_sim.commands.knobs import skyrl_settings

    changes = {"parallelism.tp": 2, "parallelism.dp": 1, CAP_AWARE: True}
    lines = skyrl_lines(SimpleNamespace(skyrl_settings=lambda: skyrl_settings(changes, "pr1874")))
    assert "trainer.policy.megatron_config.tensor_model_parallel_size=2  (SkyRL-Train's --backend-config)" in lines
    assert "(parallelism.dp=1: nothing to write; derived by SkyRL from the settings above)" in lines
    assert "(engine.cap_aware_padding=true: nothing to write; PR #1874's code (always on there; no key))" in lines


def test_a_sweep_of_eager_mode_footnotes_its_unpriced_cost():
    """A sweep point in eager mode looks faster than it is (the time model does not price graphs' faster decode): the
    key is footnoted; a sweep of a setting with no such cost is not."""
    from skyrl_sim.commands.knobs import EAGER_COST
    from skyrl_sim.commands.sweep import Axis, prepare_labelled

    def labels(key: str, values: tuple[Any, ...]) -> dict[str, str]:
        return prepare_labelled(COLOCATED, None, "util-0.90", {}, [Axis(key, values)], "completed", None)[3]

    assert labels("inference.enforce_eager", (False, True)) == {"inference.enforce_eager": EAGER_COST}
    assert labels("inference.enforce_eager", (False,)) == {}
    assert labels("inference.max_num_seqs", (256, 512)) == {}


def test_within_the_tie_a_setting_the_version_has_is_recommended_over_a_what_if():
    """``--what-if`` on SkyRL 0.4.0: PR #1874's cap-aware padding and a micro batch of 4 pad the same rows; the
    recommendation is the setting 0.4.0 has, though the what-if leaves more headroom."""
    from skyrl_sim.commands.advise_search import recommend
    from test_advise import fake

    micro = {"micro_train_batch_size_per_gpu": 16}
    base = {"skyrl_version": "0.4.0", "engine": {"cap_aware_padding": False}, "trainer": micro}
    what_if = fake({CAP_AWARE: True}, 10, makespan=2.0)
    released = fake({"trainer.micro_train_batch_size_per_gpu": 4}, 20, makespan=2.0)
    assert recommend([what_if, released], "makespan", base) is released
    faster = fake({CAP_AWARE: True}, 10, makespan=1.0)  # better beyond the tie: the what-if is the advice
    assert recommend([faster, released], "makespan", base) is faster


def test_what_if_searches_what_the_version_has_too_and_recommends_it_when_as_good():
    """``--what-if`` on colocated_vllm_start (SkyRL 0.4.0): PR #1874's cap-aware padding is searched, and so is the
    version's own space (without it), where a micro batch of 4 pads as few rows; the recommendation is 0.4.0's."""
    from skyrl_sim.commands.advise_search import TIE, advise, priced

    advice = advise(COLOCATED, variant="util-0.99", workers=1, what_if=True)
    assert any(c.settings.get(CAP_AWARE) for c in advice.candidates)  # the what-if was searched
    assert advice.recommended is not None
    changed = advice.overrides()
    assert CAP_AWARE not in changed and CAP not in changed, changed
    best = min(c.objective("makespan") for c in priced(advice.candidates, advice.base_endpoint))
    assert advice.recommended.objective("makespan") <= best * (1 + TIE)
