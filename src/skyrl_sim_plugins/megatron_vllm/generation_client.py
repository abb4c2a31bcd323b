"""The generation client: one HTTP generate request per prompt to an OpenAI-compatible completions server.

In the spirit of SkyRL's remote generation client (``RemoteInferenceGenerator``, see ``shared/notes/skyrl-engine.md``):
one request per prompt, orjson bodies, retries with backoff under a total deadline on transient failures, and an
immediate, clear error on everything a retry cannot fix.

Endpoint: vLLM's ``POST /v1/completions`` with ``prompt`` as a list of token ids and ``return_token_ids: true``. It is
the stable, documented route every vLLM (CPU and CUDA builds) serves, it takes token ids in and gives token ids out
without a tokenizer (the server runs with ``--skip-tokenizer-init``), it carries ``n``, ``seed``, ``temperature`` and
``ignore_eos`` per request, and it returns routed experts per choice when the server has them enabled. vLLM's newer
``/inference/v1/generate`` is opt-in (``--enable-scale-out``) and streams SSE chunks; nothing here needs that.

What is retried (each attempt bounded by ``RetryPolicy.attempt_timeout_s`` and by what is left of the deadline):
- a dropped connection (reset, closed before a status line, truncated body), any ``OSError`` (refused, timed out);
- any 5xx status, JSON or not (a restarting server or a proxy in front of it answers 502/503/504);
- a 2xx/3xx body that is not JSON (a proxy's HTML page, a truncated body).

What raises at once (``GenerationRejected``): any 4xx (the request itself is wrong; the server's message is quoted) and
a non-5xx JSON body that carries an ``error`` object. A 2xx JSON body without the expected choices raises
``GenerationProtocolError``. SkyRL raises at once on a JSON error body whatever its status; here a 5xx JSON body is
retried, because vLLM answers 500/503 with a JSON body while its engine restarts, and the deadline bounds the cost.
"""

from __future__ import annotations

import base64
import http.client
import io
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import orjson

READ_CHUNK_BYTES = 1 << 16
SESSION_HEADER = "X-Session-ID"  # the sticky-session header a router in front of several servers may use


class GenerationError(Exception):
    """Base of every error the generation client raises; the message says what failed and where."""


class GenerationRejected(GenerationError):
    """The server refused the request (4xx, or a JSON error body): retrying cannot help."""

    def __init__(self, url: str, status: int, message: str) -> None:
        self.url = url
        self.status = status
        self.message = message
        super().__init__(f"generate request rejected by {url} (HTTP {status}): {message}")


class GenerationProtocolError(GenerationError):
    """The server answered 2xx with JSON that is not a completions response (no choices, no token ids)."""


class GenerationUnavailable(GenerationError):
    """Every attempt failed with a transient error; ``attempts`` were made, ``last_error`` says what the last one saw."""

    def __init__(self, url: str, attempts: int, elapsed_s: float, last_error: str, reason: str) -> None:
        self.url = url
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        self.last_error = last_error
        super().__init__(
            f"generate request to {url} failed: {reason} after {attempts} attempt(s), {elapsed_s:.1f} s; "
            f"last error: {last_error}"
        )


class GenerationDeadlineExceeded(GenerationUnavailable):
    """The total deadline passed before any attempt succeeded."""


class GenerationRetriesExhausted(GenerationUnavailable):
    """``RetryPolicy.max_attempts`` attempts failed before the deadline."""


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep trying one generate request.

    SkyRL retries up to 30 times with a 1 s sleep; the same count is the default here, with an exponential backoff
    from ``initial_backoff_s`` capped at ``max_backoff_s`` (so a server that is only briefly away is not waited on for a
    whole second) and a total ``deadline_s`` that no attempt, sleep or read may pass.
    """

    max_attempts: int = 30
    initial_backoff_s: float = 0.1
    backoff_factor: float = 2.0
    max_backoff_s: float = 1.0
    deadline_s: float = 600.0
    attempt_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("initial_backoff_s", "max_backoff_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be >= 1, got {self.backoff_factor}")
        for name in ("deadline_s", "attempt_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def backoff_s(self, failed_attempts: int) -> float:
        """The sleep after the ``failed_attempts``-th failure (1-based)."""
        return min(self.max_backoff_s, self.initial_backoff_s * self.backoff_factor ** max(failed_attempts - 1, 0))


@dataclass(frozen=True)
class Sample:
    """One generated sequence: its token ids, why it stopped, and its routed experts when the server sent them."""

    token_ids: list[int]
    finish_reason: str | None = None
    routed_experts: np.ndarray | None = None


@dataclass(frozen=True)
class Generation:
    """The answer to one prompt: ``n`` samples in the server's choice order, and how many attempts it took."""

    prompt_token_ids: list[int]
    samples: list[Sample]
    attempts: int = 1
    elapsed_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


class _Transient(Exception):
    """An attempt failed in a way worth retrying; the text says how."""


def decode_routed_experts(value: Any) -> np.ndarray:
    """Routed experts of one choice as ``[tokens, layers, topk]`` ids.

    Two encodings exist: SkyRL's compact ``{data, shape, dtype}`` object (decoded by ``skyrl_sim.engine.r3_codec``, which
    checks every field), and vLLM's own field, a base64 string of ``.npy`` bytes (read with pickles refused).
    """
    if isinstance(value, Mapping):
        from skyrl_sim.api import r3_codec

        return r3_codec.decode_routes(value)
    if isinstance(value, str):
        try:
            array = np.load(io.BytesIO(base64.b64decode(value, validate=True)), allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise ValueError(f"routed experts string is not base64 .npy bytes: {exc}") from None
        if array.dtype.kind not in "iu" or array.ndim != 3:
            raise ValueError(f"routed experts must be a 3-D integer array, got {array.ndim}-D {array.dtype}")
        return array
    raise ValueError(f"routed experts must be an object or a base64 string, got {type(value).__name__}")


class GenerationClient:
    """Sends generate requests for token-id prompts to ``base_url`` (``http://host:port``) and returns token ids.

    Thread-safe: every attempt opens its own connection, so ``generate_batch`` runs prompts concurrently.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        policy: RetryPolicy | None = None,
        *,
        session_id: str | None = None,
        decode_experts: bool = False,
        max_concurrency: int = 16,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise ValueError(f"base_url must be http://host:port, got {base_url!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.host = parts.hostname
        self.port = parts.port
        self.prefix = parts.path.rstrip("/")
        self.base_url = f"http://{self.host}:{self.port}{self.prefix}"
        self.model = model
        self.policy = policy or RetryPolicy()
        self.session_id = session_id
        self.decode_experts = decode_experts
        self.max_concurrency = max_concurrency
        self._sleep = sleep
        self._lock = threading.Lock()
        self.requests_sent = 0  # attempts made, all prompts together (for tests and logs)

    # ------------------------------------------------------------------ public

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        n: int = 1,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = True,
        return_routed_experts: bool = False,
    ) -> Generation:
        """One prompt, ``n`` samples of exactly ``max_tokens`` tokens (``ignore_eos``), retried per the policy."""
        body = self.request_body(
            prompt_token_ids, max_tokens, n=n, temperature=temperature, seed=seed, ignore_eos=ignore_eos
        )
        start = time.monotonic()
        payload, attempts = self._post_with_retries("/v1/completions", body, start)
        samples = self._parse(payload, n, decode=return_routed_experts or self.decode_experts)
        return Generation(
            prompt_token_ids=list(body["prompt"]),
            samples=samples,
            attempts=attempts,
            elapsed_s=time.monotonic() - start,
        )

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        *,
        n: int = 1,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = True,
    ) -> list[Generation]:
        """One request per prompt, up to ``max_concurrency`` in flight; results in prompt order.

        With a ``seed``, prompt ``i`` is sent with ``seed + i`` so two equal prompts in one batch draw different samples
        while the batch as a whole is reproducible. The first error cancels the prompts not yet sent and is raised.
        """
        if not prompts:
            return []
        workers = min(self.max_concurrency, len(prompts))

        def one(index: int) -> Generation:
            return self.generate(
                prompts[index],
                max_tokens,
                n=n,
                temperature=temperature,
                seed=None if seed is None else seed + index,
                ignore_eos=ignore_eos,
            )

        if workers == 1:
            return [one(i) for i in range(len(prompts))]
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="generate") as pool:
            futures = [pool.submit(one, i) for i in range(len(prompts))]
            try:
                # Each generate() is bounded by the policy's deadline, so these waits end.
                return [f.result() for f in futures]
            finally:
                for f in futures:
                    f.cancel()

    def request_body(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        n: int = 1,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = True,
    ) -> dict[str, Any]:
        """The JSON body of one generate request (checked here: a bad value is our bug, not the server's)."""
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("a prompt needs at least one token id")
        if any(t < 0 for t in prompt):
            raise ValueError(f"token ids must be non-negative, got {min(prompt)}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": int(max_tokens),
            "n": int(n),
            "temperature": float(temperature),
            "ignore_eos": bool(ignore_eos),
            "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = int(seed)
        if temperature == 0 and n > 1:
            # vLLM refuses n > 1 with greedy sampling; top-k 1 at temperature 1 picks the same argmax token while still
            # decoding n sequences (the work a greedy n-sample request stands for).
            body["temperature"] = 1.0
            body["top_k"] = 1
        return body

    def get(self, path: str, timeout_s: float) -> tuple[int, bytes]:
        """One plain GET (no retries): status and body; OSError / HTTPException when the server is not there."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        try:
            conn.request("GET", self.prefix + path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    # ------------------------------------------------------------------ transport

    def _post_with_retries(self, path: str, body: dict[str, Any], start: float) -> tuple[Any, int]:
        data = orjson.dumps(body)
        url = self.base_url + path
        policy = self.policy
        deadline = start + policy.deadline_s
        attempts = 0
        last_error = "no attempt made"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GenerationDeadlineExceeded(
                    url, attempts, time.monotonic() - start, last_error, f"deadline of {policy.deadline_s:g} s passed"
                )
            attempts += 1
            with self._lock:
                self.requests_sent += 1
            try:
                return self._attempt(path, url, data, min(remaining, policy.attempt_timeout_s), deadline), attempts
            except _Transient as exc:
                last_error = str(exc)
            if attempts >= policy.max_attempts:
                raise GenerationRetriesExhausted(
                    url, attempts, time.monotonic() - start, last_error, f"all {policy.max_attempts} attempts failed"
                )
            pause = min(policy.backoff_s(attempts), max(deadline - time.monotonic(), 0.0))
            if pause > 0:
                self._sleep(pause)

    def _attempt(self, path: str, url: str, data: bytes, timeout_s: float, deadline: float) -> Any:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.session_id:
            headers[SESSION_HEADER] = self.session_id
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        try:
            try:
                conn.connect()
                sock = conn.sock  # kept: http.client drops conn.sock when the server says "Connection: close"
                conn.request("POST", self.prefix + path, body=data, headers=headers)
                response = conn.getresponse()
                status = response.status
                raw = self._read_body(sock, response, timeout_s, deadline)
            except TimeoutError as exc:
                raise _Transient(f"timed out ({exc or 'no answer'})") from None
            except (http.client.HTTPException, OSError) as exc:
                # RemoteDisconnected, IncompleteRead, BadStatusLine, ConnectionRefused/Reset, ...
                raise _Transient(f"{type(exc).__name__}: {exc}") from None
        finally:
            conn.close()
        return self._classify(url, status, raw)

    @staticmethod
    def _read_body(sock: Any, response: http.client.HTTPResponse, timeout_s: float, deadline: float) -> bytes:
        """The whole body, never waiting past the deadline: a server that trickles bytes is cut off.

        ``read1`` returns after one socket read, so the deadline is checked between any two reads, and each read waits at
        most what is left of it.
        """
        chunks: list[bytes] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("deadline passed while reading the body")
            if sock is not None:
                sock.settimeout(min(remaining, timeout_s))
            chunk = response.read1(READ_CHUNK_BYTES)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)

    @staticmethod
    def _classify(url: str, status: int, raw: bytes) -> Any:
        try:
            payload: Any = orjson.loads(raw)
            is_json = True
        except orjson.JSONDecodeError:
            payload, is_json = None, False
        if status >= 500:
            raise _Transient(f"HTTP {status}: {_error_text(payload) if is_json else _snippet(raw)}")
        if 400 <= status < 500:
            raise GenerationRejected(url, status, _error_text(payload) if is_json else _snippet(raw))
        if not is_json:
            raise _Transient(f"HTTP {status} with a non-JSON body: {_snippet(raw)}")
        if isinstance(payload, dict) and payload.get("error") is not None:
            raise GenerationRejected(url, status, _error_text(payload))
        return payload

    @staticmethod
    def _parse(payload: Any, n: int, decode: bool) -> list[Sample]:
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list) or len(choices) != n:
            got = "no choices" if not isinstance(choices, list) else f"{len(choices)} choices"
            raise GenerationProtocolError(f"completions response has {got}, expected {n}: {_snippet(orjson.dumps(payload))}")
        ordered = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
        samples: list[Sample] = []
        for choice in ordered:
            ids = choice.get("token_ids") if isinstance(choice, dict) else None
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise GenerationProtocolError(
                    "completions choice has no integer 'token_ids' (is the server a vLLM that honours return_token_ids?)"
                )
            experts = None
            if decode and choice.get("routed_experts") is not None:
                try:
                    experts = decode_routed_experts(choice["routed_experts"])
                except ValueError as exc:
                    raise GenerationProtocolError(f"choice {choice.get('index', 0)}: {exc}") from None
            samples.append(Sample(token_ids=ids, finish_reason=choice.get("finish_reason"), routed_experts=experts))
        return samples


def _error_text(payload: Any) -> str:
    """The human message of an OpenAI-style JSON error body (``{"error": {"message": ...}}`` or ``{"detail": ...}``)."""
    if isinstance(payload, dict):
        error = payload.get("error", payload.get("detail", payload.get("message")))
        if isinstance(error, dict):
            message = error.get("message") or error.get("msg")
            kind = error.get("type")
            if message:
                return f"{kind}: {message}" if kind else str(message)
        if isinstance(error, str):
            return error
    return _snippet(orjson.dumps(payload))


def _snippet(raw: bytes, limit: int = 300) -> str:
    text = raw.decode("utf-8", errors="replace").strip()
    if not text:
        return "(empty body)"
    return text if len(text) <= limit else text[:limit] + "..."
