"""The seed scenarios and endpoints that ship with skyrl-sim, wherever it is installed.

In the repository they are ``scenarios/`` and ``scenarios/endpoints/``; in a wheel the same files are the package data
``skyrl_sim/scenarios/``. Endpoint names are looked up beside the scenario first, then here, so a copied scenario that
names a shipped endpoint still runs after a plain ``pip install``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[3]
"""The source checkout this module runs from (its scenarios/ and validation/ folders, when they are there)."""
REPOSITORY_SCENARIOS = REPOSITORY / "scenarios"


def scenarios_dir() -> Path | None:
    """The shipped scenarios folder: the installed package data, else the repository's (an editable install)."""
    try:
        packaged = Path(str(resources.files("skyrl_sim") / "scenarios"))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - a zipped install
        packaged = None
    for candidate in (packaged, REPOSITORY_SCENARIOS):
        if candidate is not None and candidate.is_dir() and any(candidate.glob("*.yaml")):
            return candidate
    return None


def endpoints_dir() -> Path | None:
    folder = scenarios_dir()
    return folder / "endpoints" if folder is not None and (folder / "endpoints").is_dir() else None


def shipped_endpoints() -> dict[str, Path]:
    """Shipped endpoint files by name."""
    folder = endpoints_dir()
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))} if folder else {}


def shipped_scenarios() -> dict[str, Path]:
    """Shipped scenario files by name."""
    folder = scenarios_dir()
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))} if folder else {}
