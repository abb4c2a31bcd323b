"""The one writer of every output (``results/outputs.py``): what it refuses before any work, and how it writes.

No test here writes to a real device: device nodes are made in the test's own folder (``mknod`` as root; a named pipe
otherwise), so a regression can only replace a node the test made.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scenario_text import GOOD, write
from scenario_text import run_cli as cli
from skyrl_sim.cli import main
from skyrl_sim.errors import UserError
from skyrl_sim.results.outputs import Output, check_outputs, write_atomic, write_with


def special_files(tmp_path: Path) -> dict[str, Path]:
    """A named pipe, and (as root) a character device like /dev/full, in the test's folder."""
    made = {"pipe": tmp_path / "pipe"}
    os.mkfifo(made["pipe"])
    if os.geteuid() == 0:
        made["device"] = tmp_path / "full"
        os.mknod(made["device"], stat.S_IFCHR | 0o666, os.makedev(1, 7))
    return made


def unchanged(path: Path, kind: int) -> bool:
    return stat.S_IFMT(os.lstat(path).st_mode) == kind


def test_non_regular_files_are_never_replaced(tmp_path, capsys):
    scenario = write(tmp_path, GOOD)
    for name, target in special_files(tmp_path).items():
        kind = stat.S_IFMT(os.lstat(target).st_mode)
        for flag in ("--json", "--trace"):
            code, out = cli(["check", str(scenario), flag, str(target)], capsys)
            assert code == 2 and "replaces only regular files" in out and "PASS" not in out, (name, out)
            assert unchanged(target, kind)
        link = tmp_path / f"link-to-{name}"
        link.symlink_to(target)
        code, out = cli(["check", str(scenario), "--json", str(link)], capsys)
        assert code == 2 and "replaces only regular files" in out
        assert link.is_symlink() and unchanged(target, kind)
        with pytest.raises(UserError, match="replaces only regular files"):  # the writer itself refuses too
            write_atomic(target, b"x")
        assert unchanged(target, kind)


def test_a_symlink_is_written_through_and_kept(tmp_path, capsys):
    target = tmp_path / "real.json"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "latest.json"
    link.symlink_to(target.name)
    assert cli(["check", str(write(tmp_path, GOOD)), "--json", str(link)], capsys)[0] == 0
    assert link.is_symlink() and json.loads(target.read_text())["schema"] == "skyrl-sim/run/1"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # a replaced file keeps its permissions


def test_new_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "a.json", b"{}")
        write_with(tmp_path / "sub" / "b.png", lambda temp: temp.write_bytes(b"png"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "sub" / "b.png").stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.json", "b.png", "sub"]  # no temporary file left


def test_two_outputs_never_share_a_file(tmp_path, capsys, monkeypatch):
    scenario = write(tmp_path, GOOD)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h1.json").write_text("x")
    os.link(tmp_path / "h1.json", tmp_path / "h2.json")
    (tmp_path / "ln.json").symlink_to("same.json")
    for first, second in (
        ("same.json", "same.json"),
        ("same.json", "./same.json"),
        ("same.json", str(tmp_path / "same.json")),
        ("same.json", "ln.json"),  # one through a symlink
        ("h1.json", "h2.json"),  # hard links: one file
    ):
        code, out = cli(["check", str(scenario), "--json", first, "--trace", second], capsys)
        assert code == 2 and "are the same path" in out and "PASS" not in out, (first, second, out)
    code, out = cli(["check", str(scenario), "--json", "out", "--plots", "out"], capsys)
    assert code == 2 and "are the same path" in out
    code, out = cli(["check", str(scenario), "--json", "-", "--trace", "-"], capsys)
    assert code == 2 and "only one output can go to stdout" in out
    assert (tmp_path / "h1.json").read_text() == "x"


def test_no_output_replaces_an_input(tmp_path, capsys):
    scenario = write(tmp_path, GOOD)
    before = scenario.read_bytes()
    code, out = cli(["check", str(scenario), "--json", str(scenario)], capsys)
    assert code == 2 and "is the scenario file the command reads" in out
    run = tmp_path / "run.json"
    assert cli(["run", str(scenario), "--json", str(run)], capsys)[0] == 0
    saved = run.read_bytes()
    code, out = cli(["calibrate", str(run), "--profile", "p", "--out", str(run)], capsys)
    assert code == 2 and "is a measured run the command reads" in out
    code, out = cli(["compare", str(scenario), "--backends", "sim", "--against", str(run), "--json", str(run)], capsys)
    assert code == 2 and "(--against)" in out
    assert scenario.read_bytes() == before and run.read_bytes() == saved


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        ("/proc/skyrl-sim-test.json", "is not writable"),
        ("{tmp}/" + "n" * 300 + ".json", "longer than the file system allows"),
        ("{tmp}/" + "/".join(["d" * 200] * 25) + "/x.json", "longer than the file system allows"),
        ("{tmp}/missing/x.json", "does not exist"),
        ("{tmp}/", "names a directory"),
        ("{tmp}/file.json/x.json", "Not a directory"),
        ("{tmp}/loop.json", "symbolic links"),
    ],
)
def test_unwritable_paths_are_refused_before_the_run(tmp_path, capsys, target, needle):
    if target.startswith("/proc") and not Path("/proc").is_dir():
        pytest.skip("no /proc")
    (tmp_path / "file.json").write_text("x")
    (tmp_path / "loop.json").symlink_to("loop.json")
    code, out = cli(["check", str(write(tmp_path, GOOD)), "--json", target.format(tmp=tmp_path)], capsys)
    assert code == 2 and needle in out and "PASS" not in out, out


def test_a_plot_or_run_name_taken_by_a_directory_is_one_error(tmp_path, capsys):
    scenario = write(tmp_path, GOOD)
    plots = tmp_path / "plots"
    (plots / "latency_cdf.png").mkdir(parents=True)
    code, out = cli(["run", str(scenario), "--plots", str(plots)], capsys)
    assert code == 2 and "latency_cdf.png" in out and "replaces only regular files" in out and "Traceback" not in out


def test_check_outputs_reports_the_flag_and_checks_stdout_use():
    with pytest.raises(UserError, match="--out '-': this output cannot go to stdout"):
        check_outputs([Output("--out", "-", stdout=False)])
    with pytest.raises(UserError, match="--save-runs '': an empty path"):
        check_outputs([Output("--save-runs", "", "dir", stdout=False)])
    check_outputs([Output("--json", None), Output("--plots", None, "dir")])  # nothing asked: nothing to check


def run_closed_or_full(scenario: Path, args: list[str], stdout: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skyrl_sim", "check", str(scenario), *args],
        stdout=stdout,  # type: ignore[arg-type]
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
    )


def test_a_full_closed_or_broken_stdout_is_one_line(tmp_path):
    scenario = write(tmp_path, GOOD)
    if Path("/dev/full").exists():
        for args in ([], ["--json", "-"]):
            with open("/dev/full", "w") as full:
                proc = run_closed_or_full(scenario, args, full)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr
            lines = proc.stderr.strip().splitlines()  # with --json -, the tables go to stderr before it
            assert lines[-1] == "error: stdout: cannot write to it: No space left on device"
            assert sum("error" in line for line in lines) == 1
    read, written = os.pipe()
    os.close(read)  # a reader that is gone: the first write is EPIPE
    try:
        proc = run_closed_or_full(scenario, ["--json", "-"], written)
    finally:
        os.close(written)
    assert proc.returncode == 141 and "Traceback" not in proc.stderr
    assert "pipe was closed" in proc.stderr.strip().splitlines()[-1] and proc.stderr.count("error") == 1
    proc = subprocess.run(  # started with stdout closed, as `>&-` does
        [sys.executable, "-m", "skyrl_sim", "check", str(scenario), "--json", "-"],
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.close(1),
    )
    assert proc.returncode == 2 and "stdout: is closed" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------ property test

PATH_PARTS = st.sampled_from(
    ["new.json", "file.json", "pipe", "dir", "link-file", "link-pipe", "link-dir", "loop", "missing/x.json", "file.json/x",
     "n" * 300, ".", "..", "", "-", "dir/", "dir/new.json", "[/red].json", "a\nb.json", "\udcff.json", "/proc/x.json"]
)  # fmt: skip


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(json_path=PATH_PARTS, trace_path=PATH_PARTS | st.none(), relative=st.booleans())
def test_any_output_paths_are_written_or_refused_in_one_line(tmp_path_factory, capsys, json_path, trace_path, relative):
    folder = tmp_path_factory.mktemp("out")
    scenario = write(folder, GOOD)
    (folder / "file.json").write_text("old")
    os.mkfifo(folder / "pipe")
    (folder / "dir").mkdir()
    for name, target in (("link-file", "file.json"), ("link-pipe", "pipe"), ("link-dir", "dir"), ("loop", "loop")):
        (folder / name).symlink_to(target)
    before = {p.name: stat.S_IFMT(os.lstat(p).st_mode) for p in folder.iterdir()}

    def place(part: str) -> str:
        if part in ("-", "") or part.startswith("/") or relative:
            return part
        return str(folder / part)

    args = ["check", str(scenario), "--quiet", "--json", place(json_path)]
    if trace_path is not None:
        args += ["--trace", place(trace_path)]
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        code = main(args)
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert code in (0, 2) and "Traceback" not in err, err
    for name, kind in before.items():  # nothing that was there changed kind: no pipe, link or folder replaced
        assert stat.S_IFMT(os.lstat(folder / name).st_mode) == kind, name
    assert (folder / "pipe").exists() and stat.S_ISFIFO(os.stat(folder / "pipe").st_mode)
    left = [p for p in folder.rglob(".*") if ".tmp" in p.name or p.name.startswith(".skyrl-sim-probe")]
    assert not left, f"left behind: {left}"
