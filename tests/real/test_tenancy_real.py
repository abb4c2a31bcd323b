"""Many tenants on one base model on the real backend (megatron-core workers under torchrun, CPU).

The multi-tenant scenario's tenants run together (their calls interleaved: the live adapter swapped before every
call of another tenant, a tenant's gradients kept in its slot across the others' calls until its optim_step), then
each alone on a fresh runtime. Every request of a tenant must give the same per-token losses both ways: nothing of
one tenant reaches another. And the device holds one base: the first call's peak is the same with three tenants as
with one, while the host slots grow with the tenants.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from project_paths import SCENARIOS
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.scenario import load_scenario

pytestmark = pytest.mark.real

SCENARIO = SCENARIOS / "multi_tenant_tiny.yaml"
TENANTS = ("policy-a", "policy-b", "sft-c")
VARIANT = "cap-aware"  # one request per call: a tenant's calls are the same alone and together


def alone_scenario(tmp_path: Path, model_id: str) -> Path:
    """The scenario with only ``model_id``'s client (and only its model loaded)."""
    data = yaml.safe_load(SCENARIO.read_text())
    data["workload"]["clients"] = [c for c in data["workload"]["clients"] if c["model_id"] == model_id]
    data["workload"]["loaded_models"] = [model_id]
    data["variants"] = {VARIANT: {"set": data["variants"][VARIANT]["set"]}}
    path = tmp_path / f"alone-{model_id}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    (tmp_path / "endpoints").mkdir(exist_ok=True)
    endpoint = data["endpoint"]
    (tmp_path / "endpoints" / f"{endpoint}.yaml").write_text((SCENARIOS / "endpoints" / f"{endpoint}.yaml").read_text())
    return path


def losses(result: RunResult, model_id: str) -> list[tuple[str, list[list[float]]]]:
    """Each pass request of the tenant in order: its type and per-datum per-token losses."""
    return [
        (r.type, r.outputs["elementwise_loss"])
        for r in result.requests
        if r.model_id == model_id and r.type in ("forward_backward", "forward")
    ]


@pytest.fixture(scope="module")
def runs(host, tmp_path_factory) -> tuple[RunResult, dict[str, RunResult]]:
    tmp = tmp_path_factory.mktemp("tenants")
    together = host.run(load_scenario(SCENARIO).resolve(VARIANT), "megatron")
    alone = {m: host.run(load_scenario(alone_scenario(tmp, m)).resolve(VARIANT), "megatron") for m in TENANTS}
    return together, alone


def test_each_tenants_losses_equal_that_tenant_run_alone(runs):
    together, alone = runs
    swapped = [c for c in together.calls if c.extra.get("swap")]
    assert len(swapped) == 10  # the tenants' calls did interleave
    for model_id in TENANTS:
        mine, theirs = losses(together, model_id), losses(alone[model_id], model_id)
        assert len(mine) == len(theirs) >= 2
        for (kind, got), (_, want) in zip(mine, theirs, strict=True):
            assert [len(d) for d in got] == [len(d) for d in want]
            for datum_got, datum_want in zip(got, want, strict=True):
                assert datum_got == pytest.approx(datum_want, rel=1e-6, abs=1e-7), f"{model_id} {kind}"


def test_the_device_holds_one_base_and_the_host_a_slot_per_tenant(runs):
    together, alone = runs
    one = alone["policy-a"]
    assert together.calls[0].peak_bytes == one.calls[0].peak_bytes  # the same call on the same device state
    slot = together.tenancy["slot_bytes"]
    assert slot == one.tenancy["slot_bytes"] > 0
    assert together.tenancy["host_bytes_peak"] == 5 * slot  # three tenants, policy-e while it lived, the pristine
    assert one.tenancy["host_bytes_peak"] == 2 * slot
    refused = next(c for c in together.calls if c.kind == "create_model" and c.error)
    assert refused.error.startswith("LoRA signature mismatch for model 'policy-d': got (rank, alpha)=(16, 32)")
