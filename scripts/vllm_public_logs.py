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
    tp = int(engine["tp"])
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
            "inference": {
                "tensor_parallel_size": tp,
                "max_num_seqs": engine["max_num_seqs"],
                "max_num_batched_tokens": engine["max_num_batched_tokens"],
            },
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
    text = "\n".join(
        [
            "# vLLM's own memory lines in public logs, beside the simulator",
            "",
            "Generated by `scripts/vllm_public_logs.py` from `rows.yaml` (the settings, assumptions and quoted lines).",
            "",
            *table_lines(rows),
            "",
        ]
    )
    SUMMARY.write_text(text)
    sys.stdout.write(text)
    outside = [c for c in rows if c.within is False]
    return 1 if outside else 0


if __name__ == "__main__":
    raise SystemExit(main())
