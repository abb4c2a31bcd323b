"""Numbers at the edges and hostile flags: every flag and ``--set`` value is parsed with the limits of scenario files.

NaN, infinities and absurd sizes in ``--margin``, ``--slow``, ``--jobs``; 5,000-digit integers in ``--set``, in
``--between`` and in JSON or YAML scenarios; a ``--set`` path segment that is a Unicode digit (``clients.²``); lone
surrogates; grids of 10^9 points; Ray addresses that are closed or are no Ray cluster. Each is exit 2 with one line.
Property tests draw flags and ``--set`` values and hold every outcome to exit 0, 1 or 2 (never 3).
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scenario_text import GOOD, write
from scenario_text import run_cli as cli
from skyrl_sim.cli import main
from skyrl_sim.commands.executors import check_reachable, ray_endpoint
from skyrl_sim.errors import UserError
from skyrl_sim.schema.limits import MAX_JOBS

BIG = "9" * 5000


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("flags"), GOOD)


def refused(args: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    code, out = cli(args, capsys)
    assert code == 2 and "Traceback" not in out and "internal error" not in out, out
    for needle in needles:
        assert needle in out, (needle, out)
    return out


@pytest.mark.parametrize("margin", ["nan", "inf", "-inf", "1e308", "1e308%", "nan%", "inf%", "-1", "1001%", "abc", ""])
def test_margin_must_be_a_finite_size_or_percentage(scenario, capsys, margin):
    refused(["check", str(scenario), f"--margin={margin}"], capsys, f"--margin '{margin}'")


@pytest.mark.parametrize("margin", ["0", "5%", "2.5GiB", "1e-400"])
def test_margins_within_the_limits_run(scenario, capsys, margin):
    assert cli(["check", str(scenario), "--margin", margin], capsys)[0] in (0, 1)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (f"trainer.micro_train_batch_size_per_gpu={BIG}", "a number of 5,000 digits"),
        (f"engine.forward_backward_max_request_count=-{BIG}", "a number of 5,000 digits"),
        ("workload.clients.².start_s=1", "'²' is not an index"),
        (f"workload.clients.{BIG}.start_s=1", "is not an index"),
        ("workload.clients.99999999999999999999.start_s=1", "is not an index"),
        ("engine..cap_aware_padding=true", "an empty key"),
        ("name=\udcff", "not valid UTF-8"),  # an argument whose bytes were not UTF-8
        ("workload.clients.0.start_s=1e400", "start_s"),
        ("hardware.device_memory_gib=.nan", "device_memory_gib"),
    ],
)
def test_set_values_at_the_edges(scenario, capsys, override, needle):
    refused(["check", str(scenario), "--set", override], capsys, needle)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"name": "x", "endpoint": "tiny-cpu-tp1", "n": ' + BIG + "}", "a number of 5,000 digits"),
        ('{"name": "x\\ud800", "endpoint": "tiny-cpu-tp1"}', "lone surrogate"),
        ('{"name": "x", "description": "\\udfff", "endpoint": "tiny-cpu-tp1"}', "lone surrogate"),
        (GOOD.replace("lengths: [10, 20]", f"lengths: [10, {BIG}]"), "a number of 5,000 digits"),
        (GOOD.replace("name: tiny", 'name: "\\U0000D800"'), "invalid Unicode"),  # PyYAML refuses it itself
    ],
)
def test_documents_with_huge_numbers_or_lone_surrogates(tmp_path, capsys, text, needle):
    refused(["check", str(write(tmp_path, text, "s.json" if text.startswith("{") else "s.yaml"))], capsys, needle)


def test_an_escaped_surrogate_pair_is_one_character_and_passes(tmp_path, capsys):
    import json

    import yaml

    body = yaml.safe_load(GOOD)
    text = json.dumps(body).replace('"tiny"', '"tiny \\ud83d\\ude00"')  # JSON joins a pair into one character
    assert "\\ud83d" in text
    assert cli(["check", str(write(tmp_path, text, "s.json"))], capsys)[0] == 0


@pytest.mark.parametrize("jobs", ["0", "-1", str(MAX_JOBS + 1), "1000000000"])
def test_jobs_are_capped(scenario, capsys, jobs):
    grid = "--grid=engine.forward_backward_max_request_count=1,2"
    refused(["sweep", str(scenario), grid, "--jobs", jobs], capsys, f"--jobs {jobs}", f"1 to {MAX_JOBS}")
    refused(["advise", str(scenario), "--jobs", jobs], capsys, f"--jobs {jobs}")


def test_a_grid_of_a_billion_points_is_refused_before_it_is_built(scenario, capsys):
    axes = [
        "--grid=engine.forward_backward_max_request_count=" + ",".join(map(str, range(1, 1001))),
        "--grid=engine.iteration_sleep_s=" + ",".join(str(0.001 * i) for i in range(1, 1001)),
        "--grid=workload.clients.0.start_s=" + ",".join(map(str, range(1000))),
    ]
    refused(["sweep", str(scenario), *axes, "--force"], capsys, "1,000,000,000 points", "even with --force")
    refused(["sweep", str(scenario), *axes], capsys, "1,000,000,000 points")
    bisect = ["--find-max", "engine.forward_backward_max_request_count", "--between", "1:4"]
    refused(["sweep", str(scenario), *axes[1:], "--grid=hardware.devices=" + ",".join(map(str, range(1, 1001))), *bisect],
            capsys, "points")  # fmt: skip


@pytest.mark.parametrize("between", [f"1:{BIG}", "١:٢", "1:", "a:b", "1.5:3"])
def test_between_takes_two_bounded_integers(scenario, capsys, between):
    refused(["sweep", str(scenario), "--find-max", "engine.forward_backward_max_request_count", "--between", between],
            capsys, f"--between '{between}'")  # fmt: skip


@pytest.mark.parametrize("slow", ["nan", "inf", "-1", "0", "1e308"])
def test_replay_slow_is_a_finite_positive_fraction(tmp_path, capsys, slow):
    refused(["replay", str(tmp_path / "absent.db"), "--endpoint", "tiny-cpu-tp1", "--slow", slow], capsys, "--slow")


@pytest.mark.parametrize(
    ("address", "endpoint"),
    [("10.0.0.1:6379", ("10.0.0.1", 6379)), ("head", ("head", 6379)), ("ray://head", ("head", 10001)),
     ("ray://[::1]:10002", ("::1", 10002)), ("auto", None)],
)  # fmt: skip
def test_ray_addresses_are_parsed(address, endpoint):
    assert ray_endpoint(address) == endpoint


@pytest.mark.parametrize("address", ["not an address", "ray://", "http://head:1", "head:99999", "head:x", "head/x"])
def test_malformed_ray_addresses_are_one_line(scenario, capsys, address):
    with pytest.raises(UserError, match="expected HOST:PORT"):
        ray_endpoint(address)
    grid = "--grid=engine.forward_backward_max_request_count=1,2"
    refused(["sweep", str(scenario), grid, "--executor", "ray", "--address", address], capsys, "--address")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_closed_or_silent_ray_address_fails_at_once():
    port = closed_port()
    with pytest.raises(UserError, match=f"cannot reach the Ray cluster at 127.0.0.1:{port}"):
        check_reachable(f"127.0.0.1:{port}")
    with pytest.raises(UserError, match="cannot reach the Ray cluster"):
        check_reachable(f"ray://127.0.0.1:{port}")
    with socket.socket() as server:  # accepts the connection, then says something that is not HTTP/2
        server.bind(("127.0.0.1", 0))
        server.listen(1)

        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        with pytest.raises(UserError, match="answers, but not as a Ray cluster"):
            check_reachable(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=10)
        thread.join(10)
    with socket.socket() as server:  # accepts and never answers: bounded by the timeout
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with pytest.raises(UserError, match="no answer from the Ray cluster"):
            check_reachable(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=0.5)


def test_a_sweep_at_a_closed_ray_address_is_one_line(scenario, capsys):
    pytest.importorskip("ray")
    port = closed_port()
    grid = "--grid=engine.forward_backward_max_request_count=1,2"
    out = refused(["sweep", str(scenario), grid, "--executor", "ray", "--address", f"127.0.0.1:{port}"], capsys)
    assert f"127.0.0.1:{port}" in out and len(out.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------ property tests

def exit_code(args: list[str]) -> int:
    """``main``'s exit code; argparse's own refusals (a value it cannot read as the flag's type) exit 2 as well."""
    try:
        return main(args)
    except SystemExit as exc:
        return int(exc.code or 0)


HOSTILE_TEXT = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "1e308", "-0", "0x10", "1_000", "١٢", "²", "", " ", "%", "GiB", "-", BIG,
                     "1e-400", ".nan", "[1, 2]", "{a: 1}", "null", "true", "'x'", "[" * 70]),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=12),
)  # fmt: skip
SET_KEYS = st.sampled_from([
    "engine.forward_backward_max_request_count", "engine.iteration_sleep_s", "engine.cap_aware_padding",
    "trainer.micro_train_batch_size_per_gpu", "hardware.device_memory_gib", "hardware.devices", "parallelism.tp",
    "workload.clients.0.start_s", "workload.clients.0.requests.0.lengths", "workload.clients.².start_s",
    "workload.result_timeout_s", "name", "model.num_layers", "lora.rank", "engine", "workload.clients",
])  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=SET_KEYS, value=HOSTILE_TEXT)
def test_any_set_value_is_run_or_refused_in_one_line(scenario, capsys, key, value):
    code = exit_code(["check", str(scenario), "--quiet", "--set", f"{key}={value}"])
    captured = capsys.readouterr()
    assert code in (0, 1, 2), captured.err
    assert "Traceback" not in captured.err


FLAGS = st.one_of(
    st.tuples(st.just("check"), st.just("--margin"), HOSTILE_TEXT),
    st.tuples(st.just("sweep"), st.just("--jobs"), HOSTILE_TEXT),
    st.tuples(st.just("sweep"), st.just("--between"), st.tuples(HOSTILE_TEXT, HOSTILE_TEXT).map(":".join)),
    st.tuples(st.just("sweep"), st.just("--grid"), HOSTILE_TEXT.map(lambda v: f"engine.iteration_sleep_s={v}")),
    st.tuples(st.just("sweep"), st.just("--address"), HOSTILE_TEXT),
    st.tuples(st.just("advise"), st.just("--margin"), HOSTILE_TEXT),
    st.tuples(st.just("run"), st.just("--option"), HOSTILE_TEXT.map(lambda v: f"spool={v}")),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=FLAGS)
def test_any_flag_value_is_run_or_refused_in_one_line(scenario, capsys, monkeypatch, flag):
    import skyrl_sim.commands.advise as advise
    import skyrl_sim.commands.sweep as sweep

    # the flags are the surface: points and searches that would run are replaced by a refusal after parsing
    def no_work(*args: object, **kwargs: object) -> None:
        raise UserError("would run")

    monkeypatch.setattr(sweep, "run_sweep", no_work)
    monkeypatch.setattr(sweep, "find_max_by_bisection", no_work)
    monkeypatch.setattr(advise, "advise", no_work)
    command, name, value = flag
    extra = ["--grid=engine.forward_backward_max_request_count=1,2", "--executor", "ray"] if name == "--address" else []
    if command == "sweep" and name == "--between":
        extra = ["--find-max", "engine.forward_backward_max_request_count"]
    elif command == "sweep" and name != "--grid" and not extra:
        extra = ["--grid=engine.forward_backward_max_request_count=1,2"]
    code = exit_code([command, str(scenario), *extra, f"{name}={value}"])
    captured = capsys.readouterr()
    assert code in (0, 1, 2), captured.err
    assert "Traceback" not in captured.err
