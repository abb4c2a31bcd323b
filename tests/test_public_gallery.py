"""The gallery of public reports (``scenarios/public/``): every file goes through ``check``, and each variant either
reproduces its report's outcome or is a known miss that still misses (``schema.public_case``).

A known miss that starts passing fails here too, so the mark is removed when the model learns the case, never left to
hide a change; and a variant that stops reproducing its report fails as any regression does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from project_paths import ROOT
from skyrl_sim.cli import main
from skyrl_sim.schema.scenario import load_scenario

GALLERY = ROOT / "scenarios" / "public"
CASES = sorted(GALLERY.glob("*.yaml"))


def unmet_by_variant(path: Path, tmp_path: Path) -> tuple[int, dict[str, list[str]]]:
    """``check``'s exit code on the file and each variant's unmet expectations, read from its ``--json``."""
    out = tmp_path / "check.json"
    code = main(["check", str(path), "--quiet", "--json", str(out)])
    runs = json.loads(out.read_text())["runs"]
    return code, {run["variant"]: run["verdict"]["problems"] for run in runs}


def assert_reproduced_or_known(path: Path, tmp_path: Path) -> None:
    public = load_scenario(path).scenario.public
    assert public is not None, f"{path.name}: a gallery file names its report in a public: block"
    code, unmet = unmet_by_variant(path, tmp_path)
    assert code in (0, 1), f"{path.name}: check exited {code}"
    for variant, problems in unmet.items():
        reason = public.miss_reason(variant)
        if reason is None:
            assert not problems, f"{path.name} [{variant}] no longer reproduces {public.report}: {problems}"
        else:
            assert problems, f"{path.name} [{variant}] now reproduces {public.report}: remove it from known_misses"


@pytest.mark.parametrize("path", CASES, ids=[path.stem for path in CASES])
def test_public_case(path: Path, tmp_path: Path) -> None:
    assert_reproduced_or_known(path, tmp_path)


GALLERY_CASE = """\
name: gallery-case
endpoint: tiny-cpu-tp1
public:
  report: a report
  url: https://example.org/report
  states: [one 900-token forward_backward on a tiny model runs out of memory at micro batch 8]
  assumed: [the tiny CPU endpoint]
  known_misses: {KNOWN}
workload:
  clients:
    - name: c
      model_id: m
      requests: [{type: forward_backward, lengths: [900]}]
variants:
  reproduced:
    set: {trainer.micro_train_batch_size_per_gpu: 1}
    expect: {all_completed: true}
  missed:
    set: {trainer.micro_train_batch_size_per_gpu: 1}
    expect: {oom_calls: 1, failed: 1}
"""


def gallery_file(tmp_path: Path, known: str) -> Path:
    path = tmp_path / "case.yaml"
    path.write_text(GALLERY_CASE.replace("{KNOWN}", known))
    (tmp_path / "endpoints").mkdir()
    (tmp_path / "endpoints" / "tiny-cpu-tp1.yaml").write_text((ROOT / "scenarios/endpoints/tiny-cpu-tp1.yaml").read_text())
    return path


def test_a_known_miss_that_still_misses_is_accepted(tmp_path: Path) -> None:
    assert_reproduced_or_known(gallery_file(tmp_path, "{missed: the model runs one row}"), tmp_path)


def test_a_miss_not_marked_fails_the_gallery(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="no longer reproduces"):
        assert_reproduced_or_known(gallery_file(tmp_path, "{}"), tmp_path)


def test_a_known_miss_that_passes_must_be_unmarked(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="remove it from known_misses"):
        assert_reproduced_or_known(gallery_file(tmp_path, "{missed: x, reproduced: y}"), tmp_path)


@pytest.mark.parametrize(
    ("known", "key"),
    [("{nowhere: a reason}", "public.known_misses.nowhere"), ("{missed: '  '}", "public.known_misses")],
)
def test_a_known_miss_names_a_variant_and_a_reason(tmp_path: Path, known: str, key: str, capsys) -> None:
    assert main(["check", str(gallery_file(tmp_path, known)), "--quiet"]) == 2
    assert key in capsys.readouterr().err


def test_check_says_which_report_a_known_miss_misses(tmp_path: Path, capsys) -> None:
    assert main(["check", str(gallery_file(tmp_path, "{missed: the model runs one row}")), "--quiet"]) == 1
    assert "known miss of a report: the model runs one row" in capsys.readouterr().out


@pytest.mark.parametrize("path", CASES, ids=[path.stem for path in CASES])
def test_a_case_names_its_report_by_number_as_its_url_does(path: Path) -> None:
    """The report's number is in its name (``report: SkyRL PR #2051`` unquoted reads as ``SkyRL PR``: YAML starts a
    comment at `` #``), and it is the number the URL ends with."""
    public = load_scenario(path).scenario.public
    assert public is not None
    number = public.url.rstrip("/").rsplit("/", 1)[-1]
    assert f"#{number}" in public.report, (public.report, public.url)
