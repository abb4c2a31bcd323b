"""The tinker backend against a service that is down (one error, exit 2), stalls, or fails (clear per-request
errors, a finished result).

No SkyRL here: a closed port, and a small local HTTP server that answers the SDK's set-up calls like a Tinker service
and then misbehaves in one chosen way. Every case must return within its timeouts (the test's own timeout guards a hang).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from skyrl_sim.errors import UserError
from skyrl_sim.plugin_host.hookspecs import RunContext
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.tinker_client.backend import TinkerBackend

ENDPOINT = Path(__file__).resolve().parents[2] / "scenarios" / "endpoints" / "skyrl-jax-cpu.yaml"
FAST = {"http_timeout_s": "0.5", "setup_timeout_s": "3", "timeout_s": "1.5", "retries": "1"}
# A run with FAST's deadlines ends well within this (a hang would not end at all); the slack is for a loaded machine.
BOUND_S = 20


def variant(tmp_path: Path, **endpoint: str):
    body = {
        "name": "errors",
        "endpoint": str(ENDPOINT),
        "workload": {
            "clients": [
                {
                    "name": "c",
                    "model_id": "m",
                    "submit": {"mode": "back_to_back", "gap_s": 0},
                    "requests": [{"type": "forward_backward", "lengths": [5, 7]}, {"type": "optim_step"}],
                }
            ]
        },
    }
    path = tmp_path / "errors.yaml"
    path.write_text(yaml.safe_dump(body))
    return load_scenario(path).resolve("default", {f"endpoint.{k}": v for k, v in endpoint.items()})


def run(tmp_path: Path, options: dict[str, str]) -> tuple[RunResult, float]:
    start = time.monotonic()
    result = TinkerBackend().run(variant(tmp_path), RunContext(host=PluginHost(), options={**FAST, **options}))
    return result, time.monotonic() - start


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class FakeService(BaseHTTPRequestHandler):
    """Answers set-up like a Tinker service; ``mode`` says what it does with the scenario's requests."""

    mode = "ok"
    counter = [100]

    def log_message(self, *args: object) -> None:
        pass

    def reply(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def raw_reply(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def not_the_service(self) -> bool:
        """Modes in which this server is not a Tinker service: another server, or the API under another path."""
        if self.mode == "prefix" and not re.fullmatch(r"/api/v1/[a-z_]+", self.path.split("?")[0]):
            self.reply(404, {"detail": "Not Found"})
            return True
        if self.mode in ("404", "405", "401"):
            self.reply(int(self.mode), {"detail": "nope"})
            return True
        if self.mode == "html":
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", "21")
            self.end_headers()
            self.wfile.write(b"<html>welcome!</html>")
            return True
        return False

    def do_GET(self) -> None:
        if self.not_the_service():
            return None
        if self.mode == "500":
            return self.reply(500, {"detail": "internal error"})
        if self.mode == "stall":
            time.sleep(3)
        self.reply(200, {"supported_models": [{"model_name": "tiny"}]})

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length)
        if self.not_the_service():
            return None
        path = self.path
        if path.endswith("/create_session"):
            return self.reply(200, {"session_id": "s1", "type": "create_session"})
        if path.endswith("/create_model") or path.endswith("/unload_model"):
            return self.reply(200, {"request_id": "1", "future_id": "1", "status": "pending", "model_id": "m1"})
        if path.endswith("/retrieve_future"):
            request_id = json.loads(raw)["request_id"]
            if request_id == "1":
                if self.mode == "no_model_id":
                    return self.reply(200, {"type": "create_model"})
                return self.reply(200, {"model_id": "m1", "type": "create_model"})
            if self.mode == "result_not_json":
                return self.raw_reply(200, b"<html>oops</html>")
            if self.mode == "slow":
                time.sleep(0.2)
                return self.reply(200, {"type": "try_again", "request_id": request_id, "queue_state": "active"})
            # SkyRL's answer for a failed future: HTTP 400 with the engine's error text
            return self.reply(400, {"detail": "RuntimeError: CPU out of memory"})
        if self.mode == "submit500":
            return self.reply(500, {"detail": "database is locked"})
        if self.mode == "submit_not_json":
            return self.raw_reply(200, b"<html>not json</html>")
        if self.mode == "submit_empty":
            return self.reply(200, {})
        if self.mode == "submit_no_request_id":
            return self.reply(200, {"status": "pending"})
        if self.mode == "submit_stall":
            time.sleep(8)
        self.counter[0] += 1
        return self.reply(200, {"request_id": str(self.counter[0]), "future_id": str(self.counter[0]), "status": "pending"})


@pytest.fixture
def fake() -> Iterator[tuple[str, type[FakeService]]]:
    handler = type("Handler", (FakeService,), {"mode": "ok"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_nothing_listening_is_one_error_naming_the_url(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    start = time.monotonic()
    with pytest.raises(UserError, match=rf"--backend tinker: nothing answered at {url} \(ConnectError: .*, 2 tries\)"):
        run(tmp_path, {"base_url": url})
    assert time.monotonic() - start < BOUND_S


def test_run_against_a_closed_port_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from skyrl_sim.cli import EXIT_BAD_INPUT, main

    url = f"http://127.0.0.1:{closed_port()}"
    scenario = Path(__file__).resolve().parents[2] / "scenarios" / "queue_drain_17.yaml"
    code = main(["run", str(scenario), "--backend", "tinker", "--option", f"base_url={url}", "--option", "retries=0"])
    captured = capsys.readouterr()
    assert code == EXIT_BAD_INPUT
    assert f"nothing answered at {url}" in " ".join(captured.err.split())
    assert "completed" not in captured.out + captured.err and "Traceback" not in captured.err


def test_stalled_service_times_out(tmp_path: Path, fake: tuple[str, type[FakeService]]) -> None:
    url, handler = fake
    handler.mode = "stall"
    result, took = run(tmp_path, {"base_url": url})
    assert all(r.status == "failed" and "no answer" in (r.error or "") for r in result.requests)
    assert took < BOUND_S


def test_server_errors_at_setup(tmp_path: Path, fake: tuple[str, type[FakeService]]) -> None:
    url, handler = fake
    handler.mode = "500"
    result, _ = run(tmp_path, {"base_url": url})
    assert all("HTTP 500" in (r.error or "") and "service setup failed" in (r.error or "") for r in result.requests)


def test_server_errors_on_submission_are_per_request(tmp_path: Path, fake: tuple[str, type[FakeService]]) -> None:
    url, handler = fake
    handler.mode = "submit500"
    result, _ = run(tmp_path, {"base_url": url})
    assert all(r.status == "failed" and "database is locked" in (r.error or "") for r in result.requests)
    assert all(r.submitted_s is not None for r in result.requests)


def test_failed_future_is_the_request_error(tmp_path: Path, fake: tuple[str, type[FakeService]]) -> None:
    """An OOM inside the service comes back as a failed future: its text is the request's error."""
    url, _ = fake
    result, _ = run(tmp_path, {"base_url": url})
    assert [r.error for r in result.requests] == ["RuntimeError: CPU out of memory"] * 3
    assert any("service's log is not readable" in note for note in result.notes)


def test_slow_results_hit_the_per_request_timeout(tmp_path: Path, fake: tuple[str, type[FakeService]]) -> None:
    url, handler = fake
    handler.mode = "slow"
    result, took = run(tmp_path, {"base_url": url})
    assert all(r.status == "failed" and "no result within 1.5 s" in (r.error or "") for r in result.requests)
    assert took < BOUND_S


def test_base_url_is_required(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="base_url"):
        TinkerBackend().run(variant(tmp_path), RunContext(host=PluginHost(), options={}))


def test_unknown_option_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such option"):
        TinkerBackend().run(variant(tmp_path), RunContext(host=PluginHost(), options={"base_url": "x", "colour": "red"}))


@pytest.mark.parametrize(
    ("mode", "needle"),
    [
        ("submit_not_json", "malformed reply"),
        ("submit_empty", "malformed reply"),
        ("submit_no_request_id", "malformed reply"),
        ("result_not_json", "malformed reply"),
    ],
)
def test_malformed_replies_are_per_request_errors(tmp_path: Path, fake, mode: str, needle: str) -> None:
    url, handler = fake
    handler.mode = mode
    result, took = run(tmp_path, {"base_url": url})
    assert len(result.requests) == 3
    assert all(r.status == "failed" and needle in (r.error or "") for r in result.requests), result.requests
    assert took < BOUND_S


def test_create_model_without_model_id_fails_the_run_cleanly(tmp_path: Path, fake) -> None:
    url, handler = fake
    handler.mode = "no_model_id"
    result, _ = run(tmp_path, {"base_url": url})
    assert all("service setup failed" in (r.error or "") and "model_id" in (r.error or "") for r in result.requests)


def test_a_server_that_stalls_on_submission_meets_timeout_s(tmp_path: Path, fake) -> None:
    url, handler = fake
    handler.mode = "submit_stall"
    result, took = run(tmp_path, {"base_url": url, "http_timeout_s": "30", "timeout_s": "1"})
    assert all(r.status == "failed" for r in result.requests)
    assert any("within 1 s" in (r.error or "") for r in result.requests)
    assert took < 3 * 1 + 8  # each request's submission is held to its 1 s deadline


@pytest.mark.parametrize(
    "option",
    ["retries=inf", "retries=nan", "retries=1.5", "token_id_max=inf", "token_id_max=nan", "timeout_s=nan",
     "timeout_s=inf", "http_timeout_s=-1"],
)
def test_option_values_are_validated(tmp_path: Path, option: str) -> None:
    key, value = option.split("=")
    with pytest.raises(UserError, match=f"--option {key}="):
        TinkerBackend().run(variant(tmp_path), RunContext(host=PluginHost(), options={"base_url": "x", key: value}))


@pytest.mark.parametrize(
    ("mode", "suffix", "needle"),
    [
        ("404", "", "HTTP 404, no such path"),
        ("405", "", "HTTP 405, the method is not allowed"),
        ("401", "", "HTTP 401, unauthorised"),
        ("html", "", "a reply that is not the Tinker API's"),
        ("prefix", "/wrong/path", "HTTP 404"),
        ("prefix", "/api/v1", "HTTP 404"),
    ],
)
def test_a_server_that_is_not_a_tinker_service_is_refused_at_the_start(tmp_path: Path, fake, mode, suffix, needle):
    """The wrong path or another server answers, but not as the API: one error before any request, as for a URL
    where nothing listens (every request failing and exit 0 said nothing useful)."""
    url, handler = fake
    handler.mode = mode
    start = time.monotonic()
    with pytest.raises(UserError, match="does not answer as a Tinker API service") as refused:
        run(tmp_path, {"base_url": url + suffix})
    assert needle in str(refused.value)
    assert time.monotonic() - start < BOUND_S


def test_a_wrong_url_is_exit_2_from_the_command_line(tmp_path: Path, fake, capsys: pytest.CaptureFixture[str]) -> None:
    from skyrl_sim.cli import main

    url, handler = fake
    handler.mode = "prefix"
    variant(tmp_path)  # writes errors.yaml
    options = [item for key, value in FAST.items() for item in ("--option", f"{key}={value}")]
    code = main(["run", str(tmp_path / "errors.yaml"), "--backend", "tinker", "--option", f"base_url={url}/v1", *options])
    err = capsys.readouterr().err
    assert code == 2 and "does not answer as a Tinker API service" in err and "Traceback" not in err, err
