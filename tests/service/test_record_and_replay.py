"""Import and replay a real SkyRL database: traffic through a live SkyRL 0.4.0 service, then its own ``tinker.db``.

One fresh service (its database holds only this module's traffic) runs the 17-request drain (warm-up alone, then 16
back to back) and a multi-tenant mix (passes, optim steps, sampler saves, samples), each through the ``tinker``
backend, which creates its models first and unloads them at the end. Then an ``optim_step`` and a
``forward_backward`` are sent to an unloaded model: SkyRL fails both ("Model ... not loaded"), so the database holds
failed requests and the whole model lifecycle.

The database is imported and replayed on ``skyrl-jax-cpu``:
- the imported scenario reproduces the request sequence exactly (types, models, datum lengths, arrival order);
- every recorded outcome is reproduced, the lifecycle failures included;
- the replay's calls hold the requests of the calls the service's log shows, kind by kind and model by model, in the
  same order. Which arrivals of a burst share a call depends on how long the call before them ran (SkyRL's JAX
  backend compiles every new shape, 10-40 s, which the simulator does not model) and on where the engine's 100 ms
  loop was when they arrived, which a database does not record: call boundaries inside a burst are not compared.

``SKYRL_SIM_RECORD_DIR=DIR`` also writes the recording (``tinker.db``, ``service.log``, the live RunResults) to DIR:
that is how ``tests/data/skyrl-0.4.0-*`` was made.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from skyrl_service import SkyRLService, install_service_venv, make_tiny_qwen3
from test_conformance import ENDPOINT, SEED_17

from skyrl_sim.commands.replay import replay_trace
from skyrl_sim.commands.trace_import import read_trace, scenario_of
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.results.result import RunResult, write_results
from skyrl_sim.schema.scenario import ScenarioFile, load_scenario

pytestmark = pytest.mark.service
# The workload starts this long after the backend's setup (its create_model calls), so whether a model is loaded
# when its first request arrives does not hang on how long SkyRL took to create it.
START_S = 2.0

MIX: dict[str, Any] = {
    "name": "recorded-mix",
    "endpoint": str(ENDPOINT),
    "workload": {
        "result_timeout_s": 300,
        "clients": [
            {
                "name": "tenant-0",
                "model_id": "model-0",
                "start_s": START_S,
                "submit": {"mode": "after_previous", "gap_s": 0.01},
                "requests": [
                    {"type": "forward_backward", "lengths": [9, 20]},
                    {"type": "optim_step", "learning_rate": 2.0e-4},
                    {"type": "save_weights_for_sampler", "checkpoint": "step1"},
                    {"type": "sample", "checkpoint": "step1", "prompt_tokens": 8, "max_tokens": 4},
                    {"type": "forward", "datums": [14, 5]},
                ],
            },
            {
                "name": "tenant-1",
                "model_id": "model-1",
                "start_s": START_S + 0.05,
                "submit": {"mode": "after_previous", "gap_s": 0.01},
                "requests": [
                    {"type": "forward_backward", "lengths": [31]},
                    {"type": "optim_step"},
                    {"type": "sample", "prompt_tokens": 8, "max_tokens": 4, "num_samples": 2},
                ],
            },
        ],
    },
}
DRAIN: dict[str, Any] = {
    "name": "recorded-drain-17",
    "endpoint": str(ENDPOINT),
    "workload": {
        "result_timeout_s": 300,
        "clients": [
            {
                "name": "repro",
                "model_id": "repro",
                "start_s": START_S,
                "submit": {"mode": "back_to_back", "gap_s": 0.005, "warmup": 1},
                "requests": [{"type": "forward_backward", "lengths": SEED_17}],
            }
        ],
    },
}


@dataclass
class Recording:
    db: Path
    log: Path
    live: list[RunResult]
    late_ids: list[str]


def run_live(service: SkyRLService, tmp: Path, body: dict[str, Any]) -> RunResult:
    path = tmp / f"{body['name']}.yaml"
    path.write_text(yaml.safe_dump(body))
    options = {"base_url": service.base_url, "log": str(service.log_path), "timeout_s": "300"}
    return PluginHost().run(load_scenario(path).resolve("default"), "tinker", options)


async def submit_late(service: SkyRLService, model_id: str) -> list[str]:
    """An optim_step and a forward_backward for a model that has been unloaded: SkyRL accepts and then fails them."""
    from tinker import types
    from tinker._client import AsyncTinker

    client = AsyncTinker(api_key="tml-skyrl-sim", base_url=service.base_url, max_retries=0)
    try:
        optim = types.OptimStepRequest(adam_params=types.AdamParams(learning_rate=1e-4), model_id=model_id)
        first = await client.training.optim_step(request=optim)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
        )
        fb = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"), model_id=model_id
        )
        second = await client.training.forward_backward(request=fb)
        return [str(first.request_id), str(second.request_id)]
    finally:
        await client.close()


def wait_done(db: Path, ids: list[str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    uri = f"file:{db}?mode=ro"
    while time.monotonic() < deadline:
        with sqlite3.connect(uri, uri=True) as conn:
            marks = ",".join("?" * len(ids))
            rows = conn.execute(f"SELECT status FROM futures WHERE request_id IN ({marks})", ids).fetchall()
        if len(rows) == len(ids) and all(str(s).lower() != "pending" for (s,) in rows):
            return
        time.sleep(0.2)
    raise AssertionError(f"requests {ids} still pending after {timeout_s:.0f} s")


def snapshot(db: Path, out: Path) -> Path:
    """A self-contained copy of a live WAL-mode SQLite database (the WAL folded in, journal mode DELETE)."""
    source = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    target = sqlite3.connect(out)
    with target:
        source.backup(target)
    target.execute("PRAGMA journal_mode=DELETE")
    target.close()
    source.close()
    return out


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Recording:
    if os.environ.get("SKYRL_SIM_SKIP_SERVICE"):
        pytest.skip("SKYRL_SIM_SKIP_SERVICE is set")
    python = install_service_venv()
    model = make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-rec"))
    tmp = tmp_path_factory.mktemp("recording")
    with SkyRLService(model, workdir=tmp_path_factory.mktemp("skyrl-service-rec"), python=python) as service:
        live = [run_live(service, tmp, DRAIN), run_live(service, tmp, MIX)]
        db_path = service.workdir / "tinker.db"
        with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as conn:
            unloaded = conn.execute("SELECT model_id FROM models ORDER BY created_at DESC LIMIT 1").fetchone()[0]
        late = asyncio.run(submit_late(service, unloaded))
        wait_done(db_path, late)
        time.sleep(0.5)  # the log line of the last call follows the result write
        db = snapshot(db_path, tmp / "tinker.db")
        log = tmp / "service.log"
        shutil.copy(service.log_path, log)
    record_dir = os.environ.get("SKYRL_SIM_RECORD_DIR")
    if record_dir:
        out = Path(record_dir)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(db, out / "tinker.db")
        shutil.copy(log, out / "service.log")
        write_results(live, out / "live-runs.json")
    return Recording(db, log, live, late)


def test_import_reproduces_the_request_sequence(recording: Recording, tmp_path: Path) -> None:
    trace = read_trace(str(recording.db))
    body = scenario_of(trace, str(ENDPOINT), "recorded")
    planned = []
    scenario = ScenarioFile(tmp_path / "recorded.yaml", raw=body)
    variant = scenario.resolve("default")
    for index, client in enumerate(variant.workload.clients):
        times = client.submit.times_s or []
        for k, item in enumerate(variant.client_requests(index)):
            planned.append((times[k], client.model_id, item.spec.type, list(item.datums)))
    planned.sort(key=lambda p: p[0])
    # The live runs' requests in service id order, setup and teardown (create/unload) included through the DB.
    service_ids = {str(r.outputs["service_request_id"]): r for run in recording.live for r in run.requests}
    imported = [(r.request_id, r.model_id, r.type, list(r.datums)) for r in trace.requests]
    assert [p[1:] for p in planned] == [i[1:] for i in imported]  # arrival order, models, types, lengths
    for request_id, _model, kind, datums in imported:
        live = service_ids.get(str(request_id))
        if live is not None:  # a workload request (not the backend's own create/unload, not the late ones)
            assert (kind, datums) == (live.type, live.datums)
    assert sum(str(i) in service_ids for i, *_ in imported) == sum(len(run.requests) for run in recording.live)
    kinds = {r.type for r in trace.requests}
    assert {"create_model", "unload_model", "forward_backward", "forward", "optim_step", "sample"} <= kinds
    assert trace.loaded_at_start == []


def test_replay_reproduces_outcomes_and_calls(recording: Recording) -> None:
    trace = read_trace(str(recording.db))
    result = replay_trace(trace, str(ENDPOINT), "recorded", log=str(recording.log))
    recorded = {r.id: r for r in result.recorded.requests}
    simulated = {r.id: r for r in result.simulated.requests}
    assert set(recorded) == set(simulated)
    failed = [i for i, r in recorded.items() if r.status == "failed"]
    assert len(failed) == 2  # the late optim_step and forward_backward
    for request_id, record in recorded.items():
        assert simulated[request_id].status == record.status, request_id
        if record.status == "failed":
            assert simulated[request_id].error is not None and "not loaded" in simulated[request_id].error
            assert record.error is not None and "not loaded" in record.error
    assert result.comparison.summary["status_agreement"] == 1.0

    def per_model(run: RunResult) -> dict[tuple[str, str | None], list[int]]:
        out: dict[tuple[str, str | None], list[int]] = {}
        for call in run.calls:
            model = None if call.kind == "sample" else call.model_id
            out.setdefault((call.kind, model), []).extend(call.request_ids)
        return out

    logged = per_model(result.recorded)
    assert logged, "the service log named no call"
    assert per_model(result.simulated) == logged
