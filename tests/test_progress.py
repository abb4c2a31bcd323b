"""Progress on stderr: a rich bar on a terminal, plain lines when asked (``--progress``) off a terminal, nothing
otherwise; never on stdout (``--json -`` stays JSON); every long kind of work reports it (variants, a run's requests,
sweep points, advise's configurations, an import's rows)."""

from __future__ import annotations

import io
from pathlib import Path

import orjson
import pytest
from rich.console import Console

from project_paths import ROOT, SCENARIOS
from scenario_text import GOOD, write
from skyrl_sim.cli import main
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.reports import progress as progress_module
from skyrl_sim.schema.scenario import load_scenario

SEED = str(SCENARIOS / "queue_drain_17.yaml")
JAX_ENDPOINT = str(ROOT / "scenarios" / "endpoints" / "skyrl-jax-cpu.yaml")
RECORDED_DB = str(ROOT / "tests" / "data" / "skyrl-0.4.0-recorded" / "tinker.db")


@pytest.fixture
def immediate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Show progress from the first moment (the default waits 2 s, so a fast test would see none)."""
    monkeypatch.setenv(progress_module.AFTER_ENV, "0")
    monkeypatch.delenv(progress_module.MODE_ENV, raising=False)


def many_variants(tmp_path: Path, count: int = 6) -> Path:
    text = GOOD + "variants:\n" + "".join(f"  v{i}:\n    set: {{lora.rank: {i + 1}}}\n" for i in range(count))
    return write(tmp_path, text)


def test_asked_for_off_a_terminal_progress_is_plain_lines_on_stderr(tmp_path, capsys, immediate) -> None:
    assert main(["check", str(many_variants(tmp_path)), "--quiet", "--progress", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert len(orjson.loads(out)["runs"]) == 6  # stdout is the JSON document and nothing else
    lines = [line for line in err.splitlines() if line.startswith("progress: ")]
    assert any("tiny: variants" in line and "/6 run" in line for line in lines)
    assert any("v5 on sim" in line and "requests" in line and "(done)" in line for line in lines)


def test_off_a_terminal_there_is_no_progress_unless_asked(tmp_path, capsys, immediate, monkeypatch) -> None:
    path = str(many_variants(tmp_path))
    assert main(["check", path, "--quiet"]) == 0
    assert "progress:" not in capsys.readouterr().err
    monkeypatch.setenv(progress_module.MODE_ENV, "always")
    assert main(["check", path, "--quiet", "--no-progress"]) == 0
    assert "progress:" not in capsys.readouterr().err
    assert main(["check", path, "--quiet"]) == 0
    assert "progress:" in capsys.readouterr().err  # SKYRL_SIM_PROGRESS=always asks too


def test_on_a_terminal_it_is_a_rich_bar_that_goes_away(tmp_path, capsys, immediate, monkeypatch) -> None:
    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=120)
    monkeypatch.setattr(progress_module, "stderr_console", lambda: terminal)
    assert main(["check", str(many_variants(tmp_path)), "--quiet"]) == 0
    drawn = screen.getvalue()
    assert "tiny: variants" in drawn and "━" in drawn  # the bar was drawn on the terminal ...
    assert "progress:" not in capsys.readouterr().err  # ... and no plain lines besides it
    assert progress_module._DISPLAY.bar is None  # ... and it was taken down when the work ended


def test_a_run_tells_its_progress_request_by_request() -> None:
    variant = load_scenario(SEED).resolve("cap-aware")
    seen: list[int] = []
    PluginHost().run(variant, "sim", progress=seen.append)
    assert seen == sorted(seen) and seen[-1] == variant.request_count() == 17
    assert len(seen) == 17  # one report per call (cap 1: one request a call)


def test_a_progress_report_changes_no_result() -> None:
    variant = load_scenario(SEED).resolve("no-cap")
    assert (
        PluginHost().run(variant, "sim", progress=lambda done: None).to_json() == PluginHost().run(variant, "sim").to_json()
    )


def test_sweeps_and_replays_show_progress(tmp_path, capsys, immediate) -> None:
    grid = ["--grid", "engine.forward_backward_max_request_count=1,2"]
    assert main(["sweep", SEED, "--variant", "cap-aware", *grid, "--jobs", "1", "--progress"]) == 0
    assert "progress: sweeping 2 points" in capsys.readouterr().err
    assert main(["replay", RECORDED_DB, "--endpoint", JAX_ENDPOINT, "--quiet", "--progress"]) == 0
    err = capsys.readouterr().err
    assert f"progress: reading {RECORDED_DB}" in err and "rows" in err
    assert "progress: replay on sim" in err and "/34 requests" in err


def test_advise_counts_its_configurations() -> None:
    from skyrl_sim.commands.advise_evaluation import Evaluator
    from skyrl_sim.commands.advise_space import CAP
    from skyrl_sim.commands.executors import LocalExecutor

    seen: list[int] = []
    evaluate = Evaluator(load_scenario(SEED), None, "cap-aware", {}, LocalExecutor(1), on_evaluated=seen.append)
    for batch in ([{}], [{CAP: 2}, {}], [{CAP: 4}, {CAP: 4}]):  # a configuration already run is not run (or counted) again
        evaluate(batch)
    assert seen == [1, 2, 3]
