"""Portable outputs: a written file names the files it refers to relative to itself, so it can be committed and used
from any folder or machine: ``endpoints from-skyrl``'s ``model.config`` (relative to the current folder on stdout),
``import`` and ``replay --scenario-out``'s endpoint file, ``calibrate``'s base profile."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from project_paths import ROOT
from scenario_text import run_cli

MODEL = ROOT / "tests" / "data" / "skyrl_launches" / "tiny-qwen3"
SCENARIO = """name: s
endpoint: {endpoint}
workload:
  clients:
    - requests:
        - {{type: forward_backward, lengths: [10, 20]}}
"""


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(MODEL, root / "models" / "tiny-qwen3")
    (root / "deploy" / "endpoints").mkdir(parents=True)
    monkeypatch.chdir(root)
    return root


def convert(capsys, out: str, base_model: str = "models/tiny-qwen3") -> str:
    code, text = run_cli(["endpoints", "from-skyrl", "--base-model", base_model, "--gpus", "1", "--out", out], capsys)
    assert code == 0, text
    return text


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        ("deploy/endpoints/tiny.yaml", "../../models/tiny-qwen3/config.json"),
        ("./tiny.yaml", "models/tiny-qwen3/config.json"),
        ("deploy/../deploy/tiny.yaml", "../models/tiny-qwen3/config.json"),
    ],
)
def test_model_config_is_relative_to_the_written_file(repo, capsys, out, expected):
    convert(capsys, out)
    assert yaml.safe_load((repo / out).read_text())["model"]["config"] == expected


def test_an_absolute_base_model_and_output_still_give_a_relative_path(repo, capsys):
    convert(capsys, str(repo / "deploy" / "tiny.yaml"), str(repo / "models" / "tiny-qwen3" / "config.json"))
    assert yaml.safe_load((repo / "deploy" / "tiny.yaml").read_text())["model"]["config"] == (
        "../models/tiny-qwen3/config.json"
    )


def test_stdout_is_relative_to_the_current_folder(repo, capsys):
    from skyrl_sim.cli import main

    assert main(["endpoints", "from-skyrl", "--base-model", "models/tiny-qwen3", "--gpus", "1", "--out", "-"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["config"] == "models/tiny-qwen3/config.json"


def test_a_moved_checkout_still_runs(repo, tmp_path, capsys, monkeypatch):
    """The committed tree (endpoint, scenario, model config) copied elsewhere runs there: nothing names the old place."""
    convert(capsys, "deploy/endpoints/tiny.yaml")
    (repo / "deploy" / "s.yaml").write_text(SCENARIO.format(endpoint="tiny"))
    moved = tmp_path / "elsewhere" / "clone"
    shutil.copytree(repo, moved)
    shutil.rmtree(repo)
    monkeypatch.chdir(tmp_path)
    code, text = run_cli(["check", str(moved / "deploy" / "s.yaml"), "--quiet"], capsys)
    assert code == 0, text
    assert str(repo) not in (moved / "deploy" / "endpoints" / "tiny.yaml").read_text()


def test_an_imported_scenario_names_its_endpoint_file_relative_to_itself(repo, tmp_path, capsys, monkeypatch):
    """``import --endpoint PATH``: the scenario names the endpoint file from its own folder, not the working directory
    of the import, so the pair can be moved (or committed) together."""
    from skyrl_sim.traffic.synthetic_db import write_synthetic_db

    endpoint = repo / "deploy" / "endpoints" / "jax.yaml"
    shutil.copy(ROOT / "scenarios" / "endpoints" / "skyrl-jax-cpu.yaml", endpoint)
    write_synthetic_db(repo / "tinker.db", 12, tenants=2, gap_s=2.0)
    out = repo / "deploy" / "traffic" / "last-week.yaml"
    out.parent.mkdir()
    code, text = run_cli(["import", "tinker.db", "--endpoint", "deploy/endpoints/jax.yaml", "--out", str(out)], capsys)
    assert code == 0, text
    assert yaml.safe_load(out.read_text())["endpoint"] == "../endpoints/jax.yaml"
    replayed = out.parent / "replayed.yaml"
    args = ["replay", "tinker.db", "--endpoint", "deploy/endpoints/jax.yaml", "--scenario-out", str(replayed), "--quiet"]
    code, text = run_cli(args, capsys)
    assert code == 0, text
    assert yaml.safe_load(replayed.read_text())["endpoint"] == "../endpoints/jax.yaml"
    moved = tmp_path / "elsewhere"
    shutil.copytree(repo / "deploy", moved / "deploy")
    monkeypatch.chdir(tmp_path)
    code, text = run_cli(["check", str(moved / "deploy" / "traffic" / "last-week.yaml"), "--quiet"], capsys)
    assert code in (0, 1) and "does not exist" not in text and "Traceback" not in text, text


def test_a_calibrated_profile_names_its_base_file_relative_to_itself(repo, tmp_path, capsys, monkeypatch):
    """A run whose endpoint names its hardware profile by path: the calibrated profile written elsewhere names that
    base relative to itself, and loads from any folder."""
    shutil.copy(ROOT / "src" / "skyrl_sim" / "data" / "hardware" / "cpu.yaml", repo / "deploy" / "base.yaml")
    endpoint = {
        "name": "tiny",
        "model": "tiny-dense",
        "hardware": {"profile": "deploy/base.yaml", "devices": 1, "device_memory_gib": 8, "reserve_gib": 0},
    }
    (repo / "scenarios").mkdir()
    scenario = repo / "scenarios" / "s.yaml"
    steps = [{"type": "forward_backward", "datums": [n, 2 * n]} for n in (10, 40, 90, 160, 250, 360, 490, 640)]
    client = {"submit": {"mode": "after_previous"}, "requests": steps}  # one call per request: eight to fit
    body = {"name": "s", "endpoint": endpoint, "workload": {"clients": [client]}}
    scenario.write_text(yaml.safe_dump(body))
    code, text = run_cli(["run", "scenarios/s.yaml", "--json", "run.json"], capsys)
    assert code == 0, text
    out = repo / "deploy" / "profiles" / "fitted.yaml"
    out.parent.mkdir()
    code, text = run_cli(["calibrate", "run.json", "--profile", "fitted", "--out", str(out)], capsys)
    assert code == 0, text
    assert yaml.safe_load(out.read_text())["base"] == "../base.yaml"
    monkeypatch.chdir(tmp_path)  # another folder: the base is found beside the calibrated profile, not from here
    endpoint["hardware"]["profile"] = str(out)
    (tmp_path / "s2.yaml").write_text(yaml.safe_dump({**body, "endpoint": endpoint}))
    code, text = run_cli(["check", "s2.yaml", "--quiet"], capsys)
    assert code in (0, 1) and "Traceback" not in text and "no such profile" not in text, text
