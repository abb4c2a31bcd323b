"""Rewrite the result-identity fixtures from the simulator as it is now.

- ``tests/fixtures/run_multi_tenant_5000.json.xz``: the seeded 5,000-request multi-tenant workload (training steps,
  sampler saves and samples);
- ``tests/fixtures/run_multi_tenant_training_5000.json.xz``: the same workload without its samples (training only).

Only for a change that is meant to move results (a memory or time model change); speed work must leave the fixtures
alone, and a change to how samples are served must leave the training-only one alone. Run:
``.venv/bin/python scripts/regen_identity_fixture.py [--training-only | --with-samples]`` (default: both).
"""

from __future__ import annotations

import argparse
import lzma
import tempfile
from pathlib import Path

import yaml

from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.traffic.synthetic import VARIANT, multi_tenant_document

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
FIXTURE = FIXTURES / "run_multi_tenant_5000.json.xz"
TRAINING_FIXTURE = FIXTURES / "run_multi_tenant_training_5000.json.xz"


def write(path: Path, samples: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        scenario = Path(tmp) / "multi_tenant.yaml"
        scenario.write_text(yaml.safe_dump(multi_tenant_document(5000, samples=samples), sort_keys=False))
        result = PluginHost().run(load_scenario(scenario).resolve(VARIANT), "sim")
        result.versions = {}  # the software stamp is not a result (tests/test_result_identity.py drops it too)
        data = result.to_json()
    path.write_bytes(lzma.compress(data, preset=9))
    print(f"wrote {path} ({len(data)} bytes of JSON)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--training-only", action="store_true", help="only the training-only fixture")
    which.add_argument("--with-samples", action="store_true", help="only the fixture with samples")
    args = parser.parse_args()
    if not args.training_only:
        write(FIXTURE, samples=True)
    if not args.with_samples:
        write(TRAINING_FIXTURE, samples=False)


if __name__ == "__main__":
    main()
