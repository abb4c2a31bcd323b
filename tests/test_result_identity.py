"""The simulator's results stay byte-identical through speed work.

``fixtures/run_multi_tenant_5000.json.xz`` is the RunResult JSON of the seeded 5,000-request multi-tenant workload
(``skyrl_sim.traffic.synthetic``), written by the simulator before its per-call costs were memoised (main at b17158d). The
run today must write the same bytes. ``fixtures/run_multi_tenant_training_5000.json.xz`` is the same workload without
its samples (training only), written before samples were served by the vLLM model: no change to sampling may move it.
Regenerate a fixture only when a model change is meant to move its results: ``python scripts/regen_identity_fixture.py``.
"""

from __future__ import annotations

import lzma
from pathlib import Path

import orjson
import pytest
import yaml

from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.traffic.synthetic import VARIANT, multi_tenant_document

FIXTURE = Path(__file__).parent / "fixtures" / "run_multi_tenant_5000.json.xz"
TRAINING_FIXTURE = Path(__file__).parent / "fixtures" / "run_multi_tenant_training_5000.json.xz"


def first_difference(a: object, b: object, path: str = "") -> str:
    """The first path where two JSON values differ (for a readable failure)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b:
                return f"{path}.{key}: only on one side"
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return ""
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return f"{path}: lengths {len(a)} != {len(b)}" if len(a) != len(b) else ""
    return "" if a == b else f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize(
    ("fixture", "samples"), [(FIXTURE, True), (TRAINING_FIXTURE, False)], ids=["with-samples", "training-only"]
)
def test_5k_request_run_is_byte_identical_to_the_fixture(tmp_path: Path, fixture: Path, samples: bool) -> None:
    """The training-only fixture was written before samples were served by the vLLM model, and must never move
    with a change to sampling; the one with samples moves only with a change meant to move sample results."""
    path = tmp_path / "multi_tenant.yaml"
    path.write_text(yaml.safe_dump(multi_tenant_document(5000, samples=samples), sort_keys=False))
    result = PluginHost().run(load_scenario(path).resolve(VARIANT), "sim")
    result.versions = {}  # the software stamp says where a run was made, not what it found
    expected = lzma.decompress(fixture.read_bytes())
    got = result.to_json()
    if got != expected:
        pytest.fail("RunResult differs: " + first_difference(orjson.loads(expected), orjson.loads(got)))
    result.write(tmp_path / "streamed.json")  # the streamed writer gives the same bytes
    assert (tmp_path / "streamed.json").read_bytes() == expected
