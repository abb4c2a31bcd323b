"""Sweeps: grid parsing, parallel points, find-max over a grid and by bisection, the CLI command."""

from __future__ import annotations

import json

import pytest

from project_paths import SCENARIOS
from skyrl_sim.cli import main
from skyrl_sim.commands.sweep import (
    Axis,
    Point,
    Sweep,
    bisect_max,
    find_max_by_bisection,
    find_max_in_grid,
    grid_points,
    parse_grid,
    run_sweep,
)
from skyrl_sim.errors import UserError
from test_reports import check_png

SEED17 = str(SCENARIOS / "queue_drain_17.yaml")
CAP = "engine.forward_backward_max_request_count"
AWARE = "engine.cap_aware_padding"


def test_parse_grid_reads_yaml_scalars_and_rejects_bad_axes():
    axes = parse_grid([f"{CAP}=1, 2,null", f"{AWARE}=true,false"])
    assert axes == [Axis(CAP, (1, 2, None)), Axis(AWARE, (True, False))]
    assert len(grid_points(axes)) == 6
    assert grid_points(axes)[:2] == [{CAP: 1, AWARE: True}, {CAP: 1, AWARE: False}]
    for bad, reason in (
        ("engine.cap_aware_padding", "expected KEY=V1,V2"),
        ("k=", "no values"),
        ("k=1,1", "repeated"),
    ):
        with pytest.raises(UserError, match=reason):
            parse_grid([bad])
    with pytest.raises(UserError, match="given twice"):
        parse_grid(["k=1", "k=2"])


def test_bisect_max_finds_the_threshold_in_logarithmic_steps():
    calls: list[int] = []

    def below(limit: int):
        def passes(value: int) -> bool:
            calls.append(value)
            return value <= limit

        return passes

    assert bisect_max(below(37), 1, 1000) == (37, len(calls))
    assert len(calls) <= 2 + 10  # the two ends, then log2(1000) halvings
    assert bisect_max(below(0), 1, 10)[0] is None
    assert bisect_max(below(50), 1, 10)[0] == 10
    with pytest.raises(UserError):
        bisect_max(below(1), 5, 1)


def test_find_max_in_grid_per_other_axis_and_non_monotone_note():
    def point(cap: int, aware: bool, ok: bool) -> Point:
        return Point({CAP: cap, AWARE: aware}, ok)

    sweep = Sweep(
        "s.yaml",
        "v",
        [Axis(CAP, (1, 2, 4, 8)), Axis(AWARE, (True, False))],
        "completed",
        [
            point(1, True, True),
            point(2, True, True),
            point(4, True, True),
            point(8, True, False),
            point(1, False, False),
            point(2, False, True),
            point(4, False, False),
            point(8, False, False),
        ],
    )
    found = {item["others"][AWARE]: item for item in find_max_in_grid(sweep, CAP)}
    assert found[True]["max_passing"] == 4 and found[True]["monotone"]
    assert found[False]["max_passing"] == 2 and found[False]["failing_below_max"] == [1]
    with pytest.raises(UserError, match="not a --grid key"):
        find_max_in_grid(sweep, "engine.other")


def test_sweep_of_the_seed_in_worker_processes():
    axes = parse_grid([f"{CAP}=1,16", f"{AWARE}=true,false"])
    sweep = run_sweep(SEED17, axes, variant="cap-aware", require="completed", workers=2)
    assert [p.settings for p in sweep.points] == grid_points(axes)
    by = {(p.settings[CAP], p.settings[AWARE]): p for p in sweep.points}
    # The seed's story: the cap with cap-aware padding completes everything; a 16-row call of the 35k row does not.
    assert by[(1, True)].passed and not by[(1, True)].oom
    assert not by[(1, False)].passed and by[(1, False)].oom
    assert not by[(16, True)].passed
    assert by[(1, True)].summary["padding_waste"] < by[(1, False)].summary["padding_waste"]
    # Against the variant's own expectations, only its own settings pass.
    strict = run_sweep(SEED17, parse_grid([f"{CAP}=1,2"]), variant="cap-aware", workers=1)
    assert [p.passed for p in strict.points] == [True, False]


def test_find_max_by_bisection_agrees_with_its_neighbours():
    sweep = find_max_by_bisection(SEED17, CAP, 1, 16, axes=[], variant="cap-aware", require="completed")
    (item,) = sweep.find_max
    best = item["max_passing"]
    assert best is not None and 1 <= best < 16
    ran = {p.settings[CAP]: p.passed for p in sweep.points}
    assert ran[best] and (best + 1 not in ran or not ran[best + 1])
    assert item["evaluated"] == len(sweep.points) <= 2 + 4


def test_cli_sweep_json_heatmap_and_find_max(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    plots = tmp_path / "plots"
    args = ["sweep", SEED17, "--variant", "cap-aware", "--grid", f"{CAP}=1,2", "--grid", f"{AWARE}=true,false"]
    args += ["--require", "completed", "--find-max", CAP, "--json", str(out), "--plots", str(plots), "--jobs", "2"]
    code = main(args)
    text = " ".join(capsys.readouterr().out.split())
    assert code == 1  # with cap-aware padding off, no cap passes
    assert f"largest {CAP} that passes (with {AWARE}=True): 2" in text
    data = json.loads(out.read_text())
    assert data["schema"] == "skyrl-sim/sweep/1" and len(data["points"]) == 4
    assert {"makespan_s", "latency_p95_s", "padding_waste", "peak_bytes_max", "oom_calls"} <= set(
        data["points"][0]["summary"]
    )
    check_png(plots / "heatmap.png")


def test_cli_sweep_bad_input_is_a_clear_error(capsys):
    assert main(["sweep", SEED17, "--grid", f"{CAP}=0,1"]) == 2
    assert "forward_backward_max_request_count" in capsys.readouterr().err
    assert main(["sweep", SEED17, "--grid", "engine.no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err
    assert main(["sweep", SEED17, "--grid", f"{CAP}=1", "--find-max", AWARE]) == 2
    assert main(["sweep", SEED17, "--find-max", CAP, "--between", "a:b"]) == 2
    assert main(["sweep", SEED17]) == 2
