"""The front page stays a front page and the manual builds: README.md within 12 KiB with the two commands and an
accuracy summary that is the validations' own numbers, every page of docs/ in mkdocs.yml's nav, every relative link
of README.md and docs/ resolving (file and anchor), and ``mkdocs build --strict`` passing (and failing on a broken
link) where mkdocs is installed (the ``dev`` extra).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

from project_paths import ROOT

DOCS = ROOT / "docs"
FRONT_PAGE = ROOT / "README.md"
FRONT_PAGE_MAX_BYTES = 12 * 1024
TWO_COMMANDS = (
    "python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/skyrl-sim check scenarios/queue_drain_17.yaml",
    "bash scripts/test.sh",
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
HAS_MKDOCS = importlib.util.find_spec("mkdocs") is not None


def manual_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def prose(text: str) -> str:
    """A page without its code: links inside code blocks and code spans are examples, not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """A heading's anchor as MkDocs' toc extension makes it (GitHub makes the same one for plain ASCII headings)."""
    text = unicodedata.normalize("NFKD", INLINE_CODE.sub(lambda m: m.group(0)[1:-1], heading))
    text = re.sub(r"[^\w\s-]", "", text.encode("ascii", "ignore").decode()).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))}


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def nav_pages(entries: list) -> list[str]:
    found: list[str] = []
    for entry in entries:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            found += nav_pages(value) if isinstance(value, list) else [value]
    return found


def test_the_front_page_is_at_most_12_kib() -> None:
    size = FRONT_PAGE.stat().st_size
    assert size <= FRONT_PAGE_MAX_BYTES, f"README.md is {size:,} bytes, over {FRONT_PAGE_MAX_BYTES:,}: move some to docs/"


def test_the_front_page_keeps_the_two_commands_and_ci_runs_the_second() -> None:
    text = FRONT_PAGE.read_text()
    for command in TWO_COMMANDS:
        assert f"\n{command}\n" in text, f"README.md lost the command: {command}"
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("page", [FRONT_PAGE, *manual_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    for link in relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.relative_to(ROOT)}: the link {link} names no file"
        assert target.is_relative_to(ROOT), f"{page.relative_to(ROOT)}: the link {link} leaves the repository"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target), f"{page.relative_to(ROOT)}: {target.name} has no heading #{anchor}"


def _validate_script():  # noqa: ANN202 - a module loaded from its path
    spec = importlib.util.spec_from_file_location("validate_script", ROOT / "scripts" / "validate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def front_page_accuracy_rows() -> dict[str, list[str]]:
    """The cells of the front page's accuracy table, by row label."""
    section = FRONT_PAGE.read_text().split("## Accuracy in short", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines() if line.startswith("|")]
    return {row[0]: row[1:] for row in rows}


def test_the_front_page_accuracy_summary_is_the_validations_numbers() -> None:
    """Each cell of README's summary is computed here from validation/*/summary.json, as the accuracy page's table is."""
    validate = _validate_script()
    summaries = [json.loads(p.read_text()) for p in sorted((ROOT / "validation").glob("*/summary.json"))]
    summaries = [s for s in summaries if "calls_identical" in s]  # the training calls' validations, as on the page
    cpu = [s for s in summaries if validate.measured_where(s) == "CPU"]
    (gpu,) = [s for s in summaries if validate.measured_where(s) == "GPU"]  # the summary has one GPU column

    def span(key: str, digits: int) -> str:
        low, high = min(s[key] for s in cpu) * 100, max(s[key] for s in cpu) * 100
        return f"{low:.{digits}f}–{high:.{digits}f}%"

    def agreement(values: list[float]) -> str:
        return "100%" if min(values) == 1.0 else validate.pct(min(values))

    rows = front_page_accuracy_rows()
    assert rows[""][0] == f"CPU ({len(cpu)} validations)"
    identical = "all" if all(s["calls_identical"] for s in cpu) else "not all"
    assert rows["calls and shapes identical"][:2] == [identical, "yes" if gpu["calls_identical"] else "no"]
    oom = [agreement([s["oom_agreement"] for s in cpu]), agreement([gpu["oom_agreement"]])]
    assert rows["OOM verdicts agree"][:2] == oom
    measured = [s["oom_attempted_error_max"] for s in cpu if s["oom_attempted_error_max"] is not None]  # None: no OOM
    attempted = [validate.pct(max(measured)), validate.pct(gpu["oom_attempted_error_max"])]
    assert rows["attempted size of a failed allocation, max error"][:2] == attempted
    peak = [span("peak_memory_error_max", 1), validate.pct(gpu["peak_memory_error_max"])]
    assert rows["peak memory per call, max error"][:2] == peak
    duration = rows["call duration after calibration, median held-out error"]
    assert duration[0].startswith(span("duration_error_median", 0))
    assert duration[1] == validate.pct(gpu["duration_error_median"])


def test_the_link_checks_see_links_and_anchors(tmp_path: Path) -> None:
    assert any(link.startswith("docs/") for link in relative_links(FRONT_PAGE)), "README.md links to no manual page"
    page = tmp_path / "page.md"
    page.write_text("# A `code` title, here\n\n[a](b.md#c) ![img](i.png) `[x](y.md)` [web](https://e.org)\n\n```\n[z](w.md)\n```\n")
    assert relative_links(page) == ["b.md#c"]  # not an image, code, a code block or a URL
    assert anchors(page) == {"a-code-title-here"}
    assert slug("The real backend (`--backend megatron`)") == "the-real-backend-backend-megatron"


def test_every_manual_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_pages(config["nav"])
    assert len(listed) == len(set(listed)), "a page is in the nav twice"
    pages = {p.relative_to(DOCS).as_posix() for p in manual_pages()}
    assert set(listed) - pages == set(), "the nav names pages that do not exist"
    assert pages - set(listed) == set(), "pages in docs/ missing from mkdocs.yml's nav"


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not HAS_MKDOCS, reason="mkdocs is not installed (pip install -e '.[dev]' installs mkdocs==1.6.1)")
def test_the_manual_builds_strict(tmp_path: Path) -> None:
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "accuracy" / "index.html").is_file()
    accuracy = (tmp_path / "site" / "accuracy" / "index.html").read_text()
    assert 'href="../repository/validation/tiny-cpu-tp1/summary/"' in accuracy  # a repository file, copied in
    assert (tmp_path / "site" / "repository" / "validation" / "tiny-cpu-tp1" / "summary" / "index.html").is_file()


@pytest.mark.skipif(not HAS_MKDOCS, reason="mkdocs is not installed (pip install -e '.[dev]' installs mkdocs==1.6.1)")
@pytest.mark.parametrize("broken", ["[gone](no-such-page.md)", "[gone](../validation/no-such/summary.md)"])
def test_a_broken_link_fails_the_strict_build(tmp_path: Path, broken: str) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    (copy / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "manual_repository_links.py", copy / "scripts")
    for summary in ROOT.glob("validation/*/summary.md"):
        (copy / summary.parent.relative_to(ROOT)).mkdir(parents=True)
        shutil.copy(summary, copy / summary.relative_to(ROOT))
    assert build(copy / "mkdocs.yml", tmp_path / "site").returncode == 0  # the copy builds as it is
    index = copy / "docs" / "index.md"
    index.write_text(index.read_text() + f"\n{broken}\n")
    done = build(copy / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and broken.split("(")[1].rstrip(")") in done.stderr, done.stderr[-4000:]


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the CLI page is generated with Python 3.11's argparse")
def test_the_generated_reference_pages_match_the_code() -> None:
    """docs/cli.md and docs/hooks.md are what scripts/gen_reference.py makes from the parser and hookspecs now."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr


def test_a_stale_generated_page_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check compares text: a page that differs from the generated one is named as stale."""
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    monkeypatch.setattr(gen, "DOCS", tmp_path)
    monkeypatch.setenv("COLUMNS", gen.HELP_WIDTH)  # cli_page sets it: undone after, so later CLI tests keep LOG_WIDTH
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0
    (tmp_path / "hooks.md").write_text((tmp_path / "hooks.md").read_text().replace("Called by", "Caled by", 1))
    assert gen.main(["--check"]) == 1
