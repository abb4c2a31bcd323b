"""The vLLM start model against what vLLM logged about its own memory in public reports
(``validation/vllm-public-logs/rows.yaml``, ``scripts/vllm_public_logs.py``).

Each logged value is held to the band of its kind (model / logged, stated in the file): the CUDA-graph estimate must
stay conservative (never under 0.9 of a measured capture) and within 2.5x of a measured one, 4x of vLLM's own estimate;
the forward's activation peak within 25%, the weights within 3%. Memory outside PyTorch (gained while profiling,
or held at the start snapshot: ``hardware.reserve_gib``, an input) is recorded without a band. The committed summary
and the accuracy page quote the table the script renders now.

The end result, the KV cache vLLM sized (``kv_rows``), is compared with the simulator's start for the same settings
with no override: each row within the ``kv`` band and refused exactly where vLLM refused, or marked a known miss
with its reason (and still outside the band: a miss the model has come to reproduce must become a held row).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_public_logs", ROOT / "scripts" / "vllm_public_logs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


SCRIPT = load_script()
COMPARISONS = SCRIPT.comparisons()
KV_COMPARISONS = SCRIPT.kv_comparisons()


@pytest.mark.parametrize("comparison", [c for c in COMPARISONS if c.within is not None],
                         ids=lambda c: f"{c.row}-{c.kind}")
def test_each_logged_value_within_its_band(comparison: object) -> None:
    c = comparison
    assert c.within, f"{c.row} {c.kind}: model {c.model_gib:.3f} GiB / logged {c.measured_gib:.2f} = {c.ratio:.2f}"


def test_every_kind_the_file_names_is_covered() -> None:
    kinds = {c.kind for c in COMPARISONS}
    assert {"graph_pool", "graph_estimate", "activation", "weights", "non_torch", "context"} <= kinds
    assert sum(1 for c in COMPARISONS if c.kind == "graph_pool") >= 3


def test_graph_estimate_grows_with_the_largest_capture_size() -> None:
    """The rule the rows exercise: the pool holds the largest captured batch's activations in every layer, so
    doubling the largest size doubles it (capture sizes from ``cudagraph_capture_sizes``)."""
    data = SCRIPT.yaml.safe_load(SCRIPT.ROWS.read_text())
    row = next(r for r in data["rows"] if r["model"] == "qwen3-0.6b")
    small = SCRIPT.row_endpoint(row, data["models"])
    large = SCRIPT.row_endpoint({**row, "engine": {**row["engine"], "max_num_seqs": 256}}, data["models"])
    assert SCRIPT.model_value("graph_pool", large) == 2 * SCRIPT.model_value("graph_pool", small)


@pytest.mark.parametrize("comparison", KV_COMPARISONS, ids=lambda c: f"{c.row}-{c.kind}")
def test_each_logged_kv_cache_within_its_band_or_a_known_miss(comparison: object) -> None:
    c = comparison
    detail = f"{c.row} {c.kind}: model {c.model_value:,.2f} / logged {c.measured:,.2f} = {c.ratio:.3f}"
    if c.known_miss:
        assert len(c.known_miss) > 40, f"{c.row}: a known miss states its reason"
        assert not c.within, f"{detail}: the known miss is now reproduced; hold it to the band"
    else:
        assert c.refused == c.model_refused, f"{c.row}: vLLM refused={c.refused}, the model refused={c.model_refused}"
        assert c.within, detail


def test_kv_rows_cover_tokens_blocks_bytes_and_a_refusal() -> None:
    kinds = {c.kind for c in KV_COMPARISONS if not c.known_miss}
    assert {"kv_gib", "kv_tokens", "kv_blocks"} <= kinds
    assert any(c.refused and not c.known_miss for c in KV_COMPARISONS)
    assert sum(1 for c in KV_COMPARISONS if not c.known_miss) >= 5


def test_kv_rows_are_sized_by_the_profiled_path_with_no_override() -> None:
    """The value compared is the start ``check`` computes: the profiled budget, never a block count or KV size."""
    data = SCRIPT.yaml.safe_load(SCRIPT.ROWS.read_text())
    for row in data["kv_rows"]:
        endpoint = SCRIPT.kv_row_endpoint(row, data["models"])
        assert endpoint.inference.num_gpu_blocks_override is None
        assert endpoint.inference.kv_cache_memory_bytes is None
        start = SCRIPT.kv_start(endpoint)
        assert (start.kv is not None and start.kv.source == "profiled") or start.refusal is not None, row["id"]


def test_kv_cache_moves_with_the_budget_byte_for_byte() -> None:
    """From ``gpu_memory_utilization`` to the KV bytes: lowering the utilization takes exactly its share of the
    card's memory (``request_memory``: rounded up) out of the cache, and nothing else moves."""
    data = SCRIPT.yaml.safe_load(SCRIPT.ROWS.read_text())
    row = next(r for r in data["kv_rows"] if "kv_tokens" in r["measured"])
    lower = {**row, "engine": {**row["engine"], "gpu_memory_utilization": 0.5}}
    high = SCRIPT.kv_start(SCRIPT.kv_row_endpoint(row, data["models"]))
    low = SCRIPT.kv_start(SCRIPT.kv_row_endpoint(lower, data["models"]))
    assert high.kv is not None and low.kv is not None
    total = int(row["device_memory_gib"] * SCRIPT.GIB)
    share = math.ceil(total * 0.98) - math.ceil(total * 0.5)
    assert high.kv.kv_cache_bytes - low.kv.kv_cache_bytes == share


def test_a_refused_start_reports_the_blocks_its_budget_held() -> None:
    """vLLM's V0 refusal names the tokens its cache held (1,478 blocks of 16: 23,648); the model's refused start
    reports the blocks of its profiled bytes, not zero."""
    refused = [c for c in KV_COMPARISONS if c.refused and c.kind == "kv_blocks"]
    assert refused and all(c.model_refused and c.model_value > 0 for c in refused)


def test_unknown_kv_kind_is_refused(tmp_path: Path) -> None:
    data = SCRIPT.yaml.safe_load(SCRIPT.ROWS.read_text())
    data["kv_rows"][0]["measured"] = {"kv_token": 1}
    path = tmp_path / "rows.yaml"
    path.write_text(SCRIPT.yaml.safe_dump(data))
    with pytest.raises(ValueError, match="unknown KV kind 'kv_token'"):
        SCRIPT.kv_comparisons(path)


def test_summary_and_accuracy_page_quote_the_current_table() -> None:
    lines = SCRIPT.table_lines(COMPARISONS)[2:] + SCRIPT.kv_table_lines(KV_COMPARISONS)
    summary = SCRIPT.SUMMARY.read_text()
    page = (ROOT / "docs" / "accuracy.md").read_text()
    for line in lines:
        assert line in summary, f"validation/vllm-public-logs/summary.md is stale: rerun the script ({line})"
        assert line in page, f"docs/accuracy.md does not quote: {line}"


def test_unknown_kind_is_refused(tmp_path: Path) -> None:
    data = SCRIPT.yaml.safe_load(SCRIPT.ROWS.read_text())
    data["rows"][0]["measured"] = {"graph_pools": 0.2}
    path = tmp_path / "rows.yaml"
    path.write_text(SCRIPT.yaml.safe_dump(data))
    with pytest.raises(ValueError, match="unknown kind 'graph_pools'"):
        SCRIPT.comparisons(path)


def test_context_rows_read_the_endpoint_reserve() -> None:
    """A ``context`` row's model value is the endpoint's ``hardware.reserve_gib`` (the card profile's default here)."""
    data = SCRIPT.yaml.safe_load(SCRIPT.ROWS.read_text())
    row = next(r for r in data["rows"] if "context" in r["measured"])
    endpoint = SCRIPT.row_endpoint(row, data["models"])
    assert SCRIPT.model_value("context", endpoint) == int(endpoint.hardware.reserve_gib * SCRIPT.GIB)
    assert endpoint.hardware.reserve_gib > 0
