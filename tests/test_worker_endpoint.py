"""The endpoint the real backend's workers receive is the endpoint the host ran with.

Each worker validates the endpoint again from the config the host writes (``megatron_vllm.worker.Worker``). A check that
reads what an endpoint states rather than its values (the colocated engines' device count, left at SkyRL's defaults, is
no statement) refused every multi-rank endpoint in its workers when the host wrote every default out: the workers
must get the same statement, and the same values.
"""

from __future__ import annotations

import pytest

from skyrl_sim.commands.catalog import known_endpoints, load_endpoint_file
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim_plugins.megatron_vllm.backend import worker_endpoint


@pytest.mark.parametrize("name", sorted(known_endpoints()))
def test_every_shipped_endpoint_reaches_the_workers_unchanged(name: str) -> None:
    endpoint, _ = load_endpoint_file(name)
    again = Endpoint.model_validate(worker_endpoint(endpoint))
    assert again == endpoint
    assert again.model_fields_set == endpoint.model_fields_set


def test_a_multi_rank_endpoint_with_default_engines_is_accepted_by_its_workers() -> None:
    endpoint, _ = load_endpoint_file("tiny-cpu-tp2")
    assert endpoint.hardware.devices == 2 and endpoint.placement.colocate_all
    assert "num_engines" not in endpoint.inference.model_fields_set  # SkyRL's default: no statement
    Endpoint.model_validate(worker_endpoint(endpoint))  # refused when every default was written out
    with pytest.raises(ValueError, match="num_rollout_gpus"):
        Endpoint.model_validate(endpoint.model_dump(mode="json"))  # the statement a full dump makes
