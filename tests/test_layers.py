"""The layout is the architecture: each subpackage of the host imports only the layers below it, and the built-in
plugins are reached by the host only through hooks.

Layers, bottom to top: the base modules (errors, units), schema, results, engine, plugin_host, traffic, reports,
commands, and the faces (cli, api, testing, __main__). A test rather than a picture, so a change that reaches up a
layer fails here with the file and the import that did it.

Inside the commands layer, a command (a module that registers one: it defines ``add_parser``) imports no other
command: what two commands share lives in a module that is no command (``executors``, ``points``, ``trace_import``)
or in a lower layer. Only ``commands/plugin.py``, which registers them, imports the commands.
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


def imported(path: Path, names: bool = False) -> set[str]:
    """Every module this file imports, at module level or inside a function; with ``names``, also every
    ``module.name`` of a ``from module import name`` (a name may be a module: ``from skyrl_sim.commands import sweep``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if names:
                found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def own_imports(path: Path) -> set[str]:
    """Every ``skyrl_sim*`` module this file imports, at module level or inside a function."""
    return {m for m in imported(path) if m == "skyrl_sim" or m.startswith(("skyrl_sim.", "skyrl_sim_plugins"))}


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


COMMANDS = PACKAGE / "commands"
REGISTRAR = "skyrl_sim.commands.plugin"


def is_command(path: Path) -> bool:
    """A module of the commands layer that registers a command: it defines ``add_parser`` at its top level."""
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == "add_parser" for node in tree.body)


def command_modules() -> set[str]:
    return {module_name(p) for p in sorted(COMMANDS.glob("*.py")) if is_command(p)}


def test_the_commands_are_found() -> None:
    """The rule below is only as good as the detection: every built-in command is a command module."""
    assert {"advise", "calibrate", "catalog", "compare", "importer", "replay", "sweep"} <= {
        name.rsplit(".", 1)[1] for name in command_modules()
    }
    assert "skyrl_sim.commands.executors" not in command_modules()


@pytest.mark.parametrize("path", host_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_but_the_registrar_imports_a_command(path: Path) -> None:
    name = module_name(path)
    if name == REGISTRAR:
        return
    reached = imported(path, names=True) & command_modules()
    assert not reached, f"{name} imports the command {sorted(reached)}: move what they share out of the command"


def test_every_host_module_is_in_a_layer() -> None:
    """A new top-level module must be placed deliberately: a base module, a face, or a subpackage."""
    loose = [
        p.name
        for p in PACKAGE.glob("*.py")
        if p.stem not in FACES and f"skyrl_sim.{p.stem}" not in BASE
    ]
    assert not loose, f"modules outside every layer: {loose}"


def top_level_names(path: Path) -> set[str]:
    """The classes, functions and assigned names a module defines at its top level."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


def test_the_engine_owns_its_request_type() -> None:
    """The request as the engine sees it, and the barrier types of its scheduling, live in the engine; the schema
    holds only what users write (``RequestSpec``), and the plugin contract exports the engine's type."""
    import skyrl_sim.api
    from skyrl_sim.engine.request import Request

    assert skyrl_sim.api.Request is Request
    for path in (PACKAGE / "schema").glob("*.py"):
        assert not {"Request", "BARRIERS"} & top_level_names(path), f"{path.name} defines the engine's request type"


SOURCES = ROOT / "src"
"""Every package of the project (the host and the built-in plugins): no import circle in any of them."""


def source_module_name(path: Path) -> str:
    parts = path.relative_to(SOURCES).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of the project and the project's modules it imports: at module level, inside a function, or only
    for type checking (a circle of type hints is still a circle: neither module can be read without the other)."""
    paths = {source_module_name(p): p for p in sorted(SOURCES.rglob("*.py"))}
    return {
        name: {m for m in imported(path, names=True) if m in paths and m != name} for name, path in paths.items()
    }


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative): each is an import
    circle, its modules sorted; the circles sorted by their first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return sorted(circles)


def test_the_circle_finder_finds_circles() -> None:
    """The rule below is only as good as the finder: a two-module circle, a longer one, and no false one."""
    graph = {
        "p.a": {"p.b"},
        "p.b": {"p.a", "p.c"},
        "p.c": {"p.d"},
        "p.d": {"p.e"},
        "p.e": {"p.c", "p.f"},
        "p.f": set(),
    }
    assert import_circles(graph) == [["p.a", "p.b"], ["p.c", "p.d", "p.e"]]
    assert import_circles({"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": set()}) == []


def test_no_package_has_an_import_circle() -> None:
    """No two modules of any package import each other, directly or through others (inside a package as between
    packages): what two modules share lives in a module below both."""
    circles = import_circles(import_graph())
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)
