"""Fuzz the scenario and endpoint loader: 2,000 hostile documents, no traceback, no hang, no silent acceptance.

Each example takes a valid scenario (with an inline endpoint), replaces a few values at known and unknown key paths
with hostile ones (non-finite and huge numbers, booleans where integers go, strings, deep lists, nulls), and loads it.
The loader must either accept it, and then every number it kept is finite and within the limits, or refuse it with a
``UserError`` (exit 2). Only the loader runs: no simulation.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skyrl_sim.errors import UserError
from skyrl_sim.schema.limits import MAX_DEVICE_MEMORY_GIB, MAX_TIME_S, MAX_TOKENS
from skyrl_sim.schema.scenario import load_scenario

BASE: dict[str, Any] = {
    "name": "fuzz",
    "endpoint": {
        "model": {"preset": "tiny-dense", "num_layers": 2},
        "hardware": {"profile": "cpu", "devices": 1, "device_memory_gib": 8, "reserve_gib": 0.5},
        "parallelism": {"tp": 1},
        "trainer": {"micro_train_batch_size_per_gpu": 2, "max_tokens_per_microbatch": -1},
        "engine": {"forward_backward_max_request_count": 4, "iteration_sleep_s": 0.1, "poll_interval_s": 0.05},
        "lora": {"rank": 8, "alpha": 16},
    },
    "workload": {
        "result_timeout_s": 60,
        "clients": [
            {
                "name": "c",
                "start_s": 0.0,
                "blocker": {"tokens": 100, "lead_s": 0.5},
                "submit": {"mode": "back_to_back", "gap_s": 0.01, "warmup": 0},
                "requests": [
                    {"type": "forward_backward", "lengths": [10, 20], "count": 1},
                    {"type": "save_weights", "checkpoint": "a"},
                    {"type": "load_weights", "checkpoint": "a"},
                    {"type": "sample", "prompt_tokens": 4, "max_tokens": 4, "num_samples": 1},
                ],
            }
        ],
    },
    "variants": {"v": {"set": {"engine.cap_aware_padding": True}, "expect": {"completed": 2, "calls": 1}}},
}

PATHS = [
    ("name",),
    ("endpoint",),
    ("endpoint", "model"),
    ("endpoint", "model", "num_layers"),
    ("endpoint", "model", "hidden_size"),
    ("endpoint", "model", "num_kv_heads"),
    ("endpoint", "model", "tied_embeddings"),
    ("endpoint", "model", "layer_types"),
    ("endpoint", "model", "moe"),
    ("endpoint", "hardware", "devices"),
    ("endpoint", "hardware", "device_memory_gib"),
    ("endpoint", "hardware", "reserve_gib"),
    ("endpoint", "hardware", "profile"),
    ("endpoint", "parallelism", "tp"),
    ("endpoint", "trainer", "micro_train_batch_size_per_gpu"),
    ("endpoint", "trainer", "max_tokens_per_microbatch"),
    ("endpoint", "engine", "forward_backward_max_request_count"),
    ("endpoint", "engine", "iteration_sleep_s"),
    ("endpoint", "engine", "poll_interval_s"),
    ("endpoint", "lora", "rank"),
    ("endpoint", "lora", "alpha"),
    ("endpoint", "extra_key"),
    ("workload", "result_timeout_s"),
    ("workload", "clients"),
    ("workload", "clients", 0, "start_s"),
    ("workload", "clients", 0, "blocker", "tokens"),
    ("workload", "clients", 0, "blocker", "lead_s"),
    ("workload", "clients", 0, "submit", "gap_s"),
    ("workload", "clients", 0, "submit", "mode"),
    ("workload", "clients", 0, "submit", "times_s"),
    ("workload", "clients", 0, "submit", "warmup"),
    ("workload", "clients", 0, "requests"),
    ("workload", "clients", 0, "requests", 0, "lengths"),
    ("workload", "clients", 0, "requests", 0, "count"),
    ("workload", "clients", 0, "requests", 2, "checkpoint"),
    ("workload", "clients", 0, "requests", 3, "max_tokens"),
    ("workload", "clients", 0, "requests", 3, "num_samples"),
    ("variants",),
    ("variants", "v", "set"),
    ("variants", "v", "expect", "completed"),
    ("variants", "v", "expect", "makespan_s"),
    ("variants", "v", "expect", "request_metrics"),
]

SCALARS = st.one_of(
    st.sampled_from([math.inf, -math.inf, math.nan, 1e300, -1e300, 2**62, 2**64, -1, 0, 0.0, True, False, None]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6) | st.integers(0, 5), children, max_size=3)
    ),
    max_leaves=8,
)


def _has(node: Any, part: Any) -> bool:
    if isinstance(node, dict):
        return part in node
    return isinstance(node, list) and isinstance(part, int) and part < len(node)


def _put(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = doc
    for part in path[:-1]:
        if not _has(node, part):
            return
        node = node[part]
    if isinstance(node, dict) or _has(node, path[-1]):
        node[path[-1]] = value


def _numbers(value: Any) -> list[float]:
    """Every number in a plain (model_dump) structure."""
    out: list[float] = []
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            out.append(node)
    return out


@pytest.fixture(scope="module")
def fuzz_file(tmp_path_factory) -> Path:
    """One file every example overwrites (a fresh directory per example costs more than the load)."""
    return Path(tmp_path_factory.mktemp("fuzz")) / "s.yaml"


def test_the_base_document_loads(fuzz_file):
    fuzz_file.write_text(yaml.safe_dump(BASE))
    assert load_scenario(fuzz_file).resolve("v").request_count() == 6


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(edits=st.lists(st.tuples(st.sampled_from(PATHS), VALUES), min_size=1, max_size=3))
def test_loader_never_crashes_hangs_or_accepts_nonsense(fuzz_file, edits):
    doc = copy.deepcopy(BASE)
    for path, value in edits:
        _put(doc, path, value)
    try:
        text = yaml.safe_dump(doc, allow_unicode=True)
    except yaml.YAMLError:
        return
    path = fuzz_file
    path.write_text(text, encoding="utf-8")
    try:
        scenario = load_scenario(path)
    except UserError:
        return
    for name in scenario.variant_names:
        variant = scenario.resolve(name)
        numbers = _numbers(variant.endpoint.model_dump()) + _numbers(variant.workload.model_dump())
        assert all(math.isfinite(n) for n in numbers)
        hardware = variant.endpoint.hardware
        assert 0 <= hardware.reserve_gib < hardware.device_memory_gib <= MAX_DEVICE_MEMORY_GIB
        assert variant.endpoint.engine.iteration_sleep_s > 0 and variant.endpoint.engine.poll_interval_s > 0
        assert variant.workload.result_timeout_s <= MAX_TIME_S
        for client in variant.workload.clients:
            assert client.requests and client.start_s <= MAX_TIME_S and client.submit.gap_s <= MAX_TIME_S
            for spec in client.requests:
                assert all(0 < n <= MAX_TOKENS for n in (spec.lengths or spec.datums or [1]))
        assert variant.model.num_attention_heads % variant.endpoint.parallelism.tp == 0
