"""Every example of the README and of the manual pages that hold its sections that runs on the simulator runs, exits as
the page says, and prints the numbers the page states next to it.

The examples are the fenced ``bash`` blocks of ``PAGES``, read from the pages themselves (nothing here copies a command
or a number). A command's claims are:

- its trailing comment: ``exit N`` (else ``error`` means exit 2, else 0), a variant's verdict (``compact AT RISK``:
  ``check`` prints the line ``AT RISK compact: ...``), verdict words (``AT RISK``, ``OOM``, ``FAIL``, ``PASS``), call
  numbers (``#8``) and quantities (``115.0 GiB``);
- for a block of one command, the paragraph right after it when that paragraph states its results (it begins
  "It exits N" or "On the seed"): its exit code, its quantities, its ``N of M`` counts and the ``--set KEY=VALUE``
  flags it quotes.

A quantity is a number with a unit (GiB, MiB, s, %, simulator runs); it is found when the output prints a number that
rounds to it at the page's precision (``115.0 GiB`` matches ``114.96``; tables print numbers without units).
Commands that need what these tests do not start (the real backend, a live service or its database, Ray, an
install, a GPU script) or the output of such a command are skipped, each with its reason.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from project_paths import ROOT
from skyrl_sim.results.band import band_for
from skyrl_sim.schema.scenario import load_scenario

# The front page and the manual pages its sections moved to: every one of their examples is checked here.
PAGES: tuple[str, ...] = (
    "README.md",
    *(
        f"docs/{name}.md"
        for name in (
            "getting-started",
            "scenarios",
            "engine-rules",
            "memory-model",
            "moe-r3",
            "time-and-reports",
            "advise",
            "real-backend",
            "flash-and-seed-scale",
            "accuracy",
            "speed",
            "sweeps",
            "tinker-backend",
            "checks-and-exit-codes",
            "import-replay",
            "plugins",
            "options",
            "layout",
        )
    ),
)
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
    ("--backend megatron", "needs the real backend (megatron-core workers)"),
    ("--backend tinker", "needs a live Tinker service"),
    ("--executor ray", "starts a Ray instance (tests/test_executors.py runs the Ray executor)"),
    ("sqlite:///", "needs a service's SkyRL database (tests/test_import_replay.py imports a recorded one)"),
    ("postgresql://", "needs a Postgres server with a SkyRL database"),
    ("last-week.yaml", "reads the scenario the import example writes from a service's database"),
    ("real.json", "reads a RunResult of the real backend"),
    ("my-cpu.yaml", "reads the profile the calibrate example fits to real runs"),
)


@dataclass
class Example:
    page: str
    line: int
    command: str
    comment: str
    after: str = ""  # the paragraph after the block, when it states this command's results
    claims: list[str] = field(default_factory=list)

    @property
    def expected_exit(self) -> int:
        for text in (self.comment, self.after):
            found = re.search(r"\bexits? (\d)\b", text)
            if found:
                return int(found.group(1))
        return 2 if self.comment.startswith("error") else 0

    def skip_reason(self) -> str | None:
        words = shlex.split(self.command)
        if any("..." in w or w in ("SCENARIO", "SOURCE") or w.startswith("[") for w in words):
            return "a synopsis with placeholders, not a command"
        if words[0] != "skyrl-sim":
            return f"not a skyrl-sim command ({words[0]}: an install, a test or a GPU script)"
        for needle, reason in SKIPS:
            if needle in self.command:
                return reason
        return None


def examples(page: str) -> list[Example]:
    """Each command of a page's ``bash`` blocks (continued lines joined), with its comment and results."""
    lines = (ROOT / page).read_text().splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        block: list[Example] = []
        i += 1
        pending = ""
        start = i
        while lines[i].strip() != "```":
            text = lines[i]
            if not pending:
                start = i
            if text.rstrip().endswith("\\"):
                pending += text.rstrip()[:-1] + " "
            else:
                full = pending + text
                pending = ""
                if full.strip() and not full.lstrip().startswith("#"):
                    comment = COMMENT.search(full)
                    command = full[: comment.start()] if comment else full
                    block.append(Example(page, start + 1, " ".join(command.split()), comment.group(1) if comment else ""))
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


def run_example(example: Example, folder: Path) -> subprocess.CompletedProcess[str]:
    """The example's command in a fresh folder (the shipped scenarios resolve from anywhere)."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = [str(CLI), *shlex.split(example.command)[1:]]
    env = {**os.environ, "COLUMNS": "400"}
    return subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], subprocess.CompletedProcess[str]]:
    """Every runnable example, two at a time (the simulator is single-threaded; the machines have two cores)."""
    runnable = [e for e in EXAMPLES if e.skip_reason() is None]
    root = tmp_path_factory.mktemp("readme")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            (e.page, e.line): pool.submit(run_example, e, root / f"{Path(e.page).stem}-line{e.line}") for e in runnable
        }
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{e.page}:{e.line}" for e in EXAMPLES])
def test_readme_example(example: Example, request: pytest.FixtureRequest) -> None:
    reason = example.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    done = request.getfixturevalue("example_runs")[(example.page, example.line)]
    output = " ".join((done.stdout + done.stderr).split())  # tables and wrapped flags read as one line
    where = f"{example.page} line {example.line}: {example.command}"
    assert done.returncode == example.expected_exit, f"{where}: exit {done.returncode}\n{output[-3000:]}"
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
