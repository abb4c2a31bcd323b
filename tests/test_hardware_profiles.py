"""Hardware profiles are cards as data: each carries its memory, its reserve outside PyTorch's allocator, its peaks
and the public source of each number (docs/hardware.md), and an endpoint that names a profile runs on that card."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from skyrl_sim.cli import main
from skyrl_sim.commands.from_skyrl import convert, validated
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.hardware import load_profile, shipped_profiles
from skyrl_sim.units import GIB

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "hardware.md").read_text()
GPU_PROFILES = [name for name in shipped_profiles() if load_profile(name).device == "cuda"]
SOURCED = ("device_memory_gib", "cuda_context_gib", "peak_flops", "peak_flops_fp8", "memory_bandwidth")
LAUNCH = Path(__file__).parent / "data" / "skyrl_launches" / "qwen3-0.6b" / "config.json"


def test_the_new_cards_ship_beside_h100_and_h200() -> None:
    assert {"l4", "a100-40gb", "a100-80gb", "b200", "b300", "h100", "h200"} <= set(GPU_PROFILES)


def test_an_endpoint_that_names_h100_alone_is_an_80_gb_card() -> None:
    """The bug this fixes: ``hardware: {profile: h100}`` got the default 139.8 GiB, an H200's."""
    endpoint = Endpoint.model_validate({"model": "tiny-dense", "hardware": {"profile": "h100"}})
    assert endpoint.hardware.device_memory_gib == 79.11
    assert endpoint.capacity_bytes == int((79.11 - 1.8) * GIB)
    assert endpoint.hardware.devices == 1  # tp x pp x cp x dp, not a default of 4


@pytest.mark.parametrize("name", shipped_profiles())
def test_every_profile_memory_is_its_own_and_an_endpoint_overrides_it(name: str) -> None:
    card = load_profile(name)
    endpoint = Endpoint.model_validate({"model": "tiny-dense", "hardware": {"profile": name}})
    assert (endpoint.hardware.device_memory_gib, endpoint.hardware.reserve_gib) == (card.device_memory_gib, card.reserve_gib)
    given = Endpoint.model_validate(
        {"model": "tiny-dense", "hardware": {"profile": name, "device_memory_gib": 10.0, "reserve_gib": 0.5}}
    )
    assert (given.hardware.device_memory_gib, given.hardware.reserve_gib) == (10.0, 0.5)


def test_gpu_cards_differ_in_memory() -> None:
    memories = [load_profile(name).device_memory_gib for name in GPU_PROFILES]
    assert len(set(memories)) == len(memories)


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_each_gpu_number_has_a_public_source_shown_in_the_docs(name: str) -> None:
    card = load_profile(name)
    assert set(SOURCED) <= set(card.sources), f"{name}: sources missing for {set(SOURCED) - set(card.sources)}"
    for field in ("interconnect_bandwidth", "host_bandwidth"):
        assert field in card.sources, f"{name}: no source for {field}"
    row = next(line for line in DOC.splitlines() if line.startswith(f"| `{name}` |"))
    assert f"| {card.device_memory_gib:g} |" in row
    section = DOC.split(f"**`{name}`**", 1)[1].split("**`", 1)[0]
    for field, source in card.sources.items():
        assert f"`{field}`" in section, f"{name}: docs/hardware.md does not list the source of {field}"
        url = next((word for word in source.split() if word.startswith("https://")), None)
        if url is not None:
            assert url in section, f"{name}: docs/hardware.md lacks {url}"


def test_a_profile_file_without_its_memory_is_refused_naming_the_key(tmp_path: Path) -> None:
    profile = tmp_path / "card.yaml"
    profile.write_text("name: card\npeak_flops: 1.0e+12\nmemory_bandwidth: 1.0e+12\ninterconnect_bandwidth: 1.0e+11\n")
    with pytest.raises(ValueError, match="device_memory_gib"):
        Endpoint.model_validate({"model": "tiny-dense", "hardware": {"profile": str(profile)}})


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_from_skyrl_accepts_each_card_and_takes_its_memory(name: str) -> None:
    conversion = convert(str(LAUNCH), "megatron", {}, 1, gpu=name)
    endpoint = validated(conversion)
    assert endpoint.hardware.device_memory_gib == load_profile(name).device_memory_gib
    assert not any(line.startswith("ASSUMED") for line in conversion.report())


def test_from_skyrl_without_a_gpu_says_what_it_assumed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["endpoints", "from-skyrl", "--base-model", str(LAUNCH), "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "ASSUMED hardware.profile = h200 (skyrl-sim's: --gpu not given)" in out
    assert yaml.safe_load(out[out.index("name:") :])["hardware"] == {"profile": "h200", "devices": 1}


def test_a_run_notes_what_the_endpoint_left_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "s.yaml"
    workload = {"clients": [{"requests": [{"type": "forward_backward", "datums": [64]}]}]}
    scenario.write_text(json.dumps({"name": "s", "endpoint": {"model": "tiny-dense"}, "workload": workload}))
    assert main(["check", str(scenario)]) == 0
    out = capsys.readouterr().out
    assert "assumed: hardware.profile h200, 139.8 GiB per device (the endpoint names no card)" in out
    assert "assumed: skyrl_version 0.4.0" in out
    assert "assumed: trainer.strategy megatron (the endpoint names none; SkyRL-Train's own default is fsdp)" in out
    assert "assumed: lora.rank 8 (the endpoint names none; a Tinker client asks for 32 unless told)" in out
    named = {
        "model": "tiny-dense",
        "skyrl_version": "0.4.0",
        "hardware": {"profile": "l4"},
        "trainer": {"strategy": "megatron"},
        "lora": {"rank": 8},
    }
    scenario.write_text(json.dumps({"name": "s", "endpoint": named, "workload": workload}))
    assert main(["check", str(scenario)]) == 0
    assert "assumed:" not in capsys.readouterr().out


def test_a_full_fine_tuning_run_assumes_no_lora_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Full fine-tuning (SkyRL's lora.rank 0) uses no adapter: a rank it never reads is not an assumption."""
    scenario = tmp_path / "s.yaml"
    workload = {"clients": [{"requests": [{"type": "forward_backward", "datums": [64]}]}]}
    endpoint = {"model": "tiny-dense", "skyrl_version": "0.4.0", "hardware": {"profile": "l4"},
                "trainer": {"strategy": "megatron", "train_base_weights": True}}
    scenario.write_text(json.dumps({"name": "s", "endpoint": endpoint, "workload": workload}))
    assert main(["check", str(scenario)]) == 0
    assert "lora.rank" not in capsys.readouterr().out
