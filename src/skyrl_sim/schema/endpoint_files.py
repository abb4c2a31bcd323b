"""Where a scenario's endpoint comes from: inline, a path, or a name looked up beside the scenario, in
``./scenarios/endpoints``, then among the endpoints shipped with skyrl-sim."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from skyrl_sim.errors import ScenarioError
from skyrl_sim.schema.documents import read_yaml
from skyrl_sim.schema.shipped import endpoints_dir


def endpoint_search_dirs(scenario_path: Path) -> list[Path]:
    """Where endpoint names are looked up, first match wins: beside the scenario, then ./scenarios/endpoints, then the
    endpoints shipped with skyrl-sim."""
    dirs = [scenario_path.parent / "endpoints", scenario_path.parent.parent / "endpoints", Path("scenarios/endpoints")]
    shipped = endpoints_dir()
    if shipped is not None:
        dirs.append(shipped)
    seen: list[Path] = []
    for d in dirs:
        if d not in seen:
            seen.append(d)
    return seen


def is_endpoint_path(ref: str) -> bool:
    """Whether an endpoint reference is a file path (``x.yaml``, ``dir/x``) rather than a name."""
    return Path(ref).suffix in (".yaml", ".yml") or "/" in ref


def endpoint_path(ref: str, scenario_path: Path) -> Path | None:
    """The file a path reference names: as given from the working directory, else beside the scenario; None when
    neither exists."""
    candidate = Path(ref)
    path = candidate if candidate.is_absolute() else (Path.cwd() / candidate)
    if not path.exists():
        path = scenario_path.parent / candidate
    return path if path.exists() else None


def portable_ref(ref: str, scenario_path: Path) -> str:
    """``ref`` as a scenario written at ``scenario_path`` should name it so the file works from any folder and on
    any machine: a name stays a name; a path becomes relative to the scenario's folder (the loader looks there when
    the working directory does not hold it)."""
    if not is_endpoint_path(ref):
        return ref
    path = endpoint_path(ref, scenario_path)
    if path is None:
        return ref
    return os.path.relpath(path.resolve(), scenario_path.absolute().parent.resolve())


def load_endpoint(ref: str | dict[str, Any], scenario_path: Path) -> tuple[dict[str, Any], str]:
    """The endpoint mapping and the file it came from (the scenario itself when inline)."""
    if isinstance(ref, dict):
        return ref, str(scenario_path)
    if is_endpoint_path(ref):
        path = endpoint_path(ref, scenario_path)
        if path is None:
            raise ScenarioError(str(scenario_path), "endpoint", f"endpoint file '{ref}' does not exist")
        return read_yaml(path, role="the endpoint file"), str(path)
    for directory in endpoint_search_dirs(scenario_path):
        path = directory / f"{ref}.yaml"
        if path.exists():
            return read_yaml(path, role="the endpoint file"), str(path)
    known = sorted({p.stem for d in endpoint_search_dirs(scenario_path) if d.is_dir() for p in d.glob("*.yaml")})
    raise ScenarioError(str(scenario_path), "endpoint", f"no endpoint named '{ref}' (known: {', '.join(known) or 'none'})")
