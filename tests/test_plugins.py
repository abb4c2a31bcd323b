"""The plugin host: entry-point loading, the plugins command, duplicate names, a documented interface."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from project_paths import ROOT, SCENARIOS
from skyrl_sim.errors import PluginError
from skyrl_sim.plugin_host import hookspecs
from skyrl_sim.plugin_host.hookspecs import BackendSpec, RunContext, hookimpl
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.testing import host_with, run_scenario

EXAMPLE = ROOT / "examples" / "fixed_time_backend"


def test_every_hook_is_documented():
    specs = [getattr(hookspecs, n) for n in dir(hookspecs) if n.startswith("skyrl_sim_")]
    assert len(specs) >= 5
    for spec in specs:
        assert inspect.getdoc(spec) and len(inspect.getdoc(spec)) > 40, spec.__name__
        assert spec.__name__ in hookspecs.__doc__, f"{spec.__name__} is not listed in a phase"


def test_every_hook_documents_its_caller_parameters_and_return() -> None:
    """As pytest's hookspecs do: who calls the hook and when, each parameter by name, and what a return means."""
    specs = [getattr(hookspecs, n) for n in dir(hookspecs) if n.startswith("skyrl_sim_")]
    for spec in specs:
        doc = inspect.getdoc(spec) or ""
        signature = inspect.signature(spec)
        assert "Called by:" in doc, f"{spec.__name__}: no 'Called by:' (caller and timing)"
        if signature.parameters:
            assert "Parameters:" in doc, f"{spec.__name__}: no 'Parameters:'"
            section = doc.split("Parameters:", 1)[1]
            for name in signature.parameters:
                assert f"``{name}``" in section, f"{spec.__name__}: parameter {name} is not described"
        if signature.return_annotation not in (None, "None", inspect.Signature.empty):
            assert "Returns:" in doc, f"{spec.__name__}: returns {signature.return_annotation} but says nothing of it"


def test_plugins_command_lists_the_simulator_with_its_source():
    proc = subprocess.run(
        [sys.executable, "-m", "skyrl_sim.cli", "plugins"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "250"},
    )
    assert proc.returncode == 0, proc.stderr
    line = next(li for li in proc.stdout.splitlines() if "skyrl_sim_plugins.sim.plugin" in li)
    assert " sim " in line and "entry point" in line


class Duplicate:
    @hookimpl
    def skyrl_sim_backends(self) -> list[BackendSpec]:
        return [BackendSpec("sim", lambda: None, "a second simulator")]  # type: ignore[arg-type,return-value]


def test_duplicate_backend_name_is_refused_naming_both_plugins():
    host = PluginHost()
    with pytest.raises(PluginError, match=r"backend name 'sim' is claimed by two plugins: 'sim' .* and 'dup'"):
        host.register(Duplicate(), "dup", "a test")


def test_duplicate_plugin_name_is_refused():
    host = PluginHost()
    with pytest.raises(PluginError, match="two plugins are named 'sim'"):
        host.register(object(), "sim", "a test")


def write_entry_point_metadata(site: Path) -> None:
    """Make the example plugin discoverable exactly as an installed distribution is: a dist-info with entry points."""
    dist = site / "skyrl_sim_fixed_time-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: skyrl-sim-fixed-time\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[skyrl_sim]\nfixed-time = skyrl_sim_fixed_time\n")
    (site / "skyrl_sim_fixed_time.py").write_text((EXAMPLE / "skyrl_sim_fixed_time.py").read_text())


def test_third_party_backend_from_entry_point_metadata_runs_a_scenario(tmp_path):
    write_entry_point_metadata(tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "COLUMNS": "250"}
    listed = subprocess.run(
        [sys.executable, "-m", "skyrl_sim.cli", "plugins"], capture_output=True, text=True, env=env, timeout=120
    )
    assert "fixed-time" in listed.stdout and "skyrl-sim-fixed-time 0.1.0" in listed.stdout
    option = next(li for li in listed.stdout.splitlines() if "fixed-time" in li and " seconds " in li)
    assert "float" in option and "1.0" in option and "what every call costs" in option
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "skyrl_sim.cli",
            "run",
            str(SCENARIOS / "queue_drain_17.yaml"),
            "--variant",
            "cap-aware",
            "--backend",
            "fixed-time",
            "--option",
            "seconds=2",
            "--json",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    import orjson

    data = orjson.loads((tmp_path / "r.json").read_bytes())["runs"][0]
    assert data["backend"] == "fixed-time"
    assert {round(c["end_s"] - c["start_s"], 6) for c in data["calls"]} == {2.0}


def test_plugin_author_helpers_register_and_run():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import skyrl_sim_fixed_time

        host = host_with(skyrl_sim_fixed_time)
        assert "fixed-time" in host.backends
        result = run_scenario(host, SCENARIOS / "queue_drain_17.yaml", "no-cap", backend="fixed-time")
        assert result.backend == "fixed-time" and len(result.requests) == 17
    finally:
        sys.path.remove(str(EXAMPLE))


def test_a_plugin_can_observe_every_call():
    seen: list[int] = []

    class Observer:
        @hookimpl
        def skyrl_sim_call_finished(self, call, result) -> None:
            seen.append(call.index)

    host = host_with(Observer())
    result = run_scenario(host, SCENARIOS / "queue_drain_17.yaml", "cap-aware")
    assert seen == [c.index for c in result.calls]


def test_every_hook_is_called_by_the_host():
    """A plugin implementing every hook is asked each one in a CLI build, a run, a calibration lookup and a backend's
    request for the simulator: a hook nobody calls (or a new hook without a caller) fails here."""
    called: set[str] = set()
    names = [n for n in dir(hookspecs) if n.startswith("skyrl_sim_")]
    lists = {"skyrl_sim_backends", "skyrl_sim_backend_options", "skyrl_sim_padding_rules", "skyrl_sim_report_writers"}

    def recorder(name: str):
        """An implementation of hook ``name`` with its parameters: records the call, answers ``[]`` to a
        registration hook and None (pass: the simulator answers) to the others."""

        def impl(**kwargs: object) -> object:
            called.add(name)
            return [] if name in lists else None

        impl.__name__ = name
        impl.__signature__ = inspect.signature(getattr(hookspecs, name))  # type: ignore[attr-defined]
        return staticmethod(hookimpl(impl))

    host = host_with(type("EveryHook", (), {n: recorder(n) for n in names})())
    from skyrl_sim.cli import build_parser

    build_parser(host)
    run_scenario(host, SCENARIOS / "queue_drain_17.yaml", "cap-aware")
    host.cost_models()
    assert RunContext(host=host, options={}).simulator() is not None
    assert called == set(names), f"never called: {sorted(set(names) - called)}"


def test_the_host_writes_every_backends_result_header():
    """``RunContext.new_result``: the names and capacity come from the variant; a backend's fields replace them."""
    from skyrl_sim.schema.scenario import load_scenario

    variant = load_scenario(SCENARIOS / "queue_drain_17.yaml").resolve("cap-aware")
    context = RunContext(host=PluginHost(), options={})
    result = context.new_result(variant, "fixed-time")
    assert (result.scenario, result.variant, result.backend) == (variant.scenario.name, "cap-aware", "fixed-time")
    assert result.endpoint == variant.endpoint.name and result.capacity_bytes == variant.endpoint.capacity_bytes
    assert context.new_result(variant, "x", capacity_bytes=None, versions={"a": "1"}).capacity_bytes is None
