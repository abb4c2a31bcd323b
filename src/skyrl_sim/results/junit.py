"""``check --junit-xml PATH``: the verdicts of a check as JUnit XML, the report format CI systems already display.

One ``<testsuite>`` named after the scenario, one ``<testcase>`` per variant (``classname`` the scenario, ``name``
the variant, ``time`` the wall seconds its simulation took):

- PASS: a plain test case, its summary line in ``<system-out>``;
- FAIL: ``<failure type="FAIL">``, its ``message`` the reasons ``check`` prints on the variant's verdict line (the unmet
  expectations, then each call that ran out of memory: where, and how much it tried to allocate), the body that line
  and one line per reason;
- AT RISK: ``<failure type="AT RISK">`` too, its message the calls inside the margin. ``check`` exits 1 on AT RISK, so
  the test report shows the same red the job does; ``<skipped>`` would show a grey test in a red job (Jenkins, GitLab
  and GitHub's test reporters all count skipped cases as not run), and hide the call that needs attention.

The file goes through ``results.outputs.write_atomic`` like every other output (its path is checked with the others
before the run starts).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from skyrl_sim.results.outputs import write_atomic
from skyrl_sim.results.result import RunResult
from skyrl_sim.results.verdict import PASS, Verdict


@dataclass(frozen=True)
class Case:
    """One variant of a check: its run, its verdict, the verdict line ``check`` printed (plain text), its seconds."""

    result: RunResult
    verdict: Verdict
    line: str
    seconds: float


def junit_document(scenario: str, cases: Sequence[Case]) -> ET.Element:
    """The ``<testsuites>`` element of one check: a suite for the scenario, a case per variant."""
    failures = sum(not case.verdict.passed for case in cases)
    total_s = sum(case.seconds for case in cases)
    root = ET.Element("testsuites", name="skyrl-sim check", tests=str(len(cases)), failures=str(failures))
    suite = ET.SubElement(
        root,
        "testsuite",
        name=scenario,
        tests=str(len(cases)),
        failures=str(failures),
        errors="0",
        skipped="0",
        time=f"{total_s:.3f}",
    )
    for case in cases:
        element = ET.SubElement(
            suite, "testcase", classname=scenario, name=case.result.variant, time=f"{case.seconds:.3f}"
        )
        if case.verdict.status == PASS:
            ET.SubElement(element, "system-out").text = case.line
            continue
        details = [case.line, *case.verdict.reasons]
        failure = ET.SubElement(element, "failure", type=case.verdict.status, message="; ".join(case.verdict.reasons))
        failure.text = "\n".join(details)
    return root


def write_junit(path: str | Path, scenario: str, cases: Sequence[Case]) -> None:
    """The JUnit XML of one check, written atomically to ``path``."""
    root = junit_document(scenario, cases)
    ET.indent(root)
    write_atomic(path, ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n")
