"""The simulator's tiers (``skyrl_sim_plugins.sim``'s package doc): each module imports only its own tier and the
tiers below it, and only the bound tier and above keep state between calls, every cache a ``BoundedCache``.

Tiers, bottom to top: ``description`` (what a layer is, op by op), ``reference`` (the models op by op),
``fast`` (compiled programs and width lanes, each held to its reference), ``bound`` (models bound to an endpoint, the
only caches), ``service`` (the service around the trainer: tenancy, placement, inference), and the plugin's face
(``backend``, ``plugin``, ``options``). A test rather than a picture: an import that reaches up a tier fails here
with the file and the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from project_paths import ROOT

SIM = ROOT / "src" / "skyrl_sim_plugins" / "sim"
PACKAGE = "skyrl_sim_plugins.sim"
TIERS = ["description", "reference", "fast", "bound", "service"]
FACE = {"backend", "plugin", "options", "__init__"}
STATELESS = {"description", "reference", "fast"}
"""Tiers that keep nothing between calls: no cache, no module-level container that grows."""
CACHE_MODULE = f"{PACKAGE}.bound.cache"


def sim_files() -> list[Path]:
    return sorted(SIM.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(SIM.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def tier_of(module: str) -> int:
    """The index of ``module``'s tier in TIERS; len(TIERS) for the face."""
    rest = module.removeprefix(PACKAGE).lstrip(".").split(".")
    if rest[0] in TIERS:
        return TIERS.index(rest[0])
    if rest[0] in FACE or rest == [""]:
        return len(TIERS)
    raise AssertionError(f"{module} is in no tier: put it in one of {TIERS} or the face {sorted(FACE)}")


def sim_imports(tree: ast.AST, name: str) -> set[str]:
    """Every module of the simulator this file imports, at module level or inside a function."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES)
    return {m for m in found if m in MODULES}


MODULES = {module_name(p) for p in sim_files()}


@pytest.mark.parametrize("path", sim_files(), ids=lambda p: str(p.relative_to(SIM)))
def test_each_module_imports_only_its_tier_and_below(path: Path) -> None:
    name = module_name(path)
    own = tier_of(name)
    for imported in sim_imports(ast.parse(path.read_text()), name):
        assert tier_of(imported) <= own, f"{name} (tier {own}) imports {imported} (tier {tier_of(imported)})"


def module_level_containers(tree: ast.Module) -> list[str]:
    """Names bound at module level to a mutable container (a dict, list or set display or call) that are not
    constants (UPPER_CASE): state a module would keep between calls."""
    found = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and getattr(value.func, "id", "") in {"dict", "list", "set", "OrderedDict"}
        )
        for target in targets:
            if mutable and isinstance(target, ast.Name) and not target.id.isupper():
                found.append(target.id)
    return found


def cache_devices(tree: ast.AST) -> list[str]:
    """Hand-rolled caches: ``OrderedDict``, ``functools.lru_cache`` / ``cache``, ``popitem``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in {"OrderedDict", "lru_cache"}:
            found.append(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in {"lru_cache", "popitem"}:
            found.append(node.attr)
        elif isinstance(node, ast.alias) and node.name in {"OrderedDict", "lru_cache", "cache"}:
            found.append(node.name)
    return found


@pytest.mark.parametrize("path", sim_files(), ids=lambda p: str(p.relative_to(SIM)))
def test_only_the_bound_tier_and_above_keep_state(path: Path) -> None:
    name = module_name(path)
    tree = ast.parse(path.read_text())
    if TIERS[min(tier_of(name), len(TIERS) - 1)] in STATELESS and tier_of(name) < len(TIERS):
        assert not module_level_containers(tree), f"{name} keeps module-level state: {module_level_containers(tree)}"
        assert not cache_devices(tree), f"{name} keeps a cache ({cache_devices(tree)}): caches belong in bound/"


@pytest.mark.parametrize("path", [p for p in sim_files() if module_name(p).startswith(f"{PACKAGE}.bound")] + [
    SIM / f"{face}.py" for face in sorted(FACE - {"__init__"})
], ids=lambda p: str(p.relative_to(SIM)))
def test_every_cache_is_a_bounded_cache(path: Path) -> None:
    """The bound tier and the face keep caches through ``BoundedCache`` alone: no other eviction policy."""
    if module_name(path) == CACHE_MODULE:
        return
    devices = cache_devices(ast.parse(path.read_text()))
    assert not devices, f"{module_name(path)} keeps a hand-rolled cache ({devices}): use bound.cache.BoundedCache"


def test_every_module_is_in_a_tier() -> None:
    for path in sim_files():
        tier_of(module_name(path))


def test_a_run_leaves_no_reference_cycles() -> None:
    """A run's bound models and their caches go when the run does: nothing the simulator keeps is a reference cycle
    (the run driver pauses the cyclic collector, so a cycle would keep a run's caches until its next full pass)."""
    import gc

    from skyrl_sim.plugin_host.host import PluginHost
    from skyrl_sim.schema.scenario import load_scenario

    host = PluginHost()
    scenario = load_scenario(ROOT / "scenarios" / "queue_drain_17_tiny.yaml")
    for name in scenario.variant_names:  # the first runs also load the plugins (import machinery makes cycles)
        host.run(scenario.resolve(name), "sim")
    gc.collect()
    for name in scenario.variant_names:
        host.run(scenario.resolve(name), "sim")
    assert gc.collect() == 0, "a run left reference cycles"
