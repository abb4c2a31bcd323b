"""The vLLM start model against what vLLM logged about its own memory in public reports
(``validation/vllm-public-logs/rows.yaml``, ``scripts/vllm_public_logs.py``).

Each logged value is held to the band of its kind (model / logged, stated in the file): the CUDA-graph estimate must
stay conservative (never under 0.9 of a measured capture) and within 2.5x of a measured one, 4x of vLLM's own estimate;
the forward's activation peak within 25%, the weights within 3%. Memory outside PyTorch (gained while profiling,
or held at the start snapshot: ``hardware.reserve_gib``, an input) is recorded without a band. The committed summary
and the accuracy page quote the table the script renders now.
"""

from __future__ import annotations

import importlib.util
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


def test_summary_and_accuracy_page_quote_the_current_table() -> None:
    lines = SCRIPT.table_lines(COMPARISONS)
    summary = SCRIPT.SUMMARY.read_text()
    page = (ROOT / "docs" / "accuracy.md").read_text()
    for line in lines[2:]:
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
