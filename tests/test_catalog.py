"""Shipped scenarios and endpoints, ``skyrl-sim endpoints`` and ``skyrl-sim schema``."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

from skyrl_sim.cli import main
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.schema.shipped import shipped_endpoints, shipped_scenarios

ROOT = Path(__file__).resolve().parents[1]


def test_seed_scenarios_and_endpoints_ship_as_package_data():
    assert {"queue_drain_17", "queue_drain_193", "moe_r3"} <= set(shipped_scenarios())
    assert "qwen3.6-27b-h200-tp4" in shipped_endpoints()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["skyrl_sim.scenarios"] == "scenarios" and "skyrl_sim.scenarios" in config["packages"]
    assert "endpoints/*.yaml" in config["package-data"]["skyrl_sim.scenarios"]


def test_a_copied_scenario_finds_shipped_endpoints_from_anywhere(tmp_path, monkeypatch):
    copy = tmp_path / "mine.yaml"
    shutil.copy(ROOT / "scenarios" / "queue_drain_17.yaml", copy)
    monkeypatch.chdir(tmp_path)
    assert load_scenario(copy).endpoint_source.endswith("qwen3.6-27b-h200-tp4.yaml")
    # and a README path works where the repository is not
    assert load_scenario("scenarios/queue_drain_17.yaml").path == shipped_scenarios()["queue_drain_17"]


def test_endpoints_list_and_show(capsys):
    assert main(["endpoints"]) == 0
    out = capsys.readouterr().out
    assert "qwen3.6-27b-h200-tp4" in out and "tiny-cpu-tp1" in out
    assert main(["endpoints", "show", "tiny-cpu-tp1"]) == 0
    out = capsys.readouterr().out
    assert "iteration_sleep_s: 0.1" in out  # defaults filled in
    assert main(["endpoints", "show", "no-such-endpoint"]) == 2
    assert "known:" in capsys.readouterr().err


def test_schema_describes_scenario_and_endpoint_files(capsys):
    assert main(["schema"]) == 0
    scenario = json.loads(capsys.readouterr().out)
    assert scenario["$schema"].startswith("https://json-schema.org/")
    assert {"name", "endpoint", "workload", "variants"} <= set(scenario["properties"])
    assert {"$ref": "#/$defs/Endpoint"} in scenario["properties"]["endpoint"]["anyOf"]
    assert scenario["$defs"]["Endpoint"]["additionalProperties"] is False
    assert main(["schema", "endpoint"]) == 0
    endpoint = json.loads(capsys.readouterr().out)
    hardware = endpoint["$defs"]["Hardware"]["properties"]
    memory = next(branch for branch in hardware["device_memory_gib"]["anyOf"] if branch.get("type") == "number")
    assert memory["exclusiveMinimum"] == 0 and "maximum" in memory  # a number in bounds, or null: the profile's
    assert {"type": "null"} in hardware["device_memory_gib"]["anyOf"]
