"""The plugin contract is real: the built-in plugins (and the example) reach the host only through its public API,
``skyrl_sim.api``, as a third-party plugin must. An import of any other host module fails here with the file and the
import; what a plugin legitimately needs is exported by ``api.py`` on purpose."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import skyrl_sim.api
from project_paths import ROOT

PLUGINS = ROOT / "src" / "skyrl_sim_plugins"
EXAMPLES = ROOT / "examples"
API = "skyrl_sim.api"


def plugin_files() -> list[Path]:
    return sorted([*PLUGINS.rglob("*.py"), *EXAMPLES.rglob("*.py")])


def host_imports(path: Path) -> set[str]:
    """Every host module this file imports, at module level or in a function (``from skyrl_sim import units`` names
    ``skyrl_sim.units``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "skyrl_sim":
                found.update(f"skyrl_sim.{a.name}" for a in node.names)
            else:
                found.add(node.module)
    return {m for m in found if m == "skyrl_sim" or m.startswith("skyrl_sim.")}


def test_the_plugins_are_found() -> None:
    """The rule below is only as good as the file list: every built-in plugin package and the example are in it."""
    packages = {p.relative_to(PLUGINS).parts[0] for p in plugin_files() if p.is_relative_to(PLUGINS)}
    assert {"sim", "megatron_vllm", "tinker_client"} <= packages
    assert any(p.is_relative_to(EXAMPLES) for p in plugin_files())


@pytest.mark.parametrize("path", plugin_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_plugin_imports_the_host_only_through_the_api(path: Path) -> None:
    other = host_imports(path) - {API}
    assert not other, f"{path.relative_to(ROOT)} imports {sorted(other)}: import it from {API} (export it there if needed)"


def test_the_api_exports_every_name_it_lists_once() -> None:
    names = skyrl_sim.api.__all__
    assert len(names) == len(set(names))
    assert all(hasattr(skyrl_sim.api, name) for name in names)
