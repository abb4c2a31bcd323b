"""The real backend's sampler with a stand-in generation client: SkyRL's concurrency, results per request, drains,
waves, failures, checkpoint switches. (vLLM itself is in ``tests/real``; the validation runs it under the engine.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from skyrl_sim.engine.futures import FuturesTable
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.megatron_vllm.engine_sampler import VllmEngineSampler


class StandInClient:
    """Answers each generate after ``delay_s``; counts how many are in flight at once.

    With ``first_meets`` the first call waits (up to ``MEET_TIMEOUT_S``) until that many calls are in flight, so a
    sender that really sends concurrently reaches its cap however slowly the machine starts its threads, and a serial
    one shows a count of 1."""

    MEET_TIMEOUT_S = 20.0

    def __init__(self, delay_s: float = 0.05, fail_prompt_len: int | None = None, first_meets: int = 1) -> None:
        self.delay_s = delay_s
        self.fail_prompt_len = fail_prompt_len
        self.first_meets = first_meets
        self.lock = threading.Condition()
        self.now = 0
        self.most = 0
        self.calls: list[dict[str, Any]] = []

    def generate(self, prompt: list[int], max_tokens: int, **kwargs: Any) -> Any:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.calls.append({"prompt": prompt, "max_tokens": max_tokens, **kwargs})
            self.lock.notify_all()
            if len(self.calls) == 1:
                self.lock.wait_for(lambda: self.now >= self.first_meets, timeout=self.MEET_TIMEOUT_S)
        try:
            time.sleep(self.delay_s)
            if self.fail_prompt_len is not None and len(prompt) == self.fail_prompt_len:
                raise RuntimeError("the server said no")
            sample = type("Sample", (), {"token_ids": [7] * max_tokens})()
            return type("Generation", (), {"samples": [sample]})()
        finally:
            with self.lock:
                self.now -= 1


def setup(
    tmp_path: Path, concurrency: int, requests: list[dict[str, Any]], client: StandInClient, served: list | None = None
) -> tuple[VllmEngineSampler, FuturesTable, list[Any]]:
    body = {
        "name": "s",
        "endpoint": {
            "name": "s",
            "model": "tiny-dense",
            "hardware": {"profile": "cpu", "devices": 1},
            "inference": {"generate_concurrency_per_engine": concurrency},
        },
        "workload": {"clients": [{"name": "c", "model_id": "m", "requests": requests}]},
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(body))
    variant = load_scenario(path).resolve("default")
    t0 = time.monotonic()
    table = FuturesTable(variant, clock=lambda: time.monotonic() - t0)

    def serve(where: Path) -> StandInClient:
        if served is not None:
            served.append((where, client.now))
        return client

    sampler = VllmEngineSampler(
        variant.endpoint,
        table,
        table.clock,
        serve=serve,
        metrics=lambda: "",
        checkpoint=lambda r: tmp_path / (r.checkpoint or "base"),
        vocab_size=512,
        seed=3,
        timeout_s=30,
    )
    submitted = [table.submit(p) for p in variant.client_requests(0)]
    return sampler, table, submitted


def test_samples_go_one_request_each_under_skyrls_cap_and_each_request_completes_when_its_last_does(
    tmp_path: Path,
) -> None:
    client = StandInClient(delay_s=0.05, first_meets=2)
    requests = [{"type": "sample", "prompt_tokens": 8, "max_tokens": 4, "num_samples": 3, "count": 4}]
    sampler, table, submitted = setup(tmp_path, 2, requests, client)
    try:
        table.admit(submitted)
        sampler.submit(submitted)
        assert list(sampler.drain()) == []  # blocks, then yields nothing: the wall clock has passed
        assert sampler.in_flight() == 0
        records = table.ordered_records()
        assert all(r.status == "completed" and r.outputs["generated_tokens"] == 12 for r in records)
        assert len(client.calls) == 12 and {c["n"] for c in client.calls} == {1}  # one request per sample
        assert client.most == 2  # SKYRL_GENERATE_CONCURRENCY_PER_ENGINE x 1 engine
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for call in client.calls:  # in arrival order, which the concurrent senders do not fix
            by_prompt.setdefault(tuple(call["prompt"]), []).append(call["seed"])
        assert len(by_prompt) == 4  # the samples of a request share a prompt; requests do not
        assert all(sorted(seeds) == [3, 4, 5] for seeds in by_prompt.values())  # the seed plus the sample's index
        for record in records:
            assert record.outputs["vllm"]["sent_s"] <= record.outputs["vllm"]["finished_s"] <= record.completed_s
    finally:
        sampler.close()


def test_a_wave_returns_its_results_and_a_failed_sample_fails_only_its_request(tmp_path: Path) -> None:
    client = StandInClient(delay_s=0.01, fail_prompt_len=9)
    requests = [
        {"type": "sample", "prompt_tokens": 8, "max_tokens": 2, "num_samples": 2},
        {"type": "sample", "prompt_tokens": 9, "max_tokens": 2, "num_samples": 2},
    ]
    sampler, table, submitted = setup(tmp_path, 0, requests, client)
    try:
        steps = sampler.wave(submitted)
        with pytest.raises(StopIteration) as done:
            next(steps)
        outcome = done.value.value
        assert set(outcome.outputs) == {1} and set(outcome.failed) == {2}
        assert "sampling failed: the server said no" in outcome.failed[2]
        assert all(r.status == "pending" for r in table.ordered_records())  # the engine writes a wave's results
    finally:
        sampler.close()


def test_another_checkpoint_waits_until_nothing_is_in_flight(tmp_path: Path) -> None:
    client = StandInClient(delay_s=0.05)
    served: list = []
    requests = [
        {"type": "sample", "prompt_tokens": 8, "max_tokens": 2, "num_samples": 2, "checkpoint": "a"},
        {"type": "sample", "prompt_tokens": 8, "max_tokens": 2, "num_samples": 2, "checkpoint": "b"},
    ]
    sampler, table, submitted = setup(tmp_path, 8, requests, client, served)
    try:
        sampler.submit(submitted)
        list(sampler.drain())
        switch = next(i for i, (where, _) in enumerate(served) if where.name == "b")
        assert served[switch][1] == 0  # the server moved to b with nothing in flight on a
        assert all(r.status == "completed" for r in table.ordered_records())
    finally:
        sampler.close()
