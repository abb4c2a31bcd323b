"""``--backend tinker``: run a scenario against a live Tinker-API service (SkyRL) with the official ``tinker`` SDK.

One LoRA training model per distinct scenario model id is created through the SDK (a session, then ``create_model``).
The clients are the driver's (``client_processes``, the simulator's own interpreter of the client scripts), run on an
``AsyncioClock``: this backend supplies only what a step does against the service. Every ``Submit`` is one SDK call
(``submit_planned``) that returns the service's request id once the row is in the service's futures table; every
submitted request gets a retriever (``collect``) that polls ``retrieve_future`` until a result, a failure, or the
request's timeout, and an ``Await`` waits on that. Token ids are synthetic (deterministic
ids below ``token_id_max``), as the seed's repro made them; every target weighs 1.

Calls are not visible to a client. When the service's log is readable (``Endpoint.service_log`` or
``--option log=PATH``), the lines appended during the run become ``RunResult.calls``; otherwise ``calls`` stays empty
and a note says so. A service that cannot be connected to at all (nothing listens at ``base_url``, no route, a
connect timeout) is a ``UserError`` (exit 2) naming the URL, before any request. A service that answers but is slow or
failing gives each request a clear error and the run still returns a finished RunResult: every HTTP call and every
wait has a timeout.

Options (``--option KEY=VALUE``): ``base_url``, ``log``, ``api_key`` (default ``$TINKER_API_KEY`` or a ``tml-`` key),
``base_model`` (default: the service's first supported model), ``timeout_s`` (per request, default the workload's
``result_timeout_s``), ``setup_timeout_s`` (60), ``http_timeout_s`` (30), ``retries`` (2, for connection errors and
5xx), ``token_id_max`` (256).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx  # the `tinker` extra (the SDK and its HTTP client): without it, making this backend names the extra
import tinker
from tinker import types
from tinker._client import AsyncTinker

from skyrl_sim.api import (
    PASSES,
    AsyncioClock,
    CallRecord,
    LoggedCall,
    PlannedRequest,
    RequestRecord,
    ResolvedVariant,
    RunContext,
    RunResult,
    UserError,
    client_processes,
    log_size,
    logged_call_record,
    read_service_log,
    validate_options,
)
from skyrl_sim_plugins.tinker_client.options import TinkerOptions

SUPPORTED = frozenset(
    {
        "forward_backward",
        "forward",
        "optim_step",
        "save_weights_for_sampler",
        "save_weights",
        "sample",
        "create_model",
        "unload_model",
    }
)
DEFAULT_API_KEY = "tml-skyrl-sim"
RETRIEVE_POLL_S = 30.0  # how long one retrieve_future long-poll may wait server-side before we ask again
CONNECT_TIMEOUT_S = 10.0  # one TCP connect (capped by http_timeout_s): a service that is there accepts at once
RESULT_GRACE_S = 10.0
"""How long after a request's own deadline (``timeout_s`` after its submission, which its retrieve keeps, with at
most a 2 s back-off) a client's ``Await`` gives up on it: a backstop, so that no wait is without a timeout."""


class Gate(Protocol):
    """Holds a service's engine while the clients submit (test harnesses): ``hold`` after setup, ``release`` once
    every client is waiting on a result or done."""

    def hold(self) -> None: ...

    def release(self) -> None: ...


@dataclass(frozen=True)
class TinkerSettings:
    """A run's ``--option`` values (``options``, as declared once in ``TinkerOptions``) and the four that come from
    elsewhere when not given: the service's URL and log from the endpoint, the key from the environment, the result
    timeout from the workload."""

    options: TinkerOptions
    base_url: str
    log: str | None
    api_key: str
    timeout_s: float

    @classmethod
    def from_options(cls, variant: ResolvedVariant, options: Mapping[str, str]) -> TinkerSettings:
        opts = validate_options("tinker", TinkerOptions, options)
        base_url = opts.base_url or variant.endpoint.base_url
        if not base_url:
            raise UserError(
                f"{variant.source}: the tinker backend needs the service's URL: "
                "--option base_url=URL or endpoint key 'base_url'"
            )
        check_base_url(base_url)

        unsupported = sorted({kind for client in variant.workload.clients for kind in client.request_types()} - SUPPORTED)
        if unsupported:
            raise UserError(
                f"{variant.source}: the tinker backend cannot submit request type '{unsupported[0]}' "
                f"(supported: {', '.join(sorted(SUPPORTED))})"
            )
        for client in variant.workload.clients:
            creates = sum(spec.type == "create_model" for spec, _ in client.expanded())
            if creates > 1:
                raise UserError(
                    f"{variant.source}: client '{client.name}' creates model '{client.model_id}' {creates} times; "
                    "SkyRL makes a new model id at every create_model (use one client per created model)"
                )
        return cls(
            options=opts,
            base_url=base_url.rstrip("/"),
            log=opts.log or variant.endpoint.service_log,
            api_key=opts.api_key or os.environ.get("TINKER_API_KEY") or DEFAULT_API_KEY,
            timeout_s=opts.timeout_s if opts.timeout_s is not None else variant.workload.result_timeout_s,
        )


def check_base_url(url: str) -> None:
    """The service's URL as the SDK's HTTP client (httpx) reads it: http or https, with a host and a valid port."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise UserError(f"base_url '{url}': not a URL ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host or not 0 < (parsed.port or 80) < 65536:
        raise UserError(f"base_url '{url}': expected http://HOST:PORT or https://HOST:PORT")


class ServiceCallError(Exception):
    """An HTTP call to the service failed; the message is what a user should read. ``status``: the HTTP status of the
    last answer (None: no answer); ``malformed``: a 2xx answer the SDK could not read."""

    def __init__(self, message: str, status: int | None = None, malformed: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.malformed = malformed


NOT_THE_SERVICE = {404: "no such path", 405: "the method is not allowed", 401: "unauthorised", 403: "forbidden"}
"""Answers to the first API call that say ``base_url`` is not a Tinker API service that will take these requests: the
wrong path or another server (404, 405), or one that refuses the key (401, 403). Refused at the start, as a URL where
nothing listens is, instead of failing every request."""


def malformed(exc: BaseException) -> str:
    """A short reason for a reply that could not be read (the first line of the parser's message)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else 'unreadable'}"[:300]


def reply_field(reply: Any, key: str, what: str) -> str:
    """A required identifier of a reply (``request_id``, ``model_id``, ``session_id``); ServiceCallError when the
    service left it out or sent something that is not one."""
    value = reply.get(key) if isinstance(reply, dict) else getattr(reply, key, None)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise ServiceCallError(f"{what}: malformed reply from the service (no '{key}')", malformed=True)
    return str(value)


def _numeric(service_id: str | None) -> tuple[int, str]:
    """Sort key of a service request id: numerically when it is a number (SkyRL's are), else as text, after numbers."""
    if service_id is not None and service_id.isdigit():
        return 0, service_id.zfill(40)
    return 1, service_id or ""


@dataclass(frozen=True)
class _Future:
    """The part of an SDK future this backend reads."""

    request_id: str


@dataclass
class _Submitted:
    """One request of this run: what was planned, its record, and the service's id once submitted."""

    key: int
    planned: PlannedRequest
    record: RequestRecord
    service_id: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: dict[str, Any] | None = None


def planned_record(key: int, workload_client: Any, planned: PlannedRequest, **outcome: Any) -> RequestRecord:
    """The record of request ``key`` of ``workload_client``'s script as planned (``outcome``: a status and error the
    request already has, as when nothing can be submitted)."""
    return RequestRecord(
        id=key,
        type=planned.spec.type,
        model_id=workload_client.model_id,
        tokens=sum(planned.datums),
        client=workload_client.name,
        datums=list(planned.datums),
        **outcome,
    )


def synthetic_tokens(count: int, salt: int, token_id_max: int) -> list[int]:
    """Deterministic token ids in [1, token_id_max): the content never matters, only the count."""
    return [1 + (salt * 7919 + i * 104729) % (token_id_max - 1) for i in range(count)]


class TinkerBackend:
    """``--backend tinker``. ``gate`` is for test harnesses that pause the service's engine during submission."""

    name = "tinker"

    def __init__(self, gate: Gate | None = None) -> None:
        self.gate = gate

    def run(self, variant: ResolvedVariant, context: RunContext) -> RunResult:
        settings = TinkerSettings.from_options(variant, context.options)
        run = _Run(variant, settings, self.gate, context)
        return asyncio.run(run.main())


class _Run:
    def __init__(self, variant: ResolvedVariant, settings: TinkerSettings, gate: Gate | None, context: RunContext) -> None:
        self.variant = variant
        self.settings = settings
        self.gate = gate
        self.context = context
        self.t0 = time.monotonic()
        self.t0_epoch = time.time()
        self.items: dict[int, _Submitted] = {}
        self.model_ids: dict[str, str] = {}
        self.session_id: str | None = None
        self.options = settings.options
        self.base_model: str | None = settings.options.base_model
        self.result = context.new_result(variant, "tinker")
        self.waiting_clients = 0
        self.gate_released = gate is None
        self.tasks: list[asyncio.Task[None]] = []
        self.clock: Callable[[], float] = self.now  # the run's clock, as a client process reads it (ClientTable)
        self.created = 0
        self.answered = False  # any HTTP reply at all from the service (an error status included)
        self.unreachable: str | None = None  # the last connect failure (refused, no route, connect timeout)
        self.recognised = False  # some API call got a reply the SDK could read: a Tinker service is there

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------ HTTP through the SDK

    async def call(self, what: str, send: Callable[[], Any]) -> Any:
        """One SDK call with a timeout; connection errors and 5xx are retried ``retries`` times, 4xx fail at once."""
        last = ""
        status: int | None = None
        for attempt in range(self.options.retries + 1):
            try:
                reply = await asyncio.wait_for(send(), self.options.http_timeout_s + 5)
                self.answered = True
                self.recognised = True
                return reply
            except tinker.APIStatusError as exc:
                self.answered = True
                status = exc.status_code
                body = getattr(exc, "body", None)
                detail = body.get("detail") if isinstance(body, dict) else None
                last = f"{what}: HTTP {exc.status_code} from {self.settings.base_url}: {detail or exc.message}"
                if exc.status_code < 500:
                    break
            except tinker.APITimeoutError as exc:
                last = f"{what}: no answer from {self.settings.base_url} within {self.options.http_timeout_s:g} s"
                self.note_connect_failure(exc)
            except tinker.APIConnectionError as exc:
                cause = exc.__cause__ or exc
                last = f"{what}: cannot reach the service at {self.settings.base_url} ({type(cause).__name__}: {cause})"
                self.note_connect_failure(exc)
            except TimeoutError:
                last = f"{what}: no answer from {self.settings.base_url} within {self.options.http_timeout_s:g} s"
            except Exception as exc:  # a 200 reply the SDK cannot read (not JSON, wrong shape): not worth a retry
                self.answered = True
                reason = f"{what}: malformed reply from {self.settings.base_url} ({malformed(exc)})"
                raise ServiceCallError(reason, 200, malformed=True) from None
            if attempt < self.options.retries:
                await asyncio.sleep(min(2.0, 0.25 * 2**attempt))
        raise ServiceCallError(last, status)

    @staticmethod
    def http_timeout(seconds: float) -> Any:
        """An httpx timeout of ``seconds`` for one HTTP call, whose connect part is at most ``CONNECT_TIMEOUT_S``."""
        return httpx.Timeout(seconds, connect=min(CONNECT_TIMEOUT_S, seconds))

    def note_connect_failure(self, exc: BaseException) -> None:
        """Remember a failure to open a connection at all (refused, no route, DNS, connect timeout), as opposed to a
        service that accepted the connection and then did not answer in time."""
        cause = exc.__cause__
        if isinstance(cause, httpx.ConnectError | httpx.ConnectTimeout):
            detail = str(cause) or f"no connection within {self.http_timeout(self.options.http_timeout_s).connect:g} s"
            self.unreachable = f"{type(cause).__name__}: {detail}"

    async def retrieve(self, client: Any, service_id: str, deadline: float, what: str) -> dict[str, Any]:
        """Long-poll a future until it completes or fails; ``ServiceCallError`` on failure or at the deadline.

        SkyRL answers a failed future with HTTP 400 and the error text (an OOM in the engine arrives this way), and a
        long-poll that ran out server-side with 408; a long-poll that outlasts our read timeout is asked again.
        """
        errors = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServiceCallError(f"{what}: no result within {self.settings.timeout_s:g} s (request {service_id})")
            poll = min(RETRIEVE_POLL_S, left)
            try:
                response = await asyncio.wait_for(
                    client.post(
                        "/api/v1/retrieve_future",
                        body={"request_id": service_id},
                        cast_to=httpx.Response,
                        options={"timeout": self.http_timeout(poll + 5), "max_retries": 0},
                    ),
                    min(left, poll + 10),
                )
            except (TimeoutError, tinker.APITimeoutError):
                continue
            except tinker.APIStatusError as exc:
                body = getattr(exc, "body", None)
                detail = str(body.get("detail")) if isinstance(body, dict) and body.get("detail") else exc.message
                if exc.status_code == 408:
                    continue
                if exc.status_code == 400:
                    raise ServiceCallError(detail) from None  # the request failed in the service
                if exc.status_code < 500:
                    raise ServiceCallError(
                        f"{what}: HTTP {exc.status_code} retrieving request {service_id}: {detail}"
                    ) from None
                last = (
                    f"{what}: HTTP {exc.status_code} from {self.settings.base_url} retrieving request {service_id}: {detail}"
                )
            except tinker.APIConnectionError as exc:
                cause = exc.__cause__ or exc
                last = f"{what}: lost the service at {self.settings.base_url} ({type(cause).__name__}: {cause})"
            else:
                if "protobuf" in response.headers.get("content-type", ""):
                    return decode_proto_result(what, response.content)
                try:
                    data = response.json()
                except ValueError as exc:
                    raise ServiceCallError(
                        f"{what}: malformed reply retrieving request {service_id} ({malformed(exc)})"
                    ) from None
                if not isinstance(data, dict) or data.get("type") == "try_again":
                    await asyncio.sleep(0.05)
                    continue
                if "error" in data and ("category" in data or data.get("status") == "failed"):
                    raise ServiceCallError(str(data["error"]))
                return data
            errors += 1
            if errors > self.options.retries:
                raise ServiceCallError(last)
            await asyncio.sleep(min(2.0, 0.25 * 2**errors))

    # ------------------------------------------------------------------ setup

    async def setup(self, client: Any) -> None:
        if self.base_model is None:
            caps = await self.call("get_server_capabilities", lambda: client.service.get_server_capabilities())
            models = getattr(caps, "supported_models", None)  # a reply that is not JSON arrives as its text
            if not isinstance(models, list):
                self.recognised = False
                raise ServiceCallError("get_server_capabilities: malformed reply (no supported_models)", malformed=True)
            if not models:
                raise ServiceCallError("the service lists no supported model")
            first = models[0]
            name = first.get("model_name") if isinstance(first, dict) else getattr(first, "model_name", None)
            if not isinstance(name, str) or not name:
                raise ServiceCallError("get_server_capabilities: malformed reply (a supported model without model_name)")
            self.base_model = name
        session = await self.call(
            "create_session",
            lambda: client.service.create_session(
                request=types.CreateSessionRequest(tags=["skyrl-sim"], user_metadata=None, sdk_version="skyrl-sim")
            ),
        )
        try:
            self.session_id = reply_field(session, "session_id", "create_session")
        except ServiceCallError:
            self.recognised = False  # the SDK hands back whatever answered (a page's text): no session is no service
            raise
        deadline = time.monotonic() + self.options.setup_timeout_s
        loaded = self.variant.workload.initial_loaded()  # the others are created by the workload's create_model
        for model in dict.fromkeys(c.model_id for c in self.variant.workload.clients):
            if model not in loaded:
                continue
            future = await self.call("create_model", lambda m=model: client.models.create(request=self.create_request(m)))
            request_id = reply_field(future, "request_id", "create_model")
            data = await self.retrieve(client, request_id, deadline, f"create_model for {model}")
            self.model_ids[model] = reply_field(data, "model_id", f"create_model for {model} (its result)")

    def create_request(self, model: str) -> Any:
        """A CreateModelRequest for a scenario model (each creation its own sequence number and LoRA seed)."""
        seq = self.created
        self.created += 1
        return types.CreateModelRequest(
            session_id=self.session_id,
            model_seq_id=seq,
            base_model=self.base_model,
            lora_config=types.LoraConfig(rank=self.variant.endpoint.lora.rank, seed=seq),
            user_metadata={"skyrl_sim_model": model},
        )

    async def create_in_workload(self, client: Any, model: str) -> Any:
        """A workload's create_model: SkyRL names the new model in its immediate answer (before the engine has run
        the request), so the requests that follow it can address the model at once."""
        body = self.create_request(model).model_dump(mode="json", exclude_none=True)
        response = await client.post("/api/v1/create_model", body=body, cast_to=httpx.Response)
        try:
            data = response.json()
        except ValueError as exc:
            reason = malformed(exc)
            raise ServiceCallError(f"create_model for {model}: malformed reply from the service ({reason})") from None
        self.model_ids[model] = reply_field(data, "model_id", f"create_model for {model}")
        return _Future(reply_field(data, "request_id", f"create_model for {model}"))

    async def unload(self, client: Any) -> None:
        """Free the run's adapters (a service holds a fixed number); a failure here only adds a note."""
        deadline = time.monotonic() + self.options.setup_timeout_s
        for model, model_id in self.model_ids.items():
            try:
                request = types.UnloadModelRequest(model_id=model_id)
                future = await self.call("unload_model", lambda r=request: client.models.unload(request=r))
                request_id = reply_field(future, "request_id", "unload_model")
                await self.retrieve(client, request_id, deadline, f"unload_model for {model}")
            except ServiceCallError as exc:
                self.result.notes.append(f"could not unload {model} ({model_id}): {exc}")

    async def heartbeat(self, client: Any) -> None:
        """Keep the session alive (SkyRL unloads the models of a session silent for 300 s)."""
        while True:
            await asyncio.sleep(10)
            if self.session_id is None:
                continue
            with contextlib.suppress(ServiceCallError):
                await self.call(
                    "session_heartbeat",
                    lambda: client.service.session_heartbeat(
                        request=types.SessionHeartbeatRequest(session_id=self.session_id)
                    ),
                )

    # ------------------------------------------------------------------ requests

    def build(self, item: _Submitted) -> tuple[str, Callable[[Any], Any]]:
        """The SDK call that submits one request."""
        spec = item.planned.spec
        model = self.variant.workload.clients[item.planned.client_index].model_id
        if spec.type == "create_model":
            return spec.type, lambda c: self.create_in_workload(c, model)
        if model not in self.model_ids:
            raise ServiceCallError(f"{spec.type}: model {model} has not been created (no create_model before it)")
        model_id = self.model_ids[model]
        if spec.type == "unload_model":
            unload = types.UnloadModelRequest(model_id=model_id)
            return spec.type, lambda c: c.models.unload(request=unload)
        salt = item.key
        if spec.type in PASSES:
            data = []
            rl = spec.loss_fn != "cross_entropy" and spec.loss_fn_inputs is not None
            for index, length in enumerate(item.planned.datums):
                tokens = synthetic_tokens(length + 1, salt * 131 + index, self.options.token_id_max)
                inputs: dict[str, Any] = {"target_tokens": tokens[1:], "weights": [1.0] * length}
                if rl:  # an RL loss's inputs, as the scenario gives them per target
                    assert spec.loss_fn_inputs is not None
                    inputs = {
                        "target_tokens": tokens[1:],
                        "logprobs": spec.loss_fn_inputs.per_token("logprobs", length),
                        "advantages": spec.loss_fn_inputs.per_token("advantages", length),
                    }
                data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
            fb_input = types.ForwardBackwardInput(data=data, loss_fn=spec.loss_fn, loss_fn_config=spec.loss_fn_config)
            request = types.ForwardBackwardRequest(forward_backward_input=fb_input, model_id=model_id)
            forward_only = spec.type == "forward"
            return spec.type, lambda c: c.training.forward_backward(request=request, forward_only=forward_only)
        if spec.type == "optim_step":
            optim = types.OptimStepRequest(adam_params=types.AdamParams(learning_rate=spec.learning_rate), model_id=model_id)
            return spec.type, lambda c: c.training.optim_step(request=optim)
        if spec.type == "save_weights_for_sampler":
            save = types.SaveWeightsForSamplerRequest(model_id=model_id, path=spec.checkpoint or f"sampler-{item.key}")
            return spec.type, lambda c: c.weights.save_for_sampler(request=save)
        if spec.type == "save_weights":
            state = types.SaveWeightsRequest(model_id=model_id, path=spec.checkpoint or f"state-{item.key}")
            return spec.type, lambda c: c.weights.save(request=state)
        prompt = types.ModelInput.from_ints(synthetic_tokens(spec.prompt_tokens, salt, self.options.token_id_max))
        params = types.SamplingParams(max_tokens=spec.max_tokens, temperature=1.0, seed=salt)
        target: dict[str, Any] = (
            {"model_path": f"tinker://{model_id}/{spec.checkpoint}"} if spec.checkpoint else {"base_model": self.base_model}
        )
        if spec.prompt_logprobs:  # compute_logprobs through the SDK: a one-token sample with prompt log-probs
            target["prompt_logprobs"] = True
        sample = types.SampleRequest(prompt=prompt, sampling_params=params, num_samples=spec.num_samples, **target)
        return spec.type, lambda c: c.sampling.asample(request=sample)

    async def submit(self, client: Any, item: _Submitted) -> None:
        """Submit, then retrieve in the background; any failure becomes the request's error."""
        record = item.record
        record.submitted_s = self.now()
        deadline = self.t0 + record.submitted_s + self.settings.timeout_s
        kind = item.planned.spec.type
        try:  # the submission itself is held to the request's deadline too (a server may stall on POST)
            kind, send = self.build(item)
            future = await asyncio.wait_for(self.call(f"submit {kind}", lambda: send(client)), self.settings.timeout_s)
            item.service_id = reply_field(future, "request_id", f"submit {kind}")
        except TimeoutError:
            self.finish(item, error=f"submit {kind}: not accepted within {self.settings.timeout_s:g} s")
            return
        except ServiceCallError as exc:
            self.finish(item, error=str(exc))
            return
        self.tasks.append(asyncio.create_task(self.collect(client, item, deadline)))

    async def collect(self, client: Any, item: _Submitted, deadline: float) -> None:
        """Retrieve one result; whatever goes wrong, the request ends (a waiting client must never hang)."""
        try:
            data = await self.retrieve(client, item.service_id or "", deadline, item.record.type)
            self.finish(item, data=data)
        except ServiceCallError as exc:
            self.finish(item, error=str(exc))
        except Exception as exc:  # a result we cannot read is that request's failure, not the run's
            self.finish(item, error=f"{item.record.type}: unreadable result: {type(exc).__name__}: {exc}")

    def finish(self, item: _Submitted, error: str | None = None, data: dict[str, Any] | None = None) -> None:
        """Write a request's result or failure, once (a client that gave up has already written its failure)."""
        if item.done.is_set():
            return
        record = item.record
        record.completed_s = self.now()
        record.status = "failed" if error else "completed"
        record.error = error
        item.result = data
        try:
            if data is not None:
                metrics = data.get("metrics") or {}
                record.metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
                record.outputs = outputs_of(record.type, data)
        finally:
            item.done.set()

    # ------------------------------------------------------------------ clients

    async def submit_planned(self, client: Any, planned: PlannedRequest) -> int:
        """The clock's ``Submit``: one request of a client's script, submitted (``submit``); answers the id the
        client knows it by, which numbers the run's requests in the order they were made."""
        key = len(self.items) + 1
        record = planned_record(key, self.variant.workload.clients[planned.client_index], planned)
        item = _Submitted(key, planned, record)
        self.items[key] = item
        await self.submit(client, item)
        return key

    def done_event(self, request_id: int) -> asyncio.Event:
        """The clock's ``Await``: set once the request's result or failure is known."""
        return self.items[request_id].done

    def give_up(self, request_id: int, error: str) -> None:
        """A client stopped waiting (the clock's backstop, ``RESULT_GRACE_S`` after the request's own deadline): the
        request fails with ``error`` unless its result came meanwhile."""
        self.finish(self.items[request_id], error=error)

    def retrieved(self, request_id: int, seen_s: float) -> None:
        """Never called: a live client sees a result when its retrieve returns it (no poller tick to add)."""

    def client_waiting(self) -> None:
        """A client waits on a result (or is done): once all do, a held engine may run."""
        self.waiting_clients += 1
        if not self.gate_released and self.waiting_clients == len(self.variant.workload.clients):
            self.gate_released = True
            assert self.gate is not None
            self.gate.release()

    # ------------------------------------------------------------------ the run

    async def main(self) -> RunResult:
        log_offset = log_size(self.settings.log) if self.settings.log else 0
        client = AsyncTinker(
            api_key=self.settings.api_key,
            base_url=self.settings.base_url,
            timeout=self.http_timeout(self.options.http_timeout_s),
            max_retries=0,
        )
        heartbeat = asyncio.create_task(self.heartbeat(client))
        try:
            try:
                await asyncio.wait_for(self.setup(client), self.options.setup_timeout_s)
            except (ServiceCallError, TimeoutError) as exc:
                if not self.answered and self.unreachable is not None:
                    raise UserError(
                        f"--backend tinker: nothing answered at {self.settings.base_url} ({self.unreachable}, "
                        f"{self.options.retries + 1} tries); start the service or point --option base_url= at it"
                    ) from None
                self.refuse_if_not_the_service(exc)
                reason = str(exc) or f"no answer within {self.options.setup_timeout_s:g} s"
                self.fail_all(f"service setup failed: {reason}")
                return self.finalize(None, log_offset)
            if self.gate is not None:
                self.gate.hold()
            try:
                clock = AsyncioClock(lambda planned: self.submit_planned(client, planned), self.done_event, self.t0)
                wait_limit_s = self.settings.timeout_s + RESULT_GRACE_S
                processes = client_processes(
                    self.variant, self, wait_limit_s, poll=None, on_first_await=self.client_waiting
                )
                await clock.run(processes, wait_limit_s)
                await asyncio.gather(*self.tasks)
            finally:
                if not self.gate_released and self.gate is not None:
                    self.gate_released = True
                    self.gate.release()
            await self.unload(client)
        finally:
            heartbeat.cancel()
            await client.close()
        return self.finalize(self.settings.log, log_offset)

    def refuse_if_not_the_service(self, exc: BaseException) -> None:
        """A ``UserError`` when the first API calls were answered by something that is not a Tinker service that
        takes these requests (``NOT_THE_SERVICE``, or a reply the SDK cannot read) and nothing was ever recognised."""
        if self.recognised or not isinstance(exc, ServiceCallError):
            return
        if exc.status in NOT_THE_SERVICE:
            why = f"HTTP {exc.status}, {NOT_THE_SERVICE[exc.status]}"
        elif exc.malformed:
            why = "a reply that is not the Tinker API's"
        else:
            return
        hint = (
            "give the API key it takes (--option api_key=...)"
            if exc.status in (401, 403)
            else "give the service's root (http://HOST:PORT, no path) of SkyRL's API server; a service without "
            "get_server_capabilities needs --option base_model=NAME"
        )
        raise UserError(
            f"--backend tinker: {self.settings.base_url} does not answer as a Tinker API service ({why}: {exc}); {hint}"
        ) from None

    def fail_all(self, reason: str) -> None:
        """Nothing can be submitted: every planned request fails with the reason."""
        key = 0
        for index, workload_client in enumerate(self.variant.workload.clients):
            for planned in self.variant.client_requests(index):
                key += 1
                record = planned_record(key, workload_client, planned, status="failed", error=reason)
                self.items[key] = _Submitted(key, planned, record)

    def finalize(self, log_path: str | None, log_offset: int) -> RunResult:
        """Number requests by arrival order at the service, attach the logged calls, and derive missing metrics."""
        order = sorted(
            self.items.values(),
            key=lambda it: (it.service_id is None, _numeric(it.service_id), it.key),
        )
        by_service: dict[str, RequestRecord] = {}
        for new_id, item in enumerate(order, start=1):
            item.record.id = new_id
            if item.service_id is not None:
                item.record.outputs["service_request_id"] = item.service_id
                by_service[item.service_id] = item.record
        result = self.result
        result.requests = [item.record for item in order]
        result.totals = self.variant.workload_totals()
        result.versions = service_versions()
        if log_path is None:
            if self.settings.log is None:
                result.notes.append("calls: the service's log is not readable here (no endpoint service_log / --option log)")
        else:
            try:
                logged = read_service_log(log_path, log_offset)
            except OSError as exc:
                result.notes.append(f"calls: cannot read the service log {log_path}: {exc.strerror}")
            else:
                result.calls = self.calls_from_log(logged.calls, by_service)
                result.log = logged.lines
                if not logged.has_ids:
                    result.notes.append(
                        "calls: the service log gives each call's kind and size but not its requests; request_ids are empty"
                    )
        derive_token_metrics(result)
        return result

    def calls_from_log(self, logged: list[LoggedCall], by_service: dict[str, RequestRecord]) -> list[CallRecord]:
        """The run's calls from the service's log (``logged_call_record``'s rules), on the run's clock; calls of
        other clients of the service, and this run's own model creation, are left out."""
        calls: list[CallRecord] = []
        for entry in logged:
            records = [by_service[i] for i in entry.ids or [] if i in by_service]
            if entry.ids is not None and not records:
                continue  # a call of another client of the service (or our own setup, create_model)
            if entry.ids is None and entry.kind in ("create_model", "unload_model"):
                continue
            call = logged_call_record(entry, records, len(calls), entry.end_epoch - self.t0_epoch)
            calls.append(call)
            self.context.call_finished(call, self.result)
        return calls


def decode_proto_result(what: str, content: bytes) -> dict[str, Any]:
    """SkyRL sends forward/forward_backward/sample results in the SDK's protobuf wire format: decode with the SDK."""
    from tinker.proto.response_conv import deserialize_proto_response
    from tinker.types import ForwardBackwardOutput, SampleResponse

    model = SampleResponse if what == "sample" else ForwardBackwardOutput
    return plain(deserialize_proto_response(content, model))  # type: ignore[no-any-return]


def plain(value: Any) -> Any:
    """SDK objects (pydantic models, dataclasses, arrays) as plain JSON-like data."""
    import dataclasses

    if hasattr(value, "model_dump"):
        return plain(value.model_dump())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def outputs_of(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    """What a client can see of a result: per-datum output lengths (passes), generated tokens (samples)."""
    if kind in PASSES:
        lengths = []
        for output in data.get("loss_fn_outputs") or []:
            logprobs = output.get("logprobs") or {}
            values = logprobs.get("data") if isinstance(logprobs, dict) else None
            shape = logprobs.get("shape") if isinstance(logprobs, dict) else None
            lengths.append(len(values) if values is not None else int((shape or [0])[0]))
        return {"datum_lengths": lengths}
    if kind == "sample":
        sequences = data.get("sequences") or []
        return {"generated_tokens": sum(len(s.get("tokens") or []) for s in sequences)}
    return {}


def derive_token_metrics(result: RunResult) -> None:
    """``num_tokens:sum`` where the service did not report it (SkyRL's JAX backend reports no metrics).

    SkyRL-Train computes it per backend call and attaches it to every request of the call; so does this, from the
    per-datum output lengths (every target weighs 1), when the call's requests are known from the log, and per request
    otherwise.
    """
    derived = False
    grouped: set[int] = set()
    by_id = {r.id: r for r in result.requests}
    for call in result.calls:
        members = [by_id[i] for i in call.request_ids if i in by_id]
        if call.kind not in PASSES or not members or any(r.status != "completed" for r in members):
            continue
        if all("num_tokens:sum" in r.metrics for r in members):
            continue
        total = float(sum(sum(r.outputs.get("datum_lengths", [])) for r in members))
        for record in members:
            record.metrics.setdefault("num_tokens:sum", total)
            grouped.add(record.id)
        derived = True
    for record in result.requests:
        complete = record.type in PASSES and record.status == "completed" and record.id not in grouped
        if complete and "num_tokens:sum" not in record.metrics:
            record.metrics["num_tokens:sum"] = float(sum(record.outputs.get("datum_lengths", [])))
            derived = True
    if derived:
        result.notes.append(
            "metrics: num_tokens:sum derived from per-datum output lengths (the service reported none); "
            "per call where the log names the call's requests, else per request"
        )


def service_versions() -> dict[str, str]:
    from importlib import metadata

    try:
        return {"tinker": metadata.version("tinker")}
    except metadata.PackageNotFoundError:
        return {}
