"""Bad scenario files give one clear paragraph naming the file and the key, exit code 2, and no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scenario_text import GOOD, run_cli, write


def test_good_file_runs(tmp_path, capsys):
    code, out = run_cli(["run", str(write(tmp_path, GOOD))], capsys)
    assert code == 0, out
    assert "2/2 completed" in out


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        (GOOD.replace("name: tiny\n", ""), "name", "required key is missing"),
        (GOOD + "colour: blue\n", "colour", "unknown key"),
        (GOOD.replace("lengths: [10, 20]", "lengths: ten"), "workload.clients.0.requests.0.lengths", "list"),
        (
            GOOD.replace("devices: 1,", "devices: 1,").replace(
                "  hardware:", "  engine: {forward_backward_max_request_count: 0}\n  hardware:"
            ),
            "endpoint.engine.forward_backward_max_request_count",
            "0 and negatives are rejected",
        ),
        (GOOD.replace("model: tiny-dense", "model: no-such-model"), "model", "unknown model preset"),
        (
            GOOD.replace("devices: 1,", "devices: 4,").replace("  hardware:", "  parallelism: {pp: 4}\n  hardware:"),
            "parallelism.pp",
            "exceeds the model's 2 layers",
        ),
        (
            GOOD.replace("  hardware:", "  trainer: {expandable_segments: false}\n  hardware:"),
            "expandable_segments",
            "SkyRL's key is trainer.use_expandable_segments",
        ),
        (
            GOOD.replace("  hardware:", "  trainer: {attention: fused}\n  hardware:"),
            "endpoint.trainer.attention",
            "'unfused' or 'flash'",
        ),
        (
            GOOD.replace("type: forward_backward", "type: backward_forward"),
            "workload.clients.0.requests.0.type",
            "forward_backward",
        ),
    ],
)
def test_bad_files_name_file_key_and_reason(tmp_path, capsys, text, key, reason):
    path = write(tmp_path, text)
    code, out = run_cli(["run", str(path)], capsys)
    assert code == 2
    assert str(path) in out.replace("\n", "")
    assert key in out
    assert reason in out
    assert "Traceback" not in out


def test_malformed_yaml_names_line(tmp_path, capsys):
    path = write(tmp_path, "name: [unclosed\nendpoint: x\n")
    code, out = run_cli(["run", str(path)], capsys)
    assert code == 2
    assert "malformed YAML" in out and "line" in out


def test_negative_cap_from_the_command_line_is_rejected(tmp_path, capsys):
    code, out = run_cli(["run", str(write(tmp_path, GOOD)), "--set", "engine.forward_backward_max_request_count=-3"], capsys)
    assert code == 2
    assert "forward_backward_max_request_count" in out


def test_unknown_endpoint_name_lists_known_ones(capsys):
    root = Path(__file__).resolve().parent.parent
    code, out = run_cli(["run", str(root / "scenarios/queue_drain_17.yaml"), "--endpoint", "nope"], capsys)
    assert code == 2
    assert "no endpoint named 'nope'" in out and "qwen3.6-27b-h200-tp4" in out


def test_missing_file_and_no_traceback_in_a_real_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "skyrl_sim.cli", "run", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "no such file" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_preset_overrides_resize_layer_types(tmp_path, capsys):
    text = GOOD.replace("model: tiny-dense", "model: {preset: qwen3-8b, num_layers: 8}")
    code, out = run_cli(["run", str(write(tmp_path, text))], capsys)
    assert code == 0, out
    hybrid = GOOD.replace("model: tiny-dense", "model: {preset: qwen3.6-27b, num_layers: 8}")
    code, out = run_cli(["run", str(write(tmp_path, hybrid, "h.yaml"))], capsys)
    assert code == 2 and "layer_types" in out
