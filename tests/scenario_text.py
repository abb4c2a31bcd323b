"""Shared by the tests: a minimal valid scenario, a writer, the CLI run in process, and one client's requests run on
the simulator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from skyrl_sim.cli import main
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.scenario import load_scenario

GOOD = """
name: tiny
endpoint:
  model: tiny-dense
  hardware: {profile: cpu, devices: 1, device_memory_gib: 8, reserve_gib: 0}
workload:
  clients:
    - requests:
        - {type: forward_backward, lengths: [10, 20]}
"""


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """Exit code and everything printed."""
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def run_one_client(tmp_path: Path, name: str, endpoint: dict[str, Any], requests: list[dict[str, Any]]) -> RunResult:
    """``requests`` from one client (model ``m``) that waits for each result before the next submission, on
    ``endpoint``, run on the simulator."""
    client = {"name": "c", "model_id": "m", "submit": {"mode": "after_previous"}, "requests": requests}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "endpoint": endpoint, "workload": {"clients": [client]}}))
    return PluginHost().run(load_scenario(path).resolve("default"), "sim")
