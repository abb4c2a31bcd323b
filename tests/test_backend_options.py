"""Plugins own their settings: each backend's --option schema, unknown keys refused everywhere, and a black-box
backend refusing the --set overrides it cannot apply."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from project_paths import ROOT, SCENARIOS
from skyrl_sim.cli import main
from skyrl_sim.errors import PluginError, UserError
from skyrl_sim.plugin_host.hookspecs import BackendOptions, BackendSpec, ReportWriter, RunContext, hookimpl
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.schema.variant import ResolvedVariant
from skyrl_sim.testing import host_with

SEED = SCENARIOS / "queue_drain_17.yaml"
EXAMPLE = ROOT / "examples" / "fixed_time_backend"


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_the_simulator_refuses_an_unknown_option(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["run", str(SEED), "--variant", "cap-aware", "--option", "nonsense=1"], capsys)
    assert code == 2
    assert "--option nonsense: the sim backend has no such option" in out and "Traceback" not in out


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("nonsense=1", "the megatron backend has no such option (known: call_timeout_s"),
        ("threads=abc", "--option threads=abc"),
        ("threads=-1", "greater than or equal to 0"),
        ("kill_rank_before_call=2", "expected CALL:RANK"),
    ],
)
def test_the_real_backend_refuses_bad_options_before_it_starts(option: str, message: str) -> None:
    host = host_with()
    key, value = option.split("=", 1)
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        host.check_run(load_scenario(SEED).resolve("cap-aware"), "megatron", {key: value})


def test_the_tinker_backend_refuses_engine_overrides_it_would_ignore(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", str(SEED), "--backend", "tinker", "--option", "base_url=http://127.0.0.1:9"]
    code, out = run_cli([*args, "--set", "engine.forward_backward_max_request_count=1"], capsys)
    assert code == 2
    assert "--set engine.forward_backward_max_request_count: the tinker backend cannot apply this setting" in out
    host = host_with()
    scenario = load_scenario(SEED)
    for applied in ({"workload.clients.0.submit.gap_s": 0.01}, {"lora.rank": 16}, {"endpoint.base_url": "http://x"}):
        host.check_run(scenario.resolve("no-cap", applied), "tinker", {"base_url": "http://x"})
    with pytest.raises(UserError, match="trainer.micro_train_batch_size_per_gpu"):
        host.check_run(scenario.resolve("no-cap", {"trainer.micro_train_batch_size_per_gpu": 8}), "tinker", {})


class BlackBox:
    """A backend that cannot see calls and applies only the workload."""

    @hookimpl
    def skyrl_sim_backends(self) -> list[BackendSpec]:
        return [BackendSpec("black-box", BlackBox, "a test")]  # type: ignore[arg-type]

    @hookimpl
    def skyrl_sim_backend_options(self) -> list[BackendOptions]:
        return [BackendOptions("black-box", honours=("workload",))]

    def run(self, variant: ResolvedVariant, context: RunContext) -> RunResult:
        return RunResult(variant.scenario.name, variant.variant_name, "black-box", variant.endpoint.name)


def test_a_black_box_refuses_a_variant_setting_it_cannot_apply_as_it_refuses_set() -> None:
    host = host_with(BlackBox())
    scenario = load_scenario(SEED)
    with pytest.raises(UserError, match=r"queue_drain_17.yaml, variant 'cap-aware', set key 'engine.forward_backward_max"):
        host.run(scenario.resolve("cap-aware"), "black-box")
    with pytest.raises(UserError, match="--set engine.cap_aware_padding"):
        host.run(scenario.resolve("no-cap", {"engine.cap_aware_padding": False}), "black-box")
    result = host.run(scenario.resolve("no-cap", {"workload.clients.0.submit.gap_s": 0.01}), "black-box")
    assert result.variant == "no-cap"  # no-cap's set is empty: nothing to refuse
    assert host.run(scenario.resolve("cap-aware"), "sim").calls  # the simulator applies every setting


def test_the_tinker_backend_refuses_a_variant_that_sets_engine_keys_before_any_variant_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--all-variants`` starts with no-cap (nothing set): the refusal of cap-only comes before it would run."""
    args = ["run", str(SEED), "--backend", "tinker", "--option", "base_url=http://127.0.0.1:9"]
    for selection in (["--variant", "cap-only"], ["--all-variants"]):
        code, out = run_cli([*args, *selection], capsys)
        assert code == 2, out
        assert (
            f"{SEED}, variant 'cap-only', set key 'engine.forward_backward_max_request_count': the tinker backend "
            "cannot apply this setting" in " ".join(out.split())
        )
        assert "Traceback" not in out and "completed" not in out


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    level: int = 1


class StrayOptions:
    @hookimpl
    def skyrl_sim_backend_options(self) -> list[BackendOptions]:
        return [BackendOptions("no-such-backend", Strict)]


class SecondSimOptions:
    @hookimpl
    def skyrl_sim_backend_options(self) -> list[BackendOptions]:
        return [BackendOptions("sim", Strict)]


def test_options_for_a_missing_backend_or_declared_twice_are_refused() -> None:
    with pytest.raises(PluginError, match="backend 'no-such-backend', which no plugin provides"):
        host_with(StrayOptions())
    with pytest.raises(PluginError, match="options of backend 'sim' are declared by two plugins: 'sim' and"):
        host_with(SecondSimOptions())


def test_the_example_plugin_declares_its_options_and_refuses_others() -> None:
    sys.path.insert(0, str(EXAMPLE))
    try:
        import skyrl_sim_fixed_time

        host = host_with(skyrl_sim_fixed_time)
        variant = load_scenario(SEED).resolve("cap-aware")
        result = host.run(variant, "fixed-time", {"seconds": "2"})
        assert {round(c.end_s - c.start_s, 6) for c in result.calls} == {2.0}
        with pytest.raises(UserError, match="--option colour: the fixed-time backend has no such option"):
            host.run(variant, "fixed-time", {"colour": "red"})
        with pytest.raises(UserError, match="--option seconds=soon"):
            host.run(variant, "fixed-time", {"seconds": "soon"})
    finally:
        sys.path.remove(str(EXAMPLE))


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_host_and_the_example_import_no_built_in_plugin() -> None:
    files = [*sorted((ROOT / "src" / "skyrl_sim").rglob("*.py")), EXAMPLE / "skyrl_sim_fixed_time.py"]
    for path in files:
        plugins = sorted(m for m in imported_modules(path) if m.startswith("skyrl_sim_plugins"))
        assert not plugins, f"{path.relative_to(ROOT)} imports {plugins}"


def test_no_host_module_imports_the_cli() -> None:
    """The CLI registers commands; a command's module importing it back was the cli <-> compare cycle."""
    for path in sorted((ROOT / "src" / "skyrl_sim").rglob("*.py")):
        if path.name in {"cli.py", "__main__.py"}:
            continue
        assert "skyrl_sim.cli" not in imported_modules(path), f"{path.name} imports skyrl_sim.cli"


class Hello:
    """A plugin that adds a report command."""

    @hookimpl
    def skyrl_sim_commands(self, subparsers) -> None:
        parser = subparsers.add_parser("hello", help="say hello")
        parser.add_argument("--name", default="world")
        parser.set_defaults(func=lambda args, console: console.print(f"hello {args.name}") or 0)


def test_commands_register_like_plugins(capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    from skyrl_sim.cli import build_parser

    parser = build_parser(host_with(Hello()))
    args = parser.parse_args(["hello", "--name", "skyrl"])
    assert args.func(args, Console()) == 0
    assert "hello skyrl" in capsys.readouterr().out
    assert {"compare", "calibrate"} <= set(parser._subparsers._group_actions[0].choices)  # the core's, by the same hook


class CallCount:
    """A plugin that adds a report view: ``--call-count PATH`` writes how many calls each variant made."""

    @hookimpl
    def skyrl_sim_report_writers(self) -> list[ReportWriter]:
        def write(results: list[RunResult], target: str) -> str:
            Path(target).write_text("".join(f"{r.variant} {len(r.calls)}\n" for r in results))
            return f"call counts: {target}"

        return [ReportWriter("--call-count", "PATH", "write each variant's number of calls", write)]


def test_report_views_register_like_plugins(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plugin's view gets its flag on run and check, its path is checked before the run, and it is written after."""
    from skyrl_sim.cli import main

    host = host_with(CallCount())
    out = tmp_path / "counts.txt"
    assert main(["run", str(SEED), "--all-variants", "--call-count", str(out)], host=host) == 0
    lines = out.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["no-cap", "cap-only", "cap-aware"]
    assert all(int(line.split()[1]) > 0 for line in lines)
    assert f"call counts: {out}" in capsys.readouterr().out
    assert main(["check", str(SEED), "--call-count", str(tmp_path / "missing" / "c.txt")], host=host) == 2
    assert "--call-count" in capsys.readouterr().err
    assert main(["run", str(SEED), "--trace", str(tmp_path / "t.json")], host=host) == 0  # the built-in views stay


def test_the_example_imports_only_the_public_api() -> None:
    own = sorted(m for m in imported_modules(EXAMPLE / "skyrl_sim_fixed_time.py") if m.startswith("skyrl_sim"))
    assert own and all(m == "skyrl_sim.api" or m.startswith("skyrl_sim.api.") for m in own), own


def test_the_example_backend_runs_the_hosts_engine_not_a_copy() -> None:
    """Same clock and cost as the simulator with a fixed time model: the calls (who is in which, when) must be equal,
    because both are the host's driver; only the executor differs."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        import skyrl_sim_fixed_time

        host = host_with(skyrl_sim_fixed_time)
        variant = load_scenario(SEED).resolve("cap-aware")
        example = host.run(variant, "fixed-time", {"seconds": "2"})

        class Fixed:
            def bind(self, endpoint, model) -> Fixed:
                return self

            def call_seconds(self, shape) -> float:
                return 2.0

            def sample_seconds(self, requests) -> float:
                return 2.0

            def single_seconds(self, request) -> float:
                return 2.0

        context = RunContext(host=host, options={})
        simulated = context.simulator(time=Fixed()).run(variant, context)
        assert [(c.kind, c.request_ids, c.start_s, c.end_s) for c in example.calls] == [
            (c.kind, c.request_ids, c.start_s, c.end_s) for c in simulated.calls
        ]
        assert not any(c.oom for c in simulated.calls)  # the comparison holds only where the simulator's calls all ran
    finally:
        sys.path.remove(str(EXAMPLE))
