"""Portable outputs: ``endpoints from-skyrl`` writes ``model.config`` relative to the endpoint file it writes (to the
current folder on stdout), so the file and the config beside it can be committed and used from anywhere."""

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
