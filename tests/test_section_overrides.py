"""Overrides of a whole section merge into it (the other keys keep their values, never their defaults), an empty
mapping or an empty value is an error, and ``model`` is replaced whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from project_paths import SCENARIOS
from scenario_text import GOOD, run_cli, write
from skyrl_sim.errors import ScenarioError, UserError
from skyrl_sim.schema.overrides import apply_override, parse_value
from skyrl_sim.schema.scenario import ScenarioFile, load_scenario

SEED = SCENARIOS / "queue_drain_17.yaml"


def test_a_section_set_in_a_variant_merges_into_the_endpoints(tmp_path: Path) -> None:
    """The seed endpoint sets recompute and micro sizes; a variant that sets one trainer key as a section keeps them."""
    text = SEED.read_text().replace(
        "variants:", "variants:\n  sectioned:\n    set: {trainer: {micro_train_batch_size_per_gpu: 8}}\n", 1
    )
    text = text.replace(
        "endpoint: qwen3.6-27b-h200-tp4", f"endpoint: {SCENARIOS / 'endpoints' / 'qwen3.6-27b-h200-tp4.yaml'}"
    )
    scenario = ScenarioFile(write(tmp_path, text))
    sectioned = scenario.resolve("sectioned").endpoint.trainer
    dotted = load_scenario(SEED).resolve("no-cap", {"trainer.micro_train_batch_size_per_gpu": 8}).endpoint.trainer
    base = load_scenario(SEED).resolve("no-cap").endpoint.trainer
    assert sectioned == dotted
    assert sectioned.micro_train_batch_size_per_gpu == 8 != base.micro_train_batch_size_per_gpu
    assert sectioned.recompute == base.recompute and sectioned.fused_lm_head_logprob == base.fused_lm_head_logprob


def test_a_section_on_the_command_line_merges(run_sim) -> None:
    """``--set 'engine={...}'`` is the dotted keys it names: the same run, byte for byte."""
    merged = run_sim("queue_drain_17.yaml", "cap-aware", sets={"trainer": {"micro_train_batch_size_per_gpu": 8}})
    dotted = run_sim("queue_drain_17.yaml", "cap-aware", sets={"trainer.micro_train_batch_size_per_gpu": 8})
    assert merged.to_json() == dotted.to_json()


def test_nested_sections_merge_key_by_key() -> None:
    data = {"trainer": {"recompute": {"method": "uniform", "num_layers": 1}, "micro_train_batch_size_per_gpu": 16}}
    out = apply_override(data, "trainer", {"recompute": {"method": "block"}}, "--set")
    assert out == {"trainer": {"recompute": {"method": "block", "num_layers": 1}, "micro_train_batch_size_per_gpu": 16}}
    assert data["trainer"]["recompute"]["method"] == "uniform"  # copy on write: the input is left as it was
    assert apply_override(data, "trainer.recompute", {"num_layers": 4}, "--set")["trainer"]["recompute"] == {
        "method": "uniform",
        "num_layers": 4,
    }


def test_model_is_replaced_whole(tmp_path: Path) -> None:
    """A model reference is one choice: ``{preset: tiny-dense}`` must not keep the old mapping's overrides."""
    text = GOOD.replace("model: tiny-dense", "model: {preset: tiny-dense, num_layers: 3}")
    scenario = ScenarioFile(write(tmp_path, text))
    assert scenario.resolve("default").model.num_layers == 3
    assert scenario.resolve("default", {"model": {"preset": "tiny-dense"}}).model.num_layers == 2


@pytest.mark.parametrize("key", ["engine", "trainer", "workload.clients.0.submit"])
def test_an_empty_section_is_refused(key: str) -> None:
    with pytest.raises(ScenarioError, match="empty mapping changes nothing"):
        apply_override(
            {"engine": {}, "trainer": {}, "clients": [{"submit": {}}]}, key.removeprefix("workload."), {}, "--set"
        )


def test_engine_empty_mapping_on_the_command_line_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["check", str(SEED), "--variant", "cap-aware", "--set", "engine={}"], capsys)
    assert code == 2 and "engine" in out and "empty mapping" in out and "Traceback" not in out


@pytest.mark.parametrize("value", ["", " ", "\t"])
def test_an_empty_set_value_is_an_error_not_unlimited(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UserError, match="empty"):
        parse_value(value, "--set engine.forward_backward_max_request_count")
    code, out = run_cli(
        ["check", str(SEED), "--variant", "cap-aware", "--set", f"engine.forward_backward_max_request_count={value}"],
        capsys,
    )
    assert code == 2 and "forward_backward_max_request_count" in out and "empty" in out


@pytest.mark.parametrize("values", ["1,,2", "1,2,", ",1", "1, ,2"])
def test_an_empty_grid_value_is_an_error(values: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(
        ["sweep", str(SEED), "--variant", "cap-aware", "--grid", f"engine.forward_backward_max_request_count={values}"],
        capsys,
    )
    assert code == 2 and "is empty" in out and "Traceback" not in out


def test_null_still_means_unlimited(run_sim) -> None:
    run = run_sim(
        "queue_drain_17.yaml", "cap-aware", sets={"engine.forward_backward_max_request_count": parse_value("null")}
    )
    assert run.summary()["calls"] < 17  # no cap: the drain is batched
