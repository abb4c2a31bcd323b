"""``--backend tinker`` on the light install (no ``tinker`` extra): one line naming the extra, exit 2, no traceback.

The child process sees neither the SDK nor its HTTP client, as after ``pip install -e .``: an import of either fails as
an absent package does (``ModuleNotFoundError`` with the module's name).
"""

from __future__ import annotations

import subprocess
import sys

from project_paths import SCENARIOS

WITHOUT_THE_EXTRA = """
import sys
for name in ("httpx", "tinker"):
    sys.modules[name] = None  # 'import httpx' now raises ModuleNotFoundError(name='httpx'), as if not installed
from skyrl_sim.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_without_the_extra(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_EXTRA, *args], capture_output=True, text=True, timeout=300
    )


def test_tinker_without_its_extra_names_the_extra() -> None:
    proc = run_without_the_extra(
        "run", str(SCENARIOS / "queue_drain_17.yaml"), "--backend", "tinker", "--option", "base_url=http://127.0.0.1:9"
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--backend tinker: needs 'httpx', which is not installed" in lines[0], proc.stderr
    assert "pip install 'skyrl-sim[tinker]'" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_the_plugin_itself_loads_without_the_extra() -> None:
    """``skyrl-sim plugins`` still lists the backend and its options: only making the backend needs the SDK."""
    proc = run_without_the_extra("plugins")
    assert proc.returncode == 0, proc.stderr
    assert "tinker" in proc.stdout and "base_url" in proc.stdout
