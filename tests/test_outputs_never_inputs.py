"""No output ever replaces an input, whichever way the input is named: one test per command that writes a file.

Every file a command reads is on the list its outputs are checked against: the scenario, the endpoint it names (by
name, looked up in ``endpoints/``, or by path), the endpoint's HF ``config.json`` and hardware profile, a saved
RunResult, the database, the service log, ``from-skyrl``'s ``--backend-config``. Each case names one input as an
output another way (``./x``, ``x/../x``, absolute, a symlink, a hard link): the command exits 2 with one line, no
traceback, and the input's bytes are unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from project_paths import ROOT
from scenario_text import run_cli
from skyrl_sim.traffic.synthetic_db import write_synthetic_db

HF_CONFIG = ROOT / "tests" / "data" / "skyrl_launches" / "tiny-qwen3" / "config.json"
CPU_PROFILE = ROOT / "src" / "skyrl_sim" / "data" / "hardware" / "cpu.yaml"

ENDPOINT = """name: tinyep
model: {config: ../hf/config.json}
hardware: {profile: prof.yaml, devices: 1, device_memory_gib: 8, reserve_gib: 0}
"""
SCENARIO = """name: s
endpoint: tinyep
workload:
  clients:
    - requests:
        - {type: forward_backward, lengths: [10, 20]}
variants:
  a: {}
  b: {set: {engine.cap_aware_padding: true}}
"""
INPUTS = {
    "scenario": "s.yaml",
    "endpoint": "endpoints/tinyep.yaml",
    "hf": "hf/config.json",
    "profile": "prof.yaml",
    "backend": "backend.json",
    "run": "run.json",
    "db": "tinker.db",
}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A RunResult of the scenario (for compare --against and calibrate), made once."""
    root = tmp_path_factory.mktemp("saved")
    make_tree(root)
    cwd = Path.cwd()
    os.chdir(root)
    try:
        from skyrl_sim.cli import main

        assert main(["run", "s.yaml", "--json", "out.json"]) == 0
    finally:
        os.chdir(cwd)
    return (root / "out.json").read_bytes()


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_synthetic_db(tmp_path_factory.mktemp("db") / "tinker.db", 12, tenants=2, gap_s=2.0).read_bytes()


def make_tree(root: Path) -> None:
    (root / "endpoints").mkdir(exist_ok=True)
    (root / "hf").mkdir(exist_ok=True)
    (root / "s.yaml").write_text(SCENARIO)
    (root / "endpoints" / "tinyep.yaml").write_text(ENDPOINT)
    shutil.copy(HF_CONFIG, root / "hf" / "config.json")
    shutil.copy(CPU_PROFILE, root / "prof.yaml")
    (root / "backend.json").write_text(json.dumps({"trainer.micro_train_batch_size_per_gpu": 2}))


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved_run: bytes, database: bytes) -> Path:
    make_tree(tmp_path)
    (tmp_path / "run.json").write_bytes(saved_run)
    (tmp_path / "tinker.db").write_bytes(database)
    monkeypatch.chdir(tmp_path)
    return tmp_path


SPELLINGS: dict[str, Callable[[Path, str], str]] = {
    "plain": lambda root, name: name,
    "dot": lambda root, name: f"./{name}",
    "updown": lambda root, name: f"hf/../{name}",
    "absolute": lambda root, name: str(root / name),
    "symlink": lambda root, name: _link(root, name, os.symlink),
    "hardlink": lambda root, name: _link(root, name, os.link),
}


def _link(root: Path, name: str, make: Callable[[str, str], None]) -> str:
    link = root / f"link-{make.__name__}-{Path(name).name}"
    make(str(root / name), str(link))
    return link.name


def refused(tree: Path, capsys: pytest.CaptureFixture[str], args: list[str], target: str) -> str:
    """The command must exit 2 naming the output as something it reads, with no traceback, and change no input."""
    before = {name: (tree / name).read_bytes() for name in INPUTS.values()}
    code, out = run_cli(args, capsys)
    assert code == 2, out
    assert "Traceback" not in out and "the command reads" in out, out
    for name, data in before.items():
        assert (tree / name).read_bytes() == data, f"{name} was replaced by {args}"
    assert not list(tree.glob(".*.tmp*")), "a temporary output was left behind"
    return out


# (input, command, output flag): every command that writes a file, against every kind of input it reads
FROM_SKYRL = ["endpoints", "from-skyrl", "--base-model", "hf", "--gpus", "1", "--backend-config", "backend.json"]
CASES = [
    ("endpoint", ["run", "s.yaml"], "--json"),
    ("hf", ["run", "s.yaml"], "--trace"),
    ("profile", ["run", "s.yaml"], "--json"),
    ("scenario", ["check", "s.yaml"], "--junit-xml"),
    ("endpoint", ["check", "s.yaml"], "--junit-xml"),
    ("profile", ["check", "s.yaml", "--variant", "b"], "--json"),
    ("endpoint", ["sweep", "s.yaml", "--grid", "engine.cap_aware_padding=true,false", "--jobs", "1"], "--json"),
    ("hf", ["sweep", "s.yaml", "--grid", "engine.cap_aware_padding=true,false", "--jobs", "1"], "--json"),
    ("endpoint", ["advise", "s.yaml", "--jobs", "1"], "--json"),
    ("profile", ["advise", "s.yaml", "--jobs", "1"], "--json"),
    ("endpoint", ["compare", "s.yaml", "--against", "run.json", "--backends", "sim"], "--json"),
    ("run", ["compare", "s.yaml", "--against", "run.json", "--backends", "sim"], "--json"),
    ("run", ["calibrate", "run.json", "--profile", "p", "--scenarios", "."], "--out"),
    ("profile", ["calibrate", "run.json", "--profile", "p", "--scenarios", "."], "--out"),
    ("scenario", ["calibrate", "run.json", "--profile", "p", "--scenarios", ".", "--out", "new.yaml"], "--json"),
    ("db", ["import", "tinker.db", "--endpoint", "endpoints/tinyep.yaml"], "--out"),
    ("endpoint", ["import", "tinker.db", "--endpoint", "endpoints/tinyep.yaml"], "--out"),
    ("hf", ["import", "tinker.db", "--endpoint", "endpoints/tinyep.yaml"], "--out"),
    ("db", ["replay", "tinker.db", "--endpoint", "endpoints/tinyep.yaml"], "--json"),
    ("endpoint", ["replay", "tinker.db", "--endpoint", "endpoints/tinyep.yaml"], "--scenario-out"),
    ("profile", ["replay", "tinker.db", "--endpoint", "endpoints/tinyep.yaml"], "--json"),
    ("backend", FROM_SKYRL, "--out"),
    ("hf", FROM_SKYRL, "--out"),
]


CASE_IDS = [f"{command[1] if command[0] == 'endpoints' else command[0]}-{flag}-{kind}" for kind, command, flag in CASES]


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize(("kind", "command", "flag"), CASES, ids=CASE_IDS)
def test_no_output_replaces_an_input(tree, capsys, kind, command, flag, spelling):
    target = SPELLINGS[spelling](tree, INPUTS[kind])
    refused(tree, capsys, [*command, flag, target], target)


def test_an_output_named_in_a_set_is_refused_when_the_set_reads_it(tree, capsys):
    """``--set model.config=...`` makes the HF config an input after the outputs were checked: refused as it is read."""
    other = tree / "hf2"
    other.mkdir()
    shutil.copy(HF_CONFIG, other / "config.json")
    args = ["check", "s.yaml", "--set", f"model.config={other / 'config.json'}", "--json", "hf2/config.json"]
    refused(tree, capsys, args, "hf2/config.json")
    assert (other / "config.json").read_bytes() == HF_CONFIG.read_bytes()


def test_outputs_that_are_no_input_are_written(tree, capsys):
    """The guard refuses inputs only: the same commands write their outputs beside them."""
    code, out = run_cli(["check", "s.yaml", "--json", "r.json", "--junit-xml", "./j.xml"], capsys)
    assert code == 0, out
    assert (tree / "r.json").stat().st_size and (tree / "j.xml").stat().st_size
    args = ["endpoints", "from-skyrl", "--base-model", "hf", "--gpus", "1", "--backend-config", "backend.json"]
    code, out = run_cli([*args, "--out", "ep.yaml"], capsys)
    assert code == 0, out


def test_the_service_log_and_a_read_profile_are_inputs_from_the_moment_they_are_read(tmp_path):
    """The tinker backend notes the service's log when the run starts (it reads the lines appended later); a profile
    read lazily, during the run, is checked as it is read: each is refused as an output, and the writer refuses to
    replace what was read even when no check ran."""
    from skyrl_sim.errors import UserError
    from skyrl_sim.results.outputs import Output, check_outputs, write_atomic
    from skyrl_sim.schema.command_files import command_scope
    from skyrl_sim.schema.hardware import load_profile
    from skyrl_sim.traffic.service_log import log_size

    log = tmp_path / "service.log"
    log.write_text("2026-11-29 10:21:31,354 - INFO - skyrl: started\n")
    with command_scope():
        log_size(log)
        with pytest.raises(UserError, match="is the service log the command reads"):
            check_outputs([Output("--json", str(log))])
    profile = tmp_path / "p.yaml"
    shutil.copy(CPU_PROFILE, profile)
    with command_scope():
        check_outputs([Output("--json", str(profile))])  # not read yet: a valid output
        with pytest.raises(UserError, match="is the hardware profile the command reads"):
            load_profile(str(profile))
    with command_scope():
        load_profile(str(profile))
        with pytest.raises(UserError, match="cannot write"):
            write_atomic(profile, b"replaced")
    assert profile.read_bytes() == CPU_PROFILE.read_bytes()
    write_atomic(profile, CPU_PROFILE.read_bytes())  # outside a command nothing is guarded (the Python API)


def test_save_runs_files_are_checked_before_the_run(tree, capsys):
    """``compare --save-runs DIR`` writes ``DIR/<scenario>.<backend>.json``: a run given to ``--against`` there is an
    input, refused before anything runs; ``replay --save-runs`` likewise for ``<name>.sim.json``."""
    saved = tree / "saved"
    saved.mkdir()
    shutil.copy(tree / "run.json", saved / "s.sim.json")
    args = ["compare", "s.yaml", "--against", "saved/s.sim.json", "--backends", "sim", "--save-runs", "saved"]
    out = refused(tree, capsys, args, "saved")
    assert out.strip().count("\n") == 0  # one line: refused before the comparison ran and printed its tables
    assert "--save-runs" in out and (saved / "s.sim.json").read_bytes() == (tree / "run.json").read_bytes()
    shutil.copy(tree / "tinker.db", saved / "week.sim.json")
    args = ["replay", "saved/week.sim.json", "--endpoint", "endpoints/tinyep.yaml", "--name", "week", "--save-runs", "saved"]
    out = refused(tree, capsys, args, "saved")
    assert out.strip().count("\n") == 0
    assert "--save-runs" in out and (saved / "week.sim.json").read_bytes() == (tree / "tinker.db").read_bytes()
