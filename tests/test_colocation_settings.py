"""The endpoint's colocation settings under SkyRL's key names, and the errors bad values give."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from skyrl_sim.commands.from_skyrl import MAPPED
from skyrl_sim.schema.endpoint import Endpoint


def endpoint(**sections: Any) -> Endpoint:
    body: dict[str, Any] = {"name": "colocated", "model": "qwen3-8b", "hardware": {"devices": 1}}
    body.update(sections)
    return Endpoint.model_validate(body)


def test_defaults_are_skyrls() -> None:
    e = endpoint()
    assert e.placement.colocate_all and e.lora.merge_lora  # PlacementConfig, MegatronLoraConfig defaults
    assert e.inference.offload_kv_for_weight_sync is False and e.inference.sleep_level is None
    assert e.inference.weight_transfer_threshold_cuda_ipc_GB == 1.0
    assert e.lora_weight_sync is False  # Megatron merges: vLLM receives full weights
    assert endpoint(lora={"merge_lora": False}).lora_weight_sync
    assert endpoint(trainer={"strategy": "fsdp"}).lora_weight_sync  # FSDP always syncs adapters


@pytest.mark.parametrize(
    ("sections", "key"),
    [
        ({"inference": {"sleep_level": 3}}, "inference.sleep_level"),
        ({"inference": {"offload_kv_for_weight_sync": "yes"}}, "inference.offload_kv_for_weight_sync"),
        ({"inference": {"weight_transfer_threshold_cuda_ipc_GB": -1}}, "inference.weight_transfer_threshold_cuda_ipc_GB"),
        ({"lora": {"merge_lora": 1}}, "lora.merge_lora"),
        ({"placement": {"colocate_all": "no"}}, "placement.colocate_all"),
    ],
)
def test_bad_values_name_the_key(sections: dict[str, Any], key: str) -> None:
    with pytest.raises(ValidationError) as info:
        endpoint(**sections)
    assert key.split(".")[-1] in str(info.value)


def test_vllm_serves_lora_only_when_the_trainer_syncs_adapters() -> None:
    with pytest.raises(ValidationError, match="merge_lora false"):
        endpoint(inference={"enable_lora": True})
    assert endpoint(inference={"enable_lora": True}, lora={"merge_lora": False}).inference.enable_lora


def test_skyrl_keys_map_to_the_endpoint() -> None:
    assert MAPPED["trainer.policy.megatron_config.lora_config.merge_lora"][0] == "lora.merge_lora"
    assert MAPPED["generator.inference_engine.offload_kv_for_weight_sync"][0] == "inference.offload_kv_for_weight_sync"
