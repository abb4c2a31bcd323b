"""Shared by the input-checking tests: a minimal valid scenario, a writer, and the CLI run in process."""

from __future__ import annotations

from pathlib import Path

from skyrl_sim.cli import main

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
