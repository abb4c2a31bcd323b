"""The layout is the architecture: each subpackage of the host imports only the layers below it, and the built-in
plugins are reached by the host only through hooks.

Layers, bottom to top: the base modules (errors, units), schema, results, engine, plugin_host, traffic, reports,
commands, and the faces (cli, api, testing, __main__). A test rather than a picture, so a change that reaches up a
layer fails here with the file and the import that did it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from project_paths import ROOT

PACKAGE = ROOT / "src" / "skyrl_sim"
BASE = {"skyrl_sim", "skyrl_sim.errors", "skyrl_sim.units"}
LAYERS = ["schema", "results", "engine", "plugin_host", "traffic", "reports", "commands"]
FACES = {"cli", "api", "testing", "__main__", "__init__"}


def own_imports(path: Path) -> set[str]:
    """Every ``skyrl_sim*`` module this file imports, at module level or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {m for m in found if m == "skyrl_sim" or m.startswith(("skyrl_sim.", "skyrl_sim_plugins"))}


def layer_of(module: str) -> int:
    """Index in LAYERS (-1 for the base modules; len(LAYERS) for the faces)."""
    if module in BASE:
        return -1
    part = module.split(".")[1]
    if part in FACES:
        return len(LAYERS)
    return LAYERS.index(part)


def host_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("path", host_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_imports_only_its_layer_and_below(path: Path) -> None:
    name = module_name(path)
    own = layer_of(name)
    for imported in own_imports(path):
        assert not imported.startswith("skyrl_sim_plugins"), f"{name} imports the built-in plugin {imported}"
        if imported in BASE:
            continue
        assert layer_of(imported) <= own, f"{name} (layer {own}) imports {imported} (layer {layer_of(imported)})"


def test_every_host_module_is_in_a_layer() -> None:
    """A new top-level module must be placed deliberately: a base module, a face, or a subpackage."""
    loose = [
        p.name
        for p in PACKAGE.glob("*.py")
        if p.stem not in FACES and f"skyrl_sim.{p.stem}" not in BASE
    ]
    assert not loose, f"modules outside every layer: {loose}"
