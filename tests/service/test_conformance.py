"""The engine rules against SkyRL's own engine: the same workloads through a live SkyRL service and the simulator.

The service is PyPI skyrl==0.4.0 with its JAX backend (tests/service/skyrl_service.py); the simulator runs the same
scenario on ``scenarios/endpoints/skyrl-jax-cpu.yaml``. The calls SkyRL formed (its log, with the harness's id lines)
must equal the simulator's calls request for request, in order, and every request's outcome must match.

Determinism. What SkyRL batches depends on what is pending when its engine takes a snapshot, so a mix submitted while
the engine runs would batch by timing. The mixes are therefore submitted while the engine is paused between two
iterations (``EngineGate``): every client submits its whole list (back to back, no time between submissions, so each
client's list arrives as one burst, clients in order), and the engine resumes once every client waits on a result. Its
first snapshot then holds the whole mix, and each later iteration drains what the barriers held back: no arrival
depends on timing. The simulator does the same with ``gap_s: 0``: every submission happens at t = 0, before the
engine's first snapshot. Shapes are kept few (inputs <= 31 tokens: one 32-token bucket; at most 3 rows per pass;
samples padded to 4 sequences) because the JAX backend compiles every new (rows, length) shape.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import yaml
from skyrl_service import SkyRLService

from skyrl_sim.plugin_host.hookspecs import RunContext
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.tinker_client.backend import TinkerBackend

pytestmark = pytest.mark.service

ROOT = Path(__file__).resolve().parents[2]
ENDPOINT = ROOT / "scenarios" / "endpoints" / "skyrl-jax-cpu.yaml"
MIXES = 20
LENGTHS = (5, 9, 14, 20, 31)
# The seed's 17 lengths scaled to the tiny model (/1000, rounded): eight short, the long one, eight short.
SEED_17 = [4, 5, 4, 3, 4, 3, 4, 4, 35, 5, 4, 4, 4, 4, 5, 5, 4]


def random_mix(seed: int) -> dict[str, Any]:
    """A multi-tenant mix: 2-3 models, each a short list of passes, optim steps, sampler saves and samples."""
    rng = random.Random(seed)
    clients = []
    for index in range(rng.randint(2, 3)):
        requests: list[dict[str, Any]] = []
        passes = 0
        for _ in range(rng.randint(2, 5)):
            kind = rng.choice(
                ["forward_backward", "forward_backward", "forward", "optim_step", "save_weights_for_sampler", "sample"]
            )
            if kind in ("forward_backward", "forward"):
                if passes >= 3:
                    kind = "optim_step"
                else:
                    passes += 1
                    requests.append({"type": kind, "lengths": [rng.choice(LENGTHS)]})
                    continue
            if kind == "sample":
                requests.append({"type": "sample", "prompt_tokens": 8, "max_tokens": 4})
            else:
                requests.append({"type": kind})
        clients.append(
            {
                "name": f"tenant-{index}",
                "model_id": f"model-{index}",
                "submit": {"mode": "back_to_back", "gap_s": 0},
                "requests": requests,
            }
        )
    return {"name": f"mix-{seed}", "endpoint": str(ENDPOINT), "workload": {"clients": clients, "result_timeout_s": 300}}


def run_both(tmp_path: Path, body: dict[str, Any], service: SkyRLService, host: PluginHost) -> tuple[RunResult, RunResult]:
    path = tmp_path / f"{body['name']}.yaml"
    path.write_text(yaml.safe_dump(body))
    variant = load_scenario(path).resolve("default")
    simulated = host.run(variant, "sim")
    options = {"base_url": service.base_url, "log": str(service.log_path), "timeout_s": "300"}
    live = TinkerBackend(gate=service.gate()).run(variant, RunContext(host=host, options=options))
    return simulated, live


def batches(result: RunResult) -> list[tuple[str, list[int]]]:
    return [(call.kind, list(call.request_ids)) for call in result.calls]


def outcomes(result: RunResult) -> list[tuple[int, str, str, list[int] | None, float | None]]:
    return [
        (r.id, r.type, r.status, r.outputs.get("datum_lengths"), r.metrics.get("num_tokens:sum")) for r in result.requests
    ]


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost()


def test_seed_shape_through_the_live_service(tmp_path: Path, skyrl_service: SkyRLService, host: PluginHost) -> None:
    """The 17-request drain (warm-up alone, then 16 back to back) completes with per-datum outputs and token metrics."""
    body = {
        "name": "queue-drain-17-tiny",
        "endpoint": str(ENDPOINT),
        "workload": {
            "clients": [
                {
                    "name": "repro",
                    "model_id": "repro",
                    "submit": {"mode": "back_to_back", "gap_s": 0.005, "warmup": 1},
                    "requests": [{"type": "forward_backward", "lengths": SEED_17}],
                }
            ],
            "result_timeout_s": 300,
        },
    }
    path = tmp_path / "q17.yaml"
    path.write_text(yaml.safe_dump(body))
    variant = load_scenario(path).resolve("default")
    options = {"base_url": skyrl_service.base_url, "log": str(skyrl_service.log_path), "timeout_s": "300"}
    live = host.run(variant, "tinker", options)
    assert [r.status for r in live.requests] == ["completed"] * 17, [r.error for r in live.failed]
    for record in live.requests:
        assert record.outputs["datum_lengths"] == record.datums
    assert sorted(i for call in live.calls for i in call.request_ids) == list(range(1, 18))
    assert live.calls[0].request_ids == [1]  # the warm-up call ran alone
    for call in live.calls:
        total = float(sum(live.request(i).tokens for i in call.request_ids))
        assert all(live.request(i).metrics["num_tokens:sum"] == total for i in call.request_ids)
    assert live.request(9).tokens == 35


@pytest.mark.parametrize("seed", range(MIXES))
def test_random_mix_conforms(seed: int, tmp_path: Path, skyrl_service: SkyRLService, host: PluginHost) -> None:
    simulated, live = run_both(tmp_path, random_mix(seed), skyrl_service, host)
    assert batches(live) == batches(simulated), f"service log:\n{live.log}"
    assert outcomes(live) == outcomes(simulated)


LIFECYCLE_MIXES = 8


def lifecycle_mix(seed: int) -> dict[str, Any]:
    """A mix with model lifecycle: some tenants' models are not loaded at the start and begin with create_model (their
    passes queued in the same burst fail in SkyRL's batch filter); some unload their model part-way, and what follows
    fails (passes in the filter, singles in their checks). A model is created at most once: SkyRL's every create_model
    makes a new model id (the tinker backend refuses a second create_model of one scenario model)."""
    rng = random.Random(10_000 + seed)
    body = random_mix(seed)
    loaded = []
    for client in body["workload"]["clients"]:
        requests = client["requests"]
        if rng.random() < 0.5:
            requests.insert(0, {"type": "create_model"})
        else:
            loaded.append(client["model_id"])
        if rng.random() < 0.6:
            at = rng.randint(1, len(requests))
            tail: list[dict[str, Any]] = [{"type": "unload_model"}, {"type": "forward_backward", "lengths": [9]}]
            tail.append({"type": rng.choice(["optim_step", "save_weights_for_sampler"])})
            requests[at:at] = tail
    body["name"] = f"lifecycle-{seed}"
    body["workload"]["loaded_models"] = loaded
    return body


@pytest.mark.parametrize("seed", range(LIFECYCLE_MIXES))
def test_lifecycle_mix_conforms(seed: int, tmp_path: Path, skyrl_service: SkyRLService, host: PluginHost) -> None:
    simulated, live = run_both(tmp_path, lifecycle_mix(seed), skyrl_service, host)
    assert batches(live) == batches(simulated), f"service log:\n{live.log}"
    assert outcomes(live) == outcomes(simulated)
