"""Rewrite ``tests/fixtures/run_multi_tenant_5000.json.xz`` from the simulator as it is now.

Only for a change that is meant to move results (a memory or time model change); speed work must leave the fixture
alone. Run: ``.venv/bin/python scripts/regen_identity_fixture.py``.
"""

from __future__ import annotations

import lzma
import tempfile
from pathlib import Path

import yaml

from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.traffic.synthetic import VARIANT, multi_tenant_document

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "run_multi_tenant_5000.json.xz"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "multi_tenant.yaml"
        path.write_text(yaml.safe_dump(multi_tenant_document(5000), sort_keys=False))
        result = PluginHost().run(load_scenario(path).resolve(VARIANT), "sim")
        result.versions = {}  # the software stamp is not a result (tests/test_result_identity.py drops it too)
        data = result.to_json()
    FIXTURE.write_bytes(lzma.compress(data, preset=9))
    print(f"wrote {FIXTURE} ({len(data)} bytes of JSON)")


if __name__ == "__main__":
    main()
