"""Compare the simulator's vLLM start terms with what vLLM logged about its own memory in public reports.

    python scripts/vllm_public_logs.py            # -> validation/vllm-public-logs/summary.md (and prints it)

``validation/vllm-public-logs/rows.yaml`` holds one public log a row (its address, model, card, vLLM version,
settings and the values vLLM printed). For each row an endpoint with the row's settings is built and the simulator's
value of the same term is computed by the functions the start model uses (``vllm_budget``: ``cuda_graph_bytes``,
``forward_peak_bytes``, ``weights_bytes``); the ratio model / measured is held to the band of the term's kind
(``tolerances`` in the file; ``tests/test_vllm_public_logs.py``). The memory a vLLM process holds outside PyTorch
(``non_torch``) has no term in the model: its rows say how much that leaves out. What the device holds at the
worker's start snapshot (``context``) is an input (``hardware.reserve_gib``): its rows show the card profile's default
beside vLLM's own.

The end result of that path, the KV cache vLLM sized (``kv_rows`` in the file: "Available KV cache memory",
"GPU KV cache size: N tokens", "# GPU blocks", and whether the start was refused), is compared with what the
simulator's start computes for the row's settings with no block-count or KV-size override: ``vllm_start`` (the
function ``check``'s sampler and colocation call), from ``gpu_memory_utilization x`` the card's memory through the
weights, the profile run and the graphs' estimate to the blocks. Those rows are held to the ``kv`` band, or carry a
``known_miss`` with its reason.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from skyrl_sim.schema.architecture import resolve_model
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.units import GIB
from skyrl_sim_plugins.sim.service.inference import vllm_budget as budget
from skyrl_sim_plugins.sim.service.inference.kv_cache import layout
from skyrl_sim_plugins.sim.service.inference.vllm_startup import VllmStart, vllm_start

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "validation" / "vllm-public-logs" / "rows.yaml"
SUMMARY = ROWS.with_name("summary.md")
KIND_TERMS = {
    "graph_pool": "CUDA graphs (capture, measured)",
    "graph_estimate": "CUDA graphs (vLLM's estimate)",
    "activation": "profile-run activation peak",
    "weights": "weights",
    "non_torch": "memory outside PyTorch gained while profiling",
    "context": "memory on the device at the start snapshot",
}
NO_BAND = {"non_torch": "not modelled", "context": "an input (profile default)"}
KV_TERMS = {
    "kv_gib": "KV cache (GiB)",
    "kv_tokens": "KV cache (tokens)",
    "kv_blocks": "KV cache (blocks)",
}


@dataclass(frozen=True)
class Comparison:
    """One measured value of one row beside the model's value for the same term."""

    row: str
    url: str
    model: str
    card: str
    version: str
    kind: str
    measured_gib: float
    model_gib: float
    low: float | None
    high: float | None

    @property
    def ratio(self) -> float:
        return self.model_gib / self.measured_gib

    @property
    def within(self) -> bool | None:
        """Whether model / measured lies in the kind's band; None where the kind has no band (not modelled)."""
        if self.low is None or self.high is None:
            return None
        return self.low <= self.ratio <= self.high


def row_endpoint(row: dict[str, Any], models: dict[str, Any]) -> Endpoint:
    """The row's setup as an endpoint: its model, the card's memory, TP, and the engine settings that give the
    capture sizes and batched tokens its log shows."""
    engine = row["engine"]
    inference = {
        "tensor_parallel_size": int(engine["tp"]),
        "max_num_seqs": engine["max_num_seqs"],
        "max_num_batched_tokens": engine["max_num_batched_tokens"],
    }
    return logged_endpoint(row, models, inference)


def logged_endpoint(row: dict[str, Any], models: dict[str, Any], inference: dict[str, Any]) -> Endpoint:
    """One logged setup as an endpoint: the row's model on ``engine.tp`` cards of the logged memory, TP over all of
    them, and the ``inference`` section the caller built from what the row's log depends on."""
    tp = int(row["engine"]["tp"])
    return Endpoint.model_validate(
        {
            "name": row["id"],
            "model": models[row["model"]],
            "hardware": {
                "profile": row.get("profile", "h100"),
                "devices": tp,
                "device_memory_gib": row["device_memory_gib"],
            },
            "parallelism": {"tp": tp},
            "inference": inference,
        }
    )


def model_value(kind: str, endpoint: Endpoint) -> int:
    """The simulator's bytes for one kind of logged value on this endpoint."""
    model = resolve_model(endpoint.model, ROOT)
    if kind in ("graph_pool", "graph_estimate"):
        return budget.cuda_graph_bytes(endpoint, model)
    if kind == "activation":
        return budget.forward_peak_bytes(endpoint, model, endpoint.inference.max_num_batched_tokens)
    if kind == "weights":
        return budget.weights_bytes(endpoint, model)
    if kind == "non_torch":
        return 0
    if kind == "context":
        return int(endpoint.hardware.reserve_gib * GIB)
    raise ValueError(f"{ROWS}: unknown kind '{kind}'")


def comparisons(path: Path = ROWS) -> list[Comparison]:
    """Every measured value in the file beside the model's."""
    data = yaml.safe_load(path.read_text())
    bands = data["tolerances"]
    out = []
    for row in data["rows"]:
        endpoint = row_endpoint(row, data["models"])
        for kind, measured in row["measured"].items():
            band = bands.get(kind) or {}
            out.append(
                Comparison(
                    row=row["id"],
                    url=row["url"],
                    model=row["model"],
                    card=row["card"],
                    version=row["version"],
                    kind=kind,
                    measured_gib=float(measured),
                    model_gib=model_value(kind, endpoint) / GIB,
                    low=band.get("low"),
                    high=band.get("high"),
                )
            )
    return out


@dataclass(frozen=True)
class KvComparison:
    """One KV-cache size vLLM logged at its start beside the size the simulator's start computes for the same
    settings (``vllm_start``, no override), and whether each refused to start."""

    row: str
    url: str
    model: str
    card: str
    version: str
    rules: str
    utilization: float
    max_model_len: int
    max_num_seqs: int
    kind: str
    measured: float
    model_value: float
    refused: bool  # vLLM refused to start (the log's error)
    model_refused: bool  # the simulator's start refuses too
    low: float
    high: float
    known_miss: str | None

    @property
    def ratio(self) -> float:
        return self.model_value / self.measured

    @property
    def within(self) -> bool:
        """Whether model / logged lies in the ``kv`` band and both starts agree on refusing."""
        return self.low <= self.ratio <= self.high and self.refused == self.model_refused


def kv_row_endpoint(row: dict[str, Any], models: dict[str, Any]) -> Endpoint:
    """A KV row's setup as an endpoint: the card's memory, TP, and every setting its KV size depends on (the
    utilization, the context, the batch limits, the vLLM version whose rules apply), and no KV override."""
    engine = row["engine"]
    tp = int(engine["tp"])
    inference = {
        "tensor_parallel_size": tp,
        "gpu_memory_utilization": engine["gpu_memory_utilization"],
        "max_model_len": engine["max_model_len"],
        "max_num_seqs": engine["max_num_seqs"],
        "max_num_batched_tokens": engine["max_num_batched_tokens"],
        "vllm_version": row["rules"],
    }
    for key in ("enforce_eager", "enable_chunked_prefill", "quantization"):
        if key in engine:
            inference[key] = engine[key]
    return logged_endpoint(row, models, inference)


def kv_start(endpoint: Endpoint) -> VllmStart:
    """The simulator's vLLM start for the endpoint, as ``check`` computes it (``vllm_start`` on the card's memory)."""
    return vllm_start(endpoint, resolve_model(endpoint.model, ROOT))


def kv_model_value(kind: str, endpoint: Endpoint, start: VllmStart) -> float:
    """The simulator's value of one logged KV quantity. A refused start has no cache: its blocks are those the
    profiled bytes would have held (what vLLM's refusal names, ``available_bytes`` of the refusal)."""
    model = resolve_model(endpoint.model, ROOT)
    if start.kv is not None:
        assert start.kv.source == "profiled", f"{ROWS}: {endpoint.name} sized its KV cache from an override"
        kv_bytes, blocks, block = start.kv.kv_cache_bytes, start.kv.num_blocks, start.kv.block_size
        groups = start.kv.layer_groups
    else:
        assert start.refusal is not None
        cache = layout(endpoint, model)
        kv_bytes = start.refusal.available_bytes
        blocks, block = kv_bytes // cache.bytes_per_block, cache.block_size
        groups = len(cache.groups) if cache.has_mamba else 0
    if kind == "kv_gib":
        return kv_bytes / GIB
    if kind == "kv_blocks":
        return float(blocks)
    if kind == "kv_tokens":
        if groups:
            raise ValueError(f"{ROWS}: {endpoint.name}: kv_tokens of a hybrid cache is not compared")
        # kv_cache_utils.py: get_kv_cache_capacity, int(num_blocks / blocks per max_model_len request x max_model_len)
        context = endpoint.inference.max_model_len
        assert context is not None
        return float(int(blocks / -(-context // block) * context))
    raise ValueError(f"{ROWS}: unknown KV kind '{kind}'")


def kv_comparisons(path: Path = ROWS) -> list[KvComparison]:
    """Every logged KV size in the file beside the simulator's start for the same settings."""
    data = yaml.safe_load(path.read_text())
    band = data["tolerances"]["kv"]
    out = []
    for row in data.get("kv_rows", []):
        endpoint = kv_row_endpoint(row, data["models"])
        start = kv_start(endpoint)
        engine = row["engine"]
        for kind, measured in row["measured"].items():
            out.append(
                KvComparison(
                    row=row["id"],
                    url=row["url"],
                    model=row["model"],
                    card=row["card"],
                    version=row["version"],
                    rules=row["rules"],
                    utilization=float(engine["gpu_memory_utilization"]),
                    max_model_len=int(engine["max_model_len"]),
                    max_num_seqs=int(engine["max_num_seqs"]),
                    kind=kind,
                    measured=float(measured),
                    model_value=kv_model_value(kind, endpoint, start),
                    refused=bool(row.get("refused", False)),
                    model_refused=start.refusal is not None,
                    low=float(band["low"]),
                    high=float(band["high"]),
                    known_miss=row.get("known_miss"),
                )
            )
    return out


def kv_table_lines(rows: list[KvComparison]) -> list[str]:
    """The KV comparison as a Markdown table (the accuracy page quotes these lines)."""
    lines = [
        "| source | model | card | vLLM (rules) | util | max_model_len | max_num_seqs | term | vLLM logged | model | "
        "model / logged | started (vLLM / model) | verdict |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for c in rows:
        fmt = "{:.2f}" if c.kind == "kv_gib" else "{:,.0f}"
        started = f"{'refused' if c.refused else 'yes'} / {'refused' if c.model_refused else 'yes'}"
        verdict = f"in {c.low}-{c.high}" if c.within else ("known miss" if c.known_miss else "OUTSIDE")
        source = c.url.removeprefix("https://github.com/")
        lines.append(
            f"| [{source}]({c.url}) | {c.model} | {c.card} | {c.version} ({c.rules}) | {c.utilization} | "
            f"{c.max_model_len:,} | {c.max_num_seqs} | {KV_TERMS[c.kind]} | {fmt.format(c.measured)} | "
            f"{fmt.format(c.model_value)} | {c.ratio:.3f} | {started} | {verdict} |"
        )
    return lines


def table_lines(rows: list[Comparison]) -> list[str]:
    """The comparison as a Markdown table (the accuracy page quotes these lines)."""
    lines = [
        "| source | model | card | vLLM | term | vLLM logged (GiB) | model (GiB) | model / logged | band |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for c in rows:
        band = f"{c.low}-{c.high}" if c.within is not None else NO_BAND[c.kind]
        source = c.url.removeprefix("https://github.com/")
        lines.append(
            f"| [{source}]({c.url}) | {c.model} | {c.card} | {c.version} | {KIND_TERMS[c.kind]} | "
            f"{c.measured_gib:.2f} | {c.model_gib:.2f} | {c.ratio:.2f} | {band} |"
        )
    return lines


def main() -> int:
    rows = comparisons()
    kv_rows = kv_comparisons()
    text = "\n".join(
        [
            "# vLLM's own memory lines in public logs, beside the simulator",
            "",
            "Generated by `scripts/vllm_public_logs.py` from `rows.yaml` (the settings, assumptions and quoted lines).",
            "",
            *table_lines(rows),
            "",
            "## The KV cache vLLM sized, beside the simulator's start with no override",
            "",
            *kv_table_lines(kv_rows),
            "",
        ]
    )
    SUMMARY.write_text(text)
    sys.stdout.write(text)
    outside = [c for c in rows if c.within is False] + [c for c in kv_rows if not c.within and not c.known_miss]
    return 1 if outside else 0


if __name__ == "__main__":
    raise SystemExit(main())
