"""Scenario files: an endpoint, a workload, named variants, and what each variant is expected to do.

A scenario is one YAML file. Its endpoint is inline, or a name looked up in ``endpoints/`` beside the file (then in
``./scenarios/endpoints``), or a path. Variants are dotted-key overrides of the endpoint (``engine.cap_aware_padding``)
or of the workload (``workload.clients.0.submit.gap_s``). Every validation error names the file, the key path and the
reason.

This module is the file and its resolution; the parts it reads have their own: ``requests`` (a client's requests),
``workload``, ``expect`` (the ``expect`` sections), ``overrides`` (dotted keys), ``endpoint_files`` (finding the
endpoint), ``model_fit`` (endpoint and model agree) and ``variant`` (``ResolvedVariant``, what a backend runs).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from skyrl_sim.errors import ScenarioError
from skyrl_sim.schema.architecture import ModelArch, resolve_model
from skyrl_sim.schema.documents import read_yaml, validation_error
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.endpoint_files import load_endpoint
from skyrl_sim.schema.expect import WorkloadFacts, check_expectations, pick_expectations
from skyrl_sim.schema.limits import MAX_SCENARIO_BYTES
from skyrl_sim.schema.loss_settings import loss_settings_problem
from skyrl_sim.schema.model_fit import check_fit
from skyrl_sim.schema.overrides import REPLACED_WHOLE, apply_override, blame, split_override
from skyrl_sim.schema.scenario_spec import Scenario
from skyrl_sim.schema.shipped import shipped_scenarios
from skyrl_sim.schema.variant import ResolvedVariant
from skyrl_sim.schema.workload import Workload
from skyrl_sim.units import GIB


class ScenarioFile:
    """A loaded, validated scenario file; ``resolve`` applies a variant and command-line overrides."""

    def __init__(self, path: Path, endpoint_override: str | None = None, raw: dict[str, Any] | None = None) -> None:
        """``raw``: the file's mapping when the caller already has it (an imported trace: no YAML round trip);
        ``path`` then only locates endpoint names and names the source in errors."""
        self.path = path
        self.raw = raw if raw is not None else read_yaml(path, MAX_SCENARIO_BYTES, "the scenario file")
        try:
            self.scenario = Scenario.model_validate(self.raw)
        except ValidationError as exc:
            raise validation_error(str(path), "", exc) from None
        ref: str | dict[str, Any] = endpoint_override or self.scenario.endpoint
        self.endpoint_raw, self.endpoint_source = load_endpoint(ref, path)
        self.endpoint_prefix = "" if self.endpoint_source != str(path) else "endpoint"
        self._validate_endpoint(copy.deepcopy(self.endpoint_raw), [])  # the base itself, even if variants override it
        self._check_known_misses()
        for name in self.scenario.variants:
            self.resolve(name)  # every variant must be valid up front

    def _check_known_misses(self) -> None:
        public = self.scenario.public
        for name in public.known_misses if public is not None else ():
            if name not in self.scenario.variants:
                known = ", ".join(self.scenario.variants)
                raise ScenarioError(str(self.path), f"public.known_misses.{name}", f"no variant '{name}' (known: {known})")

    @property
    def variant_names(self) -> list[str]:
        return list(self.scenario.variants)

    def _validate_endpoint(self, data: dict[str, Any], overrides: list[tuple[str, Any, str]]) -> tuple[Endpoint, ModelArch]:
        """The endpoint and its model, checked together; errors name the file (or override) and the key."""
        try:
            endpoint = Endpoint.model_validate(data)
        except ValidationError as exc:
            error = validation_error(self.endpoint_source, self.endpoint_prefix, exc)
            raise blame(error, overrides, "endpoint", self.endpoint_prefix) from None
        try:
            model = resolve_model(endpoint.model, Path(self.endpoint_source).parent)
        except ValueError as exc:
            error = ScenarioError(self.endpoint_source, self._key("model"), str(exc))
            raise blame(error, overrides, "endpoint", self.endpoint_prefix) from None
        try:
            check_fit(endpoint, model)
        except ScenarioError as exc:
            error = ScenarioError(self.endpoint_source, self._key(exc.key), exc.reason)
            raise blame(error, overrides, "endpoint", self.endpoint_prefix) from None
        return endpoint, model

    def _key(self, key: str) -> str:
        return f"{self.endpoint_prefix}.{key}" if self.endpoint_prefix else key

    def resolve(
        self, variant: str, sets: dict[str, Any] | None = None, origins: dict[str, str] | None = None
    ) -> ResolvedVariant:
        """The variant with its ``set`` and then ``sets`` applied; ``origins`` names where a ``sets`` key came from
        (``--grid``; default ``--set``) so an error is reported against it."""
        if variant not in self.scenario.variants:
            raise ScenarioError(
                str(self.path), "variants", f"no variant '{variant}' (known: {', '.join(self.scenario.variants)})"
            )
        spec = self.scenario.variants[variant]
        endpoint_data, workload_data = self.endpoint_raw, self.raw["workload"]  # overrides copy what they change
        overrides = [(k, v, f"{self.path} (variant {variant}, set)") for k, v in spec.set.items()]
        overrides += [(k, v, (origins or {}).get(k, "--set")) for k, v in (sets or {}).items()]
        for dotted, value, origin in overrides:
            target, key = split_override(dotted)
            if target == "endpoint":
                endpoint_data = apply_override(endpoint_data, key, value, origin, merge=key not in REPLACED_WHOLE)
            else:
                workload_data = apply_override(workload_data, key, value, origin)
        endpoint, model = self._validate_endpoint(endpoint_data, overrides)
        try:
            # no override reached the workload: the scenario's own, validated once (a long workload's requests are
            # held once, not once more per variant)
            unchanged = workload_data is self.raw["workload"]
            workload = self.scenario.workload if unchanged else Workload.model_validate(workload_data)
        except ValidationError as exc:
            raise blame(validation_error(str(self.path), "workload", exc), overrides, "workload", "workload") from None
        for c, client in enumerate(workload.clients):
            for r, request in enumerate(client.requests):
                problem = loss_settings_problem(request.loss_fn, request.loss_fn_config or {}, endpoint.trainer.strategy)
                if problem is not None:  # blamed on what set the setting, or else on what set the loss
                    key, reason = problem
                    request_key = f"workload.clients.{c}.requests.{r}"
                    error = ScenarioError(str(self.path), f"{request_key}.loss_fn_config.{key}", reason)
                    blamed = blame(error, overrides, "workload", "workload")
                    if blamed is error:
                        by_loss = ScenarioError(str(self.path), f"{request_key}.loss_fn", reason)
                        blamed = blame(by_loss, overrides, "workload", "workload")
                        blamed = error if blamed is by_loss else blamed
                    raise blamed
        for c, client in enumerate(workload.clients):
            for r, request in enumerate(client.requests):
                routes = request.routed_experts
                if routes is None:
                    continue
                where = f"workload.clients[{c}].requests[{r}].routed_experts"
                if model.moe is None:
                    reason = f"model '{model.name}' has no mixture-of-experts layers: there are no routes to replay"
                    raise ScenarioError(str(self.path), where, reason)
                if routes.expert_weights is not None and len(routes.expert_weights) != model.moe.num_experts:
                    reason = f"expert_weights has {len(routes.expert_weights)} weights for {model.moe.num_experts} experts"
                    raise ScenarioError(str(self.path), where + ".expert_weights", reason)
        written, source = pick_expectations(spec.expect, self.scenario.expect)
        expectations = written.effective()
        resolved = ResolvedVariant(
            scenario=self.scenario,
            variant_name=variant,
            endpoint=endpoint,
            model=model,
            workload=workload,
            expectations=expectations,
            source=str(self.path),
            endpoint_source=self.endpoint_source,
            overrides=dict(sets or {}),
        )
        where = f"variants.{variant}.expect" if source == "variant" else "expect"
        facts = WorkloadFacts(
            resolved.request_count(),
            endpoint.capacity_bytes / GIB,
            resolved.request_types,
            resolved.forward_pass_requests,
        )
        check_expectations(written, facts, str(self.path), where)
        return resolved


def load_scenario(path: str | Path, endpoint: str | None = None) -> ScenarioFile:
    """A scenario file; a path that does not exist but names a shipped scenario (``queue_drain_17``,
    ``scenarios/queue_drain_17.yaml``) is that shipped file, so the commands of the README and the manual (docs/) run
    after a plain install."""
    return ScenarioFile(resolve_scenario_path(Path(path)), endpoint)


def resolve_scenario_path(path: Path) -> Path:
    if path.exists() or str(path.parent) not in (".", "scenarios"):
        return path
    shipped = shipped_scenarios().get(path.stem if path.suffix in (".yaml", ".yml") else path.name)
    return shipped if shipped is not None else path
