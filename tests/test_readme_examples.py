"""Every example of the README and of every manual page runs, exits as the page says, and prints the numbers the page
states next to it.

The examples are the fenced ``bash`` blocks of ``PAGES`` (the README and every page of ``docs/``), read from the pages
themselves (nothing here copies a command or a number). A command's claims are:

- its trailing comment: ``exit N`` (``exit 0 or 1``: either, for a command whose outcome is the user's data; else
  ``error`` means exit 2, else 0), a variant's verdict (``compact AT RISK``: ``check`` prints the line
  ``AT RISK compact: ...``), verdict words (``AT RISK``, ``OOM``, ``FAIL``, ``PASS``), call numbers (``#8``) and
  quantities (``115.0 GiB``);
- for a block of one command, the paragraph right after it when that paragraph states its results (it begins
  "It exits N" or "On the seed"): its exit code, its quantities, its ``N of M`` counts and the ``--set KEY=VALUE``
  flags it quotes.

A quantity is a number with a unit (GiB, MiB, s, %, simulator runs); it is found when the output prints a number that
rounds to it at the page's precision (``115.0 GiB`` matches ``114.96``; tables print numbers without units).

The commands of one block run in order in one folder, so a command reads what an earlier one wrote (``import`` then
``check`` of the scenario it wrote). What a page's command reads from the user's world is ``PROVIDED`` here: a SkyRL
database (a synthetic one in the stated window, at a relative path), the base model's ``config.json``, the real
backend's RunResult (the committed one of ``validation/tiny-cpu-tp1``, which that command made). Skipped, each with
its reason: a synopsis with placeholders, a command that is no skyrl-sim command (an install, a test, a GPU script),
and what needs what no test here starts (the real backend, which ``tests/real/`` runs under the heavy lock; a live
Tinker service; a Postgres server).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from project_paths import ROOT
from skyrl_sim.results.band import band_for
from skyrl_sim.schema.scenario import load_scenario

# The front page and every manual page: every one of their examples is checked here.
PAGES: tuple[str, ...] = ("README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))))
CLI = Path(sys.executable).parent / "skyrl-sim"
COMMENT = re.compile(r"\s#\s(.*)$")
QUANTITY = re.compile(r"(\d[\d,]*(?:\.\d+)?)\s*(GiB|MiB|%|s\b|simulator runs)")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
COUNT = re.compile(r"\b(\d+) of (\d+)\b")
SET_FLAG = re.compile(r"--set ([\w.]+=[^\s`]+)")
VERDICTS = ("AT RISK", "OOM", "FAIL", "PASS")
VARIANT_VERDICT = re.compile(r"([\w.-]+) (PASS|FAIL|AT RISK)\b")
RESULTS_PARAGRAPH = re.compile(r"^(It exits (\d)|On the seed)")
SKIPS: tuple[tuple[str, str], ...] = (
    ("--backend megatron", "runs the real backend (tests/real/ runs it, under the heavy lock)"),
    ("--backends sim,megatron", "runs the real backend (tests/real/ runs it, under the heavy lock)"),
    ("--backend tinker", "needs a live Tinker service (tests/service/ starts one)"),
    ("postgresql://", "needs a Postgres server with a SkyRL database (tests/test_import_postgres.py starts one)"),
)
SKYRL_SIM = ("skyrl-sim", ".venv/bin/skyrl-sim")
"""How a page calls the command line (a plain install, or the repository's venv)."""


@dataclass
class Example:
    page: str
    line: int
    command: str
    comment: str
    after: str = ""  # the paragraph after the block, when it states this command's results
    claims: list[str] = field(default_factory=list)

    block: int = 0  # the index of its block on the page: a block's commands run in order in one folder

    @property
    def expected_exit(self) -> set[int]:
        for text in (self.comment, self.after):
            either = re.search(r"\bexits? (\d) or (\d)\b", text)
            if either:
                return {int(either.group(1)), int(either.group(2))}
            found = re.search(r"\bexits? (\d)\b", text)
            if found:
                return {int(found.group(1))}
        return {2} if self.comment.startswith("error") else {0}

    def skip_reason(self) -> str | None:
        words = shlex.split(self.command)
        if any("..." in w or w in ("SCENARIO", "SOURCE") or w.startswith("[") for w in words):
            return "a synopsis with placeholders, not a command"
        if words[0] not in SKYRL_SIM:
            return f"not a skyrl-sim command ({words[0]}: an install, a test or a GPU script)"
        if words[1] == "endpoints":  # from-skyrl's --backend is SkyRL's, read from a file: nothing is started
            return None
        for needle, reason in SKIPS:
            if needle in self.command:
                return reason
        return None


def open_quote(text: str) -> bool:
    """Whether ``text`` ends inside a quoted string (a JSON value spread over lines)."""
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return True
    return False


def examples(page: str) -> list[Example]:
    """Each command of a page's ``bash`` blocks (continued lines and open quotes joined), with its comment and
    results."""
    lines = (ROOT / page).read_text().splitlines()
    found: list[Example] = []
    i = 0
    blocks = 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        block: list[Example] = []
        blocks += 1
        i += 1
        pending = ""
        start = i
        while lines[i].strip() != "```":
            text = lines[i]
            if not pending:
                start = i
            if text.rstrip().endswith("\\"):
                pending += text.rstrip()[:-1] + " "
            elif open_quote(pending + text):
                pending += text.rstrip() + " "
            else:
                full = pending + text
                pending = ""
                if full.strip() and not full.lstrip().startswith("#"):
                    comment = COMMENT.search(full)
                    command = full[: comment.start()] if comment else full
                    example = Example(page, start + 1, " ".join(command.split()), comment.group(1) if comment else "")
                    example.block = blocks
                    block.append(example)
            i += 1
        i += 1
        paragraph = []
        j = i + 1 if i < len(lines) and not lines[i].strip() else i
        while j < len(lines) and lines[j].strip():
            paragraph.append(lines[j])
            j += 1
        after = " ".join(paragraph)
        if len(block) == 1 and RESULTS_PARAGRAPH.match(after):
            block[0].after = after
        found.extend(block)
    return found


EXAMPLES = [example for page in PAGES for example in examples(page)]


def pages_text() -> str:
    return "\n".join((ROOT / page).read_text() for page in PAGES)


def quantities(text: str) -> list[str]:
    return [m.group(1) for m in QUANTITY.finditer(text)]


def printed(number: str, output: str) -> bool:
    """A number printed in the output that rounds to ``number`` at its precision."""
    want = float(number.replace(",", ""))
    places = len(number.split(".")[1]) if "." in number else 0
    return any(round(float(n.replace(",", "")), places) == want for n in NUMBER.findall(output))


def test_the_pages_have_examples_to_run() -> None:
    runnable = [e for e in EXAMPLES if e.skip_reason() is None]
    assert len(runnable) >= 10 and any(e.after for e in runnable)


def test_every_page_is_read_and_most_examples_run() -> None:
    """Every page of the manual is read (a new page is covered without a list to update), each page that shows
    skyrl-sim commands runs at least one (unless each needs the real backend or a service), and no more than a third
    of the skyrl-sim commands found is skipped (the others are installs, the test suite and GPU scripts)."""
    assert set(PAGES) == {"README.md", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))}
    commands = [e for e in EXAMPLES if "placeholders" not in (e.skip_reason() or "")]
    commands = [e for e in commands if shlex.split(e.command)[0] in SKYRL_SIM]
    runnable = [e for e in commands if e.skip_reason() is None]
    needs = {reason for _, reason in SKIPS}
    for page in {e.page for e in commands if e.skip_reason() not in needs}:  # a page of real-backend runs is exempt
        assert any(e.page == page for e in runnable), f"{page}: no example of it runs"
    assert len(runnable) >= 2 * len(commands) / 3, [(e.page, e.line, e.skip_reason()) for e in commands]


def _synthetic_database(folder: Path) -> None:
    from skyrl_sim.traffic.synthetic_db import write_synthetic_db

    write_synthetic_db(folder / "tinker.db", 60, tenants=3, gap_s=30.0)  # from 2026-11-23, the pages' window


def _base_model(folder: Path) -> None:
    (folder / "Qwen3-4B").mkdir(exist_ok=True)
    (folder / "scenarios" / "endpoints").mkdir(parents=True, exist_ok=True)  # where the page writes the endpoint
    shutil.copy(ROOT / "tests" / "data" / "skyrl_launches" / "qwen3-4b-instruct-2507" / "config.json", folder / "Qwen3-4B")


def _real_run(folder: Path) -> None:
    """What ``run scenarios/queue_drain_17_tiny.yaml --backend megatron --all-variants --json real.json`` wrote on
    these machines: the committed real-backend run of the CPU validation."""
    source = ROOT / "validation" / "tiny-cpu-tp1" / "runs" / "queue_drain_17_tiny.megatron.json"
    if not (folder / "real.json").exists():
        shutil.copy(source, folder / "real.json")


PROVIDED: tuple[tuple[str, str, Callable[[Path], None]], ...] = (
    ("sqlite:////var/skyrl/tinker.db", "sqlite:///tinker.db", _synthetic_database),
    ("./Qwen3-4B/config.json", "./Qwen3-4B/config.json", _base_model),
    (" real.json ", " real.json ", _real_run),
)
"""(what a page's command names, what it runs with here, what puts it in the example's folder)."""


REPOSITORY_DATA = ("tests", "validation")
"""Folders of the repository a page's command may read from (the recorded database and log, committed runs): the
example's folder links them, as the repository's root holds them (an output is never written there)."""


def run_example(example: Example, folder: Path) -> subprocess.CompletedProcess[str]:
    """The example's command in its block's folder (the shipped scenarios resolve from anywhere), with what it reads
    from the user's world provided."""
    folder.mkdir(parents=True, exist_ok=True)
    command = f" {example.command} "
    for named, here, provide in PROVIDED:
        if named in command:
            provide(folder)
            command = command.replace(named, here)
    for name in REPOSITORY_DATA:
        if f" {name}/" in command and not (folder / name).exists():
            (folder / name).symlink_to(ROOT / name)
    argv = [str(CLI), *shlex.split(command)[1:]]
    env = {**os.environ, "COLUMNS": "400"}
    return subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=600, env=env)


def run_block(block: list[Example], folder: Path) -> dict[tuple[str, int], subprocess.CompletedProcess[str]]:
    """A block's runnable commands in order in one folder."""
    return {(e.page, e.line): run_example(e, folder) for e in block}


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], subprocess.CompletedProcess[str]]:
    """Every runnable example, two blocks at a time (the simulator is single-threaded; the machines have two cores)."""
    blocks: dict[tuple[str, int], list[Example]] = {}
    for e in EXAMPLES:
        if e.skip_reason() is None:
            blocks.setdefault((e.page, e.block), []).append(e)
    root = tmp_path_factory.mktemp("readme")
    runs: dict[tuple[str, int], subprocess.CompletedProcess[str]] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(run_block, b, root / f"{Path(p).stem}-block{n}") for (p, n), b in blocks.items()]
        for future in futures:
            runs.update(future.result())
    return runs


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{e.page}:{e.line}" for e in EXAMPLES])
def test_readme_example(example: Example, request: pytest.FixtureRequest) -> None:
    reason = example.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    done = request.getfixturevalue("example_runs")[(example.page, example.line)]
    output = " ".join((done.stdout + done.stderr).split())  # tables and wrapped flags read as one line
    where = f"{example.page} line {example.line}: {example.command}"
    assert done.returncode in example.expected_exit, f"{where}: exit {done.returncode}\n{output[-3000:]}"
    assert "Traceback" not in output, where
    claims = f"{example.comment} {example.after}"
    for verdict in VERDICTS:
        if verdict in example.comment:
            assert verdict in output, f"{where}: the page says {verdict}"
    for variant, verdict in VARIANT_VERDICT.findall(example.comment):
        assert f"{verdict} {variant}:" in output, f"{where}: the page says {variant} {verdict}"
    for call in re.findall(r"#(\d+)", example.comment):
        assert f"#{call}" in output, f"{where}: the page names call #{call}"
    for number in quantities(claims):
        assert printed(number, output), f"{where}: the page states {number}, the output does not print it"
    for done_count, total in COUNT.findall(example.after):
        assert f"{done_count}/{total}" in output or f"{done_count} of {total}" in output, where
    for flag in SET_FLAG.findall(example.after):
        assert f"--set {flag}" in output, f"{where}: the page quotes --set {flag}"


def test_every_sqlite_url_in_the_pages_is_the_path_it_means() -> None:
    """``sqlite:///var/x.db`` is the relative path var/x.db: a path under / needs four slashes."""
    urls = re.findall(r"sqlite:/{3,}[^\s`)]+", pages_text())
    assert urls
    for url in urls:
        database = make_url(url).database or ""
        if url.startswith("sqlite:////"):
            assert database.startswith("/"), url
        else:
            assert not database.startswith(("var/", "etc/", "tmp/", "home/")), f"{url} reads as the relative {database}"


def test_a_band_the_pages_state_is_the_band_the_tool_uses() -> None:
    text = pages_text()
    stated = re.findall(r"`([\w.-]+)`: ±([\d.]+)%, the largest of (\d+) per-call errors", text)
    assert stated
    for endpoint, percent, calls in stated:
        path = ROOT / "scenarios" / "endpoints" / f"{endpoint}.yaml"
        scenario = load_scenario(ROOT / "scenarios" / "queue_drain_17_tiny.yaml", str(path))
        band = band_for(scenario.resolve(scenario.variant_names[0]).endpoint, scenario.path)
        assert (f"{band.fraction * 100:.1f}", band.calls) == (percent, int(calls)), endpoint
