"""Every file goes through the documents loader. ``endpoints from-skyrl --backend-config``: a file or an inline JSON
object gets a scenario file's limits and messages (size, UTF-8, nesting, NaN, duplicate keys), a missing file is "no
such file", and the report echoes no value at length. The ``validation/`` folders the memory band reads (looked for in
the working directory too): a file there that is not what the tool writes is no validation, never a traceback."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from project_paths import ROOT
from scenario_text import run_cli
from skyrl_sim.schema.limits import MAX_DOCUMENT_BYTES, MAX_NESTING

MODEL = str(ROOT / "tests" / "data" / "skyrl_launches" / "tiny-qwen3" / "config.json")
BASE = ["endpoints", "from-skyrl", "--base-model", MODEL, "--gpus", "1", "--backend-config"]


def deep_object(levels: int) -> str:
    return '{"a":' * levels + "1" + "}" * levels


def deep_list(levels: int) -> str:
    return '{"a":' + "[" * levels + "]" * levels + "}"


FILES = [
    (b'{"trainer.micro_train_batch_size_per_gpu": "caf\xe9"}', "not UTF-8 text"),
    (b"\xff\xfe" + '{"a": 1}'.encode("utf-16-le"), "UTF-16"),
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (deep_object(3000).encode(), f"nested deeper than {MAX_NESTING} levels"),
    (deep_list(3000).encode(), f"nested deeper than {MAX_NESTING} levels"),
    (deep_list(MAX_NESTING + 1).encode(), f"nested deeper than {MAX_NESTING} levels"),
    (b'{"a": NaN}', "NaN is not a number JSON allows"),
    (b"[1, 2]", "must be a JSON object"),
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
]


@pytest.mark.parametrize(("raw", "reason"), FILES, ids=[reason[:20] for _, reason in FILES])
def test_a_bad_backend_config_file_is_one_line(tmp_path, capsys, raw, reason):
    path = tmp_path / "backend.json"
    path.write_bytes(raw)
    code, out = run_cli([*BASE, str(path)], capsys)
    assert code == 2, out
    assert reason in out and "Traceback" not in out, out
    if reason != "must be a JSON object":
        assert f"--backend-config {path}" in out  # names the flag and the file


INLINE = [
    (deep_object(3000), "nested deeper than"),
    (deep_list(3000), "nested deeper than"),
    ('{"a": Infinity}', "Infinity is not a number JSON allows"),
    ('{"a": 1, "a": 1}', "duplicate key 'a'"),
    ('{"a": "\udcff"}', "not UTF-8 text"),  # an argument's undecodable byte, as Python passes it on
    ("{" + " " * MAX_DOCUMENT_BYTES + "}", "over the limit"),
]


@pytest.mark.parametrize(("text", "reason"), INLINE, ids=[reason[:20] for _, reason in INLINE])
def test_an_inline_backend_config_has_the_same_limits(capsys, text, reason):
    code, out = run_cli([*BASE, text], capsys)
    assert code == 2 and reason in out and "--backend-config:" in out and "Traceback" not in out, out[-500:]


def test_a_long_argument_that_is_no_object_is_echoed_cut_short(capsys):
    """An argument that does not start with ``{`` is a path: a long one (a nested list) is named cut short."""
    code, out = run_cli([*BASE, "[" * 3000 + "]" * 3000], capsys)
    assert code == 2 and "--backend-config [[[" in out and "(6,000 characters)" in out and len(out) < 1000, out[-500:]


def test_missing_special_and_huge_files_are_refused_before_reading(tmp_path, capsys):
    code, out = run_cli([*BASE, str(tmp_path / "none.json")], capsys)
    assert code == 2 and "no such file" in out and "not JSON" not in out, out
    code, out = run_cli([*BASE, str(tmp_path)], capsys)
    assert code == 2 and "a directory" in out, out
    if Path("/dev/zero").exists():
        code, out = run_cli([*BASE, "/dev/zero"], capsys)
        assert code == 2 and "not a regular file" in out, out
    huge = tmp_path / "huge.json"
    with huge.open("wb") as handle:  # 300 MiB, sparse: refused by its size, never read
        handle.truncate(300 * 2**20)
    started = time.process_time()
    code, out = run_cli([*BASE, str(huge)], capsys)
    assert code == 2 and "over the limit of 4,194,304" in out, out
    assert len(out) < 1000  # nothing of the file is echoed
    assert time.process_time() - started < 5.0  # a whole read and parse took 35 s


def test_the_report_cuts_long_keys_and_values(tmp_path, capsys):
    long_value = "v" * 2**20
    config = {"trainer.typo": long_value, "k" * 5000: 1, "trainer.micro_train_batch_size_per_gpu": 2}
    path = tmp_path / "backend.json"
    path.write_text(json.dumps(config))
    code, out = run_cli([*BASE, str(path)], capsys)
    assert code == 0, out[-2000:]
    assert max(len(line) for line in out.splitlines()) < 600
    assert "(1,048,578 characters)" in out and "(5,000 characters)" in out


VALIDATION_FILES = [
    ("summary.json", b"[1]"),
    ("summary.json", b"\xff\xfe{}"),
    ("summary.json", b'{"endpoint": "foo", "layer_spec": "local", "peak_memory_error_max": "nan"}'),
    ("summary.json", b'{"endpoint": "foo", "layer_spec": ' + b"[" * 3000 + b"]" * 3000 + b"}"),
    ("compare.json", b'{"variants": [{"calls": [{"peak_error": "x"}]}]}'),
    ("compare.json", b"[[["),
    ("endpoint", b"trainer: \xff"),
    ("endpoint", b"trainer: [1]"),
]


@pytest.mark.parametrize(("name", "raw"), VALIDATION_FILES)
def test_a_hostile_validation_folder_in_the_working_directory_is_no_validation(tmp_path, capsys, monkeypatch, name, raw):
    from scenario_text import GOOD

    folder = tmp_path / "validation" / "foo"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text('{"endpoint": "foo", "layer_spec": "local"}')
    (tmp_path / "scenarios" / "endpoints").mkdir(parents=True)
    if name == "endpoint":
        (tmp_path / "scenarios" / "endpoints" / "foo.yaml").write_bytes(raw)
    else:
        (folder / name).write_bytes(raw)
    (tmp_path / "s.yaml").write_text(GOOD)
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(["check", "s.yaml", "--quiet"], capsys)
    assert code == 0 and "Traceback" not in out, out
