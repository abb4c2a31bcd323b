"""The classic caching allocator in a run: chosen by SkyRL's flag, each call replayed through the rank's allocator
kept from call to call, reserved-but-unallocated memory reported per call, and a fragmented failure named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from skyrl_sim.cli import main
from skyrl_sim.commands.from_skyrl import convert, validated
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.results.verdict import oom_lines
from skyrl_sim.schema.architecture import resolve_model
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.schema.skyrl_versions import VERSIONS
from skyrl_sim_plugins.sim.bound.binding import Binding
from skyrl_sim_plugins.sim.bound.classic_allocator import allocator_settings, classic_allocator
from skyrl_sim_plugins.sim.reference.allocation_replay import RankAllocator, ReplayStep
from skyrl_sim_plugins.sim.reference.allocator import CATEGORY_INDEX, CUDA_CACHING, CUDA_CLASSIC, Step

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "fragmentation_long_context.yaml"
LAUNCH = Path(__file__).parent / "data" / "skyrl_launches" / "qwen3-0.6b" / "config.json"
MIB, GIB = 1 << 20, 1 << 30


def run(variant: str) -> Any:
    return PluginHost().run(load_scenario(SCENARIO).resolve(variant), "sim")


@pytest.fixture(scope="module")
def classic() -> Any:
    return run("classic")


def test_the_flag_defaults_to_the_versions_expandable_segments() -> None:
    """SkyRL 0.4.0 and the base of PR #1874 both default ``trainer.use_expandable_segments`` to true (PR #1768)."""
    assert all(v.trainer_expandable_segments and not v.inference_expandable_segments for v in VERSIONS.values())
    cuda = Endpoint.model_validate({"model": "tiny-dense", "hardware": {"profile": "h100"}})
    assert not classic_allocator(cuda)
    off = cuda.model_copy(update={"trainer": cuda.trainer.model_copy(update={"use_expandable_segments": False})})
    assert classic_allocator(off)
    assert Binding.of(off, resolve_model(off.model, ROOT)).allocator is CUDA_CLASSIC  # the allocator axis's option
    assert Binding.of(cuda, resolve_model(cuda.model, ROOT)).allocator is CUDA_CACHING
    cpu = Endpoint.model_validate(
        {"model": "tiny-dense", "hardware": {"profile": "cpu"}, "trainer": {"use_expandable_segments": False}}
    )
    assert not classic_allocator(cpu)  # CPU tensors: PyTorch's CPU allocator, no caching segments


def test_allocator_settings_come_from_the_endpoint() -> None:
    endpoint = Endpoint.model_validate(
        {
            "model": "tiny-dense",
            "hardware": {"profile": "h100"},
            "memory_limit_gib": 40,
            "trainer": {
                "use_expandable_segments": False,
                "pytorch_cuda_alloc_conf": {"max_split_size_mb": 128, "garbage_collection_threshold": 0.6},
            },
        }
    )
    settings = allocator_settings(endpoint)
    assert settings.max_split_size == 128 * MIB and settings.garbage_collection_threshold == 0.6
    assert settings.memory_fraction_bytes == endpoint.capacity_bytes


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        ({"expandable_segments": False}, "trainer.use_expandable_segments"),
        ({"pytorch_cuda_alloc_conf": {"max_split_size_mb": 20}}, "greater than 20"),
        ({"pytorch_cuda_alloc_conf": {"garbage_collection_threshold": 1.0}}, "less than 1"),
    ],
)
def test_bad_allocator_settings_are_refused_naming_the_key(trainer: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Endpoint.model_validate({"model": "tiny-dense", "trainer": trainer})


def test_pipeline_stages_are_not_replayed_and_say_so() -> None:
    with pytest.raises(ValidationError, match="pipeline stages are not replayed"):
        Endpoint.model_validate(
            {"model": "tiny-dense", "parallelism": {"pp": 2}, "trainer": {"use_expandable_segments": False}}
        )


def test_from_skyrl_maps_both_flags() -> None:
    config = {"trainer.use_expandable_segments": False, "generator.inference_engine.use_expandable_segments": True}
    endpoint = validated(convert(str(LAUNCH), "megatron", config, 1, gpu="b200"))
    assert endpoint.trainer.use_expandable_segments is False and endpoint.inference.use_expandable_segments is True


def step(key: str, nbytes: int, category: str = "transient") -> ReplayStep:
    return ReplayStep(0, "forward", 0, Step(key, nbytes, abs(nbytes), CATEGORY_INDEX[category], key, (), "bf16"))


def test_a_free_releases_the_allocation_of_its_key_else_one_of_its_size() -> None:
    rank = RankAllocator.start(1 << 40, {"weights": 100 * MIB})
    outcome = rank.replay_call(
        [step("a", 30 * MIB), step("b", 30 * MIB), step("a", -30 * MIB), step("renamed", -30 * MIB)], empty_cache=True
    )
    assert outcome.failure is None and rank.allocator.allocated == 100 * MIB  # only the weights stay
    assert outcome.reserved_after == 100 * MIB and outcome.unallocated_after == 0  # empty_cache returned the rest


def test_a_free_of_nothing_live_is_counted_not_applied() -> None:
    """A free the walk's bookkeeping makes of a tensor it never allocated (an unbalanced key) cannot free a block."""
    rank = RankAllocator.start(1 << 40, {})
    outcome = rank.replay_call([step("a", 4 * MIB), step("ghost", -3 * MIB), step("a", -4 * MIB)], empty_cache=False)
    assert outcome.failure is None and outcome.unmatched_free_bytes == 3 * MIB and rank.allocator.allocated == 0


def test_a_colocated_reload_needs_one_contiguous_block_per_part() -> None:
    """SkyRL's ``offload_to_cpu`` frees the static memory and empties the cache; ``backload_to_gpu`` allocates each part
    again as one buffer. A persistent buffer carved from a cached block pins that segment; with the sleeping engine
    holding 50 MiB more of the device than during the call, the 600 MiB reload finds 290 MiB cached in that segment
    and 550 MiB free on the device: enough in all, in no one piece."""
    rank = RankAllocator.start(900 * MIB, {"weights": 600 * MIB})
    steps = [step("x", 300 * MIB), step("x", -300 * MIB), step("buffer", 10 * MIB, "persistent_buffers")]
    assert rank.replay_call(steps, empty_cache=True).failure is None
    rank.offload()
    assert rank.allocator.reserved == 300 * MIB and rank.offloaded == {"static:weights": 600 * MIB}
    rank.allocator.capacity = 850 * MIB  # what the trainer has beside the sleeping engine now
    oom = rank.backload()
    assert oom is not None and oom.fragmented and oom.unallocated == 290 * MIB and oom.free_device == 550 * MIB
    assert rank.offloaded == {"static:weights": 600 * MIB}  # still on the host
    roomy = RankAllocator.start(1000 * MIB, {"weights": 600 * MIB})
    roomy.offload()
    assert roomy.backload() is None and roomy.allocator.allocated == 600 * MIB and not roomy.offloaded


def test_a_failed_call_frees_its_tensors_keeps_its_buffers_and_empties_nothing() -> None:
    """The tensors of a call that raised die with its exception; a persistent buffer it made stays; SkyRL's
    empty_cache is never reached."""
    rank = RankAllocator.start(200 * MIB, {})
    steps = [step("buffer", 40 * MIB, "persistent_buffers"), step("x", 100 * MIB), step("y", 100 * MIB)]
    outcome = rank.replay_call(steps, empty_cache=True)
    assert outcome.failure is not None and outcome.failure.at.step.key == "y"
    assert rank.allocator.allocated == 40 * MIB and rank.allocator.reserved == 140 * MIB  # x cached, not returned
    assert [key for key, blocks in rank.live.items() if blocks] == ["buffer"]


def test_reserved_but_unallocated_grows_call_to_call_and_the_last_call_fails_fragmented(classic: Any) -> None:
    """The done-when of the classic allocator: growing long-context calls with the classic allocator."""
    views = [call.memory["allocator"] for call in classic.calls]
    after = [view["unallocated_after_bytes"] for view in views]
    assert after[0] > GIB and after[2] > after[1] > after[0] and max(after[:5]) > 40 * GIB  # carried and growing
    assert all(view["kind"] == "classic" for view in views)
    last = classic.calls[-1]
    assert last.oom is not None and last.oom.where["allocator"] == "classic" and last.oom.where["fragmented"]
    unallocated = last.oom.where["reserved_unallocated_bytes"]
    assert unallocated > last.oom.attempted_bytes - 9 * GIB  # the cache plus the free device memory would hold it
    assert last.oom.where["largest_free_block_bytes"] < last.oom.attempted_bytes  # but no one piece of it does
    assert "is reserved by PyTorch but unallocated" in last.oom.message and "expandable_segments:True" in last.oom.message
    assert any(note.startswith("allocator: PyTorch's classic caching allocator") for note in classic.notes)


def test_expandable_segments_pass_and_the_report_says_why() -> None:
    result = run("expandable")
    assert not result.oom_calls and all(call.memory.get("allocator") is None for call in result.calls)
    assert any("2 MiB pages" in note and "cannot happen" in note for note in result.notes)


def test_the_walk_alone_would_pass_the_call_the_classic_allocator_fails(classic: Any) -> None:
    """The failing call's live bytes fit (the expandable run completes it): the failure is the allocator's."""
    assert classic.calls[-1].peak_bytes < classic.capacity_bytes


def test_check_prints_the_allocator_note_and_a_failure_names_the_fragmentation(
    classic: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "run.json"
    assert main(["check", str(SCENARIO), "--variant", "classic", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "note: allocator: PyTorch's classic caching allocator" in out
    assert "reserved but unallocated at a call's peak up to" in out
    data = json.loads(out_json.read_text())
    assert data["runs"][0]["calls"][-1]["memory"]["allocator"]["kind"] == "classic"
    (line,) = oom_lines(classic)
    assert "free memory fragmented: " in line and "GiB reserved but unallocated, largest free block" in line


def test_the_real_backend_sets_the_endpoints_allocator_after_loading() -> None:
    """The real backend's workers set PYTORCH_CUDA_ALLOC_CONF's settings after the model is loaded, as SkyRL's
    ``Worker._set_expandable_segments`` does; on CPU nothing is set (its allocator has no segments)."""
    from skyrl_sim_plugins.megatron_vllm.memory_meter import apply_allocator_settings

    endpoint = Endpoint.model_validate(
        {
            "model": "tiny-dense",
            "trainer": {"use_expandable_segments": False, "pytorch_cuda_alloc_conf": {"max_split_size_mb": 128}},
        }
    )
    conf = endpoint.trainer.pytorch_cuda_alloc_conf
    assert conf.text(endpoint.trainer.expandable_segments(endpoint.rules)) == (
        "expandable_segments:False,max_split_size_mb:128"
    )
    assert apply_allocator_settings("expandable_segments:False") == {}  # no CUDA here
