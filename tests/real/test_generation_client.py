"""The generation client against a real HTTP server on 127.0.0.1 that misbehaves on a script.

Each test gives the server a list of behaviours, one per incoming request (drop the connection, answer 5xx, 4xx, a JSON
error body, HTML, stall, or answer properly), and checks what the client returns or raises and how many requests the
server saw. No vLLM needed: these run in every test run.
"""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import orjson
import pytest

from skyrl_sim_plugins.megatron_vllm.generation_client import (
    GenerationClient,
    GenerationDeadlineExceeded,
    GenerationProtocolError,
    GenerationRejected,
    GenerationRetriesExhausted,
    RetryPolicy,
    decode_routed_experts,
)

FAST = RetryPolicy(max_attempts=6, initial_backoff_s=0.01, max_backoff_s=0.05, deadline_s=10.0, attempt_timeout_s=5.0)


def completion(body: dict, experts: object | None = None) -> dict:
    """What vLLM answers: n choices whose token ids are derived from the prompt, seed and choice index."""
    prompt = body["prompt"]
    seed = body.get("seed", 0)
    choices = []
    for index in range(body.get("n", 1)):
        ids = [(sum(prompt) + seed + 7 * index + k) % 97 for k in range(body["max_tokens"])]
        choices.append({"index": index, "text": "", "token_ids": ids, "finish_reason": "length", "routed_experts": experts})
    return {"id": "cmpl-test", "object": "text_completion", "model": body["model"], "choices": list(reversed(choices))}


class ScriptedServer:
    """A threaded HTTP server whose n-th request gets the n-th scripted behaviour (the last one repeats)."""

    def __init__(self) -> None:
        self.script: list[str | tuple] = ["ok"]
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []
        self.release = threading.Event()
        self.experts: object | None = None
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (quiet)
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with server._lock:
                    server.bodies.append(orjson.loads(raw))
                    server.headers.append(dict(self.headers))
                    index = len(server.bodies) - 1
                    action = server.script[min(index, len(server.script) - 1)]
                server.act(self, action, orjson.loads(raw))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def send(self, handler: BaseHTTPRequestHandler, status: int, body: bytes, ctype: str = "application/json") -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", ctype)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def act(self, handler: BaseHTTPRequestHandler, action: str | tuple, body: dict) -> None:
        if action == "ok":
            self.send(handler, 200, orjson.dumps(completion(body, self.experts)))
        elif action == "drop":  # close without a status line: the client sees RemoteDisconnected
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
        elif action == "truncate":  # promise 1000 bytes, send 10, close
            handler.send_response(200)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", "1000")
            handler.end_headers()
            handler.wfile.write(b'{"choices"')
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
        elif action == "stall":  # hold the request until the test ends
            self.release.wait(timeout=30)
            handler.close_connection = True
        elif action == "trickle":  # headers at once, then one byte every 0.2 s: only the deadline can stop it
            handler.send_response(200)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", "100000")
            handler.end_headers()
            while not self.release.wait(timeout=0.2):
                try:
                    handler.wfile.write(b" ")
                    handler.wfile.flush()
                except OSError:
                    return
            handler.close_connection = True
        elif action == "html":
            self.send(handler, 200, b"<html>gateway warming up</html>", "text/html")
        elif action == "not-choices":
            self.send(handler, 200, orjson.dumps({"object": "text_completion", "choices": []}))
        else:
            kind, status, payload = action  # ("status", code, body bytes)
            assert kind == "status"
            self.send(handler, status, payload, "application/json" if payload.startswith(b"{") else "text/plain")

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    s = ScriptedServer()
    yield s
    s.close()


def client_for(server: ScriptedServer, policy: RetryPolicy = FAST, **kwargs) -> GenerationClient:
    return GenerationClient(server.url, "policy", policy, **kwargs)


def test_request_body_is_orjson_with_token_ids_and_sampling_fields(server: ScriptedServer) -> None:
    result = client_for(server, session_id="sess-1").generate([5, 6, 7], 4, n=2, temperature=0.7, seed=11)
    assert len(server.bodies) == 1
    body = server.bodies[0]
    assert body == {
        "model": "policy",
        "prompt": [5, 6, 7],
        "max_tokens": 4,
        "n": 2,
        "temperature": 0.7,
        "ignore_eos": True,
        "return_token_ids": True,
        "seed": 11,
    }
    assert server.headers[0]["Content-Type"] == "application/json"
    assert server.headers[0]["X-Session-ID"] == "sess-1"
    # choices come back reversed; the client orders them by index
    assert [s.token_ids for s in result.samples] == [
        completion(body)["choices"][1]["token_ids"],
        completion(body)["choices"][0]["token_ids"],
    ]
    assert result.attempts == 1 and all(len(s.token_ids) == 4 for s in result.samples)


def test_greedy_with_several_samples_is_sent_as_top_k_1(server: ScriptedServer) -> None:
    client_for(server).generate([1], 2, n=3, temperature=0.0)
    client_for(server).generate([1], 2, n=1, temperature=0.0)
    assert (server.bodies[0]["temperature"], server.bodies[0]["top_k"], server.bodies[0]["n"]) == (1.0, 1, 3)
    assert server.bodies[1]["temperature"] == 0.0 and "top_k" not in server.bodies[1]


@pytest.mark.parametrize(
    "failure",
    [
        "drop",
        "truncate",
        "html",
        ("status", 500, b"Internal Server Error"),
        ("status", 502, b"<html>bad gateway</html>"),
        ("status", 503, b'{"error": {"message": "engine restarting", "type": "ServiceUnavailable"}}'),
    ],
    ids=["dropped-connection", "truncated-body", "non-json-200", "500-text", "502-html", "503-json"],
)
def test_transient_failures_are_retried_until_success(server: ScriptedServer, failure: str | tuple) -> None:
    server.script = [failure, failure, "ok"]
    result = client_for(server).generate([1, 2, 3], 5)
    assert result.attempts == 3
    assert len(server.bodies) == 3
    assert result.samples[0].token_ids == completion(server.bodies[-1])["choices"][0]["token_ids"]


def test_retries_back_off_between_attempts(server: ScriptedServer) -> None:
    slept: list[float] = []
    policy = RetryPolicy(max_attempts=5, initial_backoff_s=0.01, backoff_factor=3.0, max_backoff_s=0.05, deadline_s=10)
    server.script = ["drop"] * 4 + ["ok"]
    client_for(server, policy, sleep=slept.append).generate([1], 1)
    assert slept == pytest.approx([0.01, 0.03, 0.05, 0.05])


@pytest.mark.parametrize(
    ("reply", "status", "text"),
    [
        (("status", 400, b'{"error": {"message": "max_tokens is too large", "type": "BadRequestError"}}'), 400, "too large"),
        (("status", 404, b'{"error": {"message": "The model `policy` does not exist."}}'), 404, "does not exist"),
        (("status", 422, b"Unprocessable: prompt must be a list"), 422, "prompt must be a list"),
        (("status", 200, b'{"error": {"message": "sampling params invalid", "type": "ValueError"}}'), 200, "params invalid"),
    ],
    ids=["400-json", "404-json", "422-text", "200-json-error-body"],
)
def test_rejections_raise_at_once_with_the_servers_message(
    server: ScriptedServer, reply: tuple, status: int, text: str
) -> None:
    server.script = [reply, "ok"]
    client = client_for(server)
    with pytest.raises(GenerationRejected) as info:
        client.generate([1, 2], 3)
    assert info.value.status == status
    assert text in str(info.value) and server.url in str(info.value)
    assert len(server.bodies) == 1  # never retried


def test_a_response_without_choices_is_a_protocol_error(server: ScriptedServer) -> None:
    server.script = ["not-choices"]
    with pytest.raises(GenerationProtocolError, match="0 choices, expected 1"):
        client_for(server).generate([1], 2)
    assert len(server.bodies) == 1


def test_persistent_5xx_exhausts_attempts_with_the_last_error(server: ScriptedServer) -> None:
    server.script = [("status", 503, b'{"error": {"message": "overloaded"}}')]
    with pytest.raises(GenerationRetriesExhausted) as info:
        client_for(server).generate([1], 2)
    assert info.value.attempts == FAST.max_attempts == len(server.bodies)
    assert "overloaded" in info.value.last_error


def test_connection_refused_is_retried_then_reported() -> None:
    with socket.socket() as sock:  # a port with nobody listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = GenerationClient(f"http://127.0.0.1:{port}", "policy", FAST)
    with pytest.raises(GenerationRetriesExhausted, match="ConnectionRefusedError") as info:
        client.generate([1], 2)
    assert info.value.attempts == FAST.max_attempts


def test_a_stalled_server_is_cut_off_by_the_total_deadline(server: ScriptedServer) -> None:
    server.script = ["stall"]
    policy = RetryPolicy(max_attempts=30, initial_backoff_s=0.01, deadline_s=0.6, attempt_timeout_s=0.25)
    start = time.monotonic()
    with pytest.raises(GenerationDeadlineExceeded) as info:
        client_for(server, policy).generate([1], 2)
    # cut off at the 0.6 s deadline, not by running out of attempts (30 attempts of 0.25 s would take 7.5 s); only the
    # lower bound reads the clock, and no load can break it
    assert time.monotonic() - start >= 0.6
    assert 2 <= info.value.attempts < policy.max_attempts  # per-attempt timeouts retried inside the deadline
    assert "timed out" in info.value.last_error


def test_a_trickling_body_cannot_outlive_the_deadline(server: ScriptedServer) -> None:
    server.script = ["trickle"]
    policy = RetryPolicy(max_attempts=30, deadline_s=0.8, attempt_timeout_s=120.0)
    start = time.monotonic()
    with pytest.raises(GenerationDeadlineExceeded):
        client_for(server, policy).generate([1], 2)
    # the 0.8 s deadline, not the 120 s attempt timeout: a bound far from both, so no load can blur the two
    assert time.monotonic() - start < 60.0


def test_batch_sends_one_request_per_prompt_with_derived_seeds(server: ScriptedServer) -> None:
    prompts = [[3, 4], [3, 4], [9], [1, 1, 1]]
    results = client_for(server, max_concurrency=3).generate_batch(prompts, 3, n=2, temperature=1.0, seed=100)
    assert len(server.bodies) == 4
    assert sorted(b["seed"] for b in server.bodies) == [100, 101, 102, 103]
    for index, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        assert result.prompt_token_ids == prompt
        body = {"prompt": prompt, "seed": 100 + index, "n": 2, "max_tokens": 3, "model": "policy"}
        assert [s.token_ids for s in result.samples] == [c["token_ids"] for c in reversed(completion(body)["choices"])]
    assert results[0].samples != results[1].samples  # equal prompts, different seeds


def test_batch_raises_the_first_rejection(server: ScriptedServer) -> None:
    server.script = [("status", 400, b'{"error": {"message": "prompt too long"}}')]
    with pytest.raises(GenerationRejected, match="prompt too long"):
        client_for(server, max_concurrency=2).generate_batch([[1], [2], [3]], 2)


def test_vllm_routed_experts_npy_string_is_decoded_when_asked(server: ScriptedServer) -> None:
    routes = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2)
    buffer = io.BytesIO()
    np.save(buffer, routes, allow_pickle=False)
    server.experts = base64.b64encode(buffer.getvalue()).decode()
    plain = client_for(server).generate([1], 3)
    assert plain.samples[0].routed_experts is None  # decoding is opt-in
    decoded = client_for(server, decode_experts=True).generate([1], 3)
    np.testing.assert_array_equal(decoded.samples[0].routed_experts, routes)


def test_skyrl_compact_routed_experts_are_decoded_with_r3_codec(server: ScriptedServer) -> None:
    r3_codec = pytest.importorskip("skyrl_sim.engine.r3_codec")
    routes = np.array([[[1, 7]], [[3, 2]]], dtype=np.int64)
    server.experts = r3_codec.encode_routes(routes)
    result = client_for(server).generate([1], 3, return_routed_experts=True)
    np.testing.assert_array_equal(result.samples[0].routed_experts, routes)


def test_malformed_routed_experts_are_a_protocol_error(server: ScriptedServer) -> None:
    server.experts = "not base64 npy!"
    with pytest.raises(GenerationProtocolError, match="routed experts"):
        client_for(server, decode_experts=True).generate([1], 3)


def test_pickled_npy_is_refused() -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="routed experts"):
        decode_routed_experts(base64.b64encode(buffer.getvalue()).decode())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_token_ids": [], "max_tokens": 1}, "at least one token"),
        ({"prompt_token_ids": [1, -2], "max_tokens": 1}, "non-negative"),
        ({"prompt_token_ids": [1], "max_tokens": 0}, "max_tokens"),
        ({"prompt_token_ids": [1], "max_tokens": 1, "n": 0}, "n must"),
        ({"prompt_token_ids": [1], "max_tokens": 1, "temperature": -0.5}, "temperature"),
    ],
)
def test_bad_arguments_fail_before_any_request(server: ScriptedServer, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        client_for(server).generate(**kwargs)
    assert server.bodies == []


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="http://host:port"):
        GenerationClient("127.0.0.1:8000", "policy")
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="deadline_s"):
        RetryPolicy(deadline_s=0)


def test_backoff_never_exceeds_its_cap() -> None:
    policy = RetryPolicy(initial_backoff_s=0.1, backoff_factor=2.0, max_backoff_s=1.0)
    delays = [policy.backoff_s(k) for k in range(1, 40)]
    assert delays[:4] == pytest.approx([0.1, 0.2, 0.4, 0.8])
    assert max(delays) == 1.0 and delays == sorted(delays)
