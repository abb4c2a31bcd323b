"""``skyrl-sim endpoints from-skyrl`` on the backend configs of SkyRL's own launch scripts and docs.

``tests/data/skyrl_launches/launches.json`` holds each launch as its script or doc passes it to SkyRL's API server
(NovaSky-AI/SkyRL main a9564572e: ``examples/tinker/*/run_tinker_server.sh``, ``tests/train/gpu_e2e_test/*.sh``, the
Tinker docs' multi-tenancy and cookbook pages, the multi-LoRA Megatron test), beside the base models' config.json
sizes. Every launch must give a valid endpoint, and every key of its backend config must be reported: mapped (its
value in the endpoint) or not mapped, with a reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from skyrl_sim.cli import main
from skyrl_sim.commands.advise_space import dotted_get
from skyrl_sim.commands.from_skyrl import MAPPED, convert, validated
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.scenario import load_scenario

DATA = Path(__file__).parent / "data" / "skyrl_launches"
LAUNCHES: list[dict[str, Any]] = json.loads((DATA / "launches.json").read_text())["launches"]


def run(launch: dict[str, Any]) -> Any:
    model = str(DATA / launch["base_model"] / "config.json")
    return convert(model, launch["backend"], launch["backend_config"], launch.get("gpus"))


@pytest.mark.parametrize("launch", LAUNCHES, ids=[launch["source"] for launch in LAUNCHES])
def test_every_launch_gives_an_endpoint_and_every_key_is_reported(launch: dict[str, Any]) -> None:
    conversion = run(launch)
    endpoint = validated(conversion)
    reported = [key for key, *_ in conversion.mapped] + [key for key, *_ in conversion.unmapped]
    assert sorted(reported) == sorted(launch["backend_config"])  # each key once: none dropped, none invented
    assert all(reason for *_, reason in conversion.unmapped)
    for key, _value, target, converted in conversion.mapped:
        if key in MAPPED:
            assert dotted_get(conversion.endpoint, target) == converted, key
    config = launch["backend_config"]
    per_node = config.get("trainer.placement.policy_num_gpus_per_node")
    devices = per_node * config.get("trainer.placement.policy_num_nodes", 1) if per_node else launch["gpus"]
    assert endpoint.hardware.devices == devices
    p = endpoint.parallelism
    assert p.tp * p.pp * p.cp * p.dp == devices and p.sequence_parallel == (p.tp > 1)
    assert endpoint.trainer.strategy == launch["backend"]
    micro = config.get("trainer.micro_train_batch_size_per_gpu", 1)  # SkyRL's default when the launch leaves it
    assert endpoint.trainer.micro_train_batch_size_per_gpu == micro
    assert endpoint.trainer.remove_microbatch_padding == config.get("trainer.remove_microbatch_padding", True)
    assert endpoint.skyrl_version == "0.4.0" and endpoint.lora.alpha == 32


def test_unmapped_keys_say_why_and_an_unknown_key_is_reported_as_unknown() -> None:
    launch = dict(LAUNCHES[-1])
    extra = {"trainer.placement.colocate_policy_ref": True, "trainer.typo_key": 3}
    launch["backend_config"] = {**launch["backend_config"], **extra}
    unmapped = {key: reason for key, _, reason in run(launch).unmapped}
    assert "reference model" in unmapped["trainer.placement.colocate_policy_ref"]
    assert "typo" in unmapped["trainer.typo_key"]


def test_placement_and_the_vllm_settings_map_to_their_sections() -> None:
    launch = dict(LAUNCHES[-1])
    extra = {
        "trainer.placement.colocate_all": False,
        "generator.inference_engine.num_engines": 2,
        "generator.inference_engine.gpu_memory_utilization": 0.6,
        "generator.inference_engine.max_num_seqs": 256,
        "trainer.policy.model.lora.max_loras": 4,
        "generator.inference_engine.weight_sync_backend": "nccl",
    }
    launch["backend_config"] = {**launch["backend_config"], **extra}
    conversion = run(launch)
    endpoint = validated(conversion)
    assert endpoint.placement.colocate_all is False
    inference = endpoint.inference
    assert (inference.num_engines, inference.gpu_memory_utilization, inference.max_num_seqs) == (2, 0.6, 256)
    assert inference.max_loras == 4
    unmapped = {key for key, _, _ in conversion.unmapped}
    assert "generator.inference_engine.weight_sync_backend" in unmapped


def test_the_vllm_lora_slot_and_vision_settings_map_to_the_inference_section() -> None:
    """SkyRL's ``generator.inference_engine.fully_sharded_loras`` and ``language_model_only`` (InferenceEngineConfig
    fields of the same names) are the endpoint's ``inference`` keys, not unmapped settings."""
    launch = dict(LAUNCHES[-1])
    extra = {
        "generator.inference_engine.fully_sharded_loras": True,
        "generator.inference_engine.language_model_only": True,
    }
    launch["backend_config"] = {**launch["backend_config"], **extra}
    conversion = run(launch)
    inference = validated(conversion).inference
    assert inference.fully_sharded_loras is True and inference.language_model_only is True
    assert not {key for key, _, _ in conversion.unmapped} & set(extra)


def test_vllms_quantization_passed_through_engine_init_kwargs_is_the_inference_key() -> None:
    """SkyRL passes vLLM's ``quantization`` through ``engine_init_kwargs``: it is ``inference.quantization``; the
    mapping's other vLLM arguments are each reported as not mapped, with the reason (an FSDP LoRA launch: adapters
    over an FP8 base, which SkyRL runs)."""
    launch = dict(LAUNCHES[-1])
    kwargs = {"quantization": "fp8", "swap_space": 4}
    launch["backend_config"] = {
        **launch["backend_config"],
        "generator.inference_engine.engine_init_kwargs": kwargs,
    }
    conversion = run(launch)
    assert validated(conversion).inference.quantization == "fp8"
    unmapped = {key: why for key, _, why in conversion.unmapped}
    assert "engine_init_kwargs" in unmapped["generator.inference_engine.engine_init_kwargs.swap_space"]


def test_a_written_endpoint_runs_a_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    launch = next(item for item in LAUNCHES if item["source"].startswith("docs/content/docs/tinker/multi_tenancy"))
    out = tmp_path / "endpoint.yaml"
    argv = [
        "endpoints",
        "from-skyrl",
        "--base-model",
        str(DATA / launch["base_model"] / "config.json"),
        "--backend",
        "megatron",
        "--backend-config",
        json.dumps(launch["backend_config"]),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "mapped  trainer.placement.colocate_all" in printed and "mapped  trainer.logprobs_chunk_size" in printed
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        yaml.safe_dump(
            {
                "name": "s",
                "endpoint": str(out),
                "workload": {"clients": [{"requests": [{"type": "forward_backward", "datums": [2000, 1000]}]}]},
            }
        )
    )
    result = PluginHost().run(load_scenario(scenario).resolve("default"), "sim")
    assert result.calls[0].padded_rows == 2 and result.requests[0].status == "completed"


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(DATA / "qwen3-0.6b" / "config.json")
    assert main(["endpoints", "from-skyrl", "--base-model", model, "--backend-config", "{not json", "--gpus", "1"]) == 2
    assert "--backend-config: not valid JSON" in capsys.readouterr().err
    assert main(["endpoints", "from-skyrl", "--base-model", str(tmp_path / "none.json"), "--gpus", "1"]) == 2
    assert "--base-model" in capsys.readouterr().err
    tp3 = json.dumps({"trainer.policy.megatron_config.tensor_model_parallel_size": 3})
    assert main(["endpoints", "from-skyrl", "--base-model", model, "--backend-config", tp3, "--gpus", "4"]) == 2
    assert "does not divide the 4 GPUs" in capsys.readouterr().err


def test_virtual_pipeline_stages_are_refused_naming_the_key() -> None:
    """The interleaved schedule is not modelled: a launch with virtual stages is refused with the key, not mapped."""
    from skyrl_sim.errors import UserError

    launch = dict(LAUNCHES[-1])
    key = "trainer.policy.megatron_config.virtual_pipeline_model_parallel_size"
    launch["backend_config"] = {**launch["backend_config"], key: 2}
    with pytest.raises(UserError, match="virtual_pipeline_model_parallel_size = 2: the interleaved pipeline schedule"):
        run(launch)
    launch["backend_config"] = {**launch["backend_config"], key: 1}
    run(launch)  # one chunk per stage is plain 1F1B
