"""vLLM's own V1 scheduler, driven step by step in this process, as the oracle of the simulator's engine model.

``run_vllm(case)`` feeds the installed vLLM's ``Scheduler`` (``vllm/v1/core/sched/scheduler.py``, with its real
``KVCacheManager`` and block pool) the requests of a ``Case`` at their arrival steps, plays the model runner (every
request whose computed tokens reach its length samples one token, each sequence its own token id so siblings'
outputs differ as sampled ones do), and records per request the step it was first scheduled, the step that gave its
first token, the step it finished and its preemptions. ``run_model(case)`` does the same with the simulator's
engine (``sim.fast.vllm_cohorts.CohortEngine``, or with ``fast=False`` the rule it is held to,
``sim.reference.vllm_scheduler.VllmEngine``) on a clock where every step takes one second, so steps and
seconds coincide. Both see the same settings: ``max_num_seqs``, ``max_num_batched_tokens``, block size, block count,
prefix caching, chunked prefill.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyrl_sim_plugins.sim.fast.vllm_cohorts import CohortEngine
from skyrl_sim_plugins.sim.fast.vllm_step_program import DecodeRun
from skyrl_sim_plugins.sim.reference.vllm_scheduler import EngineSettings, PromptGroup, Seq, VllmEngine

Timeline = dict[str, tuple[int | None, int | None, int | None, int]]
"""Per sequence id: (first scheduled step, first token step, finish step, preemptions)."""


@dataclass
class Request:
    arrival: int  # the step at whose start it is in the waiting queue
    prompt: int
    max_tokens: int
    samples: int


@dataclass
class Case:
    requests: list[Request]
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    block_size: int = 16
    num_blocks: int = 40  # the pool, null block included
    prefix_caching: bool = True
    chunked_prefill: bool = True
    seed: int = 0
    state_groups: int = 0  # a hybrid's mamba groups: one block per running sequence each (prefix caching off)
    ids: list[str] = field(default_factory=list)


def random_case(seed: int) -> Case:
    rng = random.Random(seed)
    requests = []
    step = 0
    for _ in range(rng.randint(3, 12)):
        step += rng.choice([0, 0, 1, 3, 8])
        requests.append(Request(step, rng.randint(1, 90), rng.randint(1, 40), rng.choice([1, 1, 2, 4])))
    block_size = rng.choice([4, 16])
    return Case(
        requests,
        max_num_seqs=rng.choice([4, 8, 16]),
        max_num_batched_tokens=rng.choice([16, 64, 128]),
        block_size=block_size,
        num_blocks=rng.randint(12, 80) if block_size == 16 else rng.randint(30, 200),
        prefix_caching=rng.random() < 0.8,
        chunked_prefill=True,
        seed=seed,
    )


# ---------------------------------------------------------------------------- vLLM


def _vllm_parts() -> dict[str, Any]:
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request as VRequest
    from vllm.v1.structured_output import StructuredOutputManager

    return {
        "torch": torch,
        "CacheConfig": CacheConfig,
        "ModelConfig": ModelConfig,
        "SchedulerConfig": SchedulerConfig,
        "VllmConfig": VllmConfig,
        "SamplingParams": SamplingParams,
        "sha256": sha256,
        "get_request_block_hasher": get_request_block_hasher,
        "init_none_hash": init_none_hash,
        "Scheduler": Scheduler,
        "FullAttentionSpec": FullAttentionSpec,
        "KVCacheConfig": KVCacheConfig,
        "KVCacheGroupSpec": KVCacheGroupSpec,
        "MambaSpec": MambaSpec,
        "ModelRunnerOutput": ModelRunnerOutput,
        "VRequest": VRequest,
        "StructuredOutputManager": StructuredOutputManager,
    }


MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
}


def run_vllm(case: Case, model_dir: Path) -> Timeline:
    """vLLM's scheduler over the case (``model_dir`` holds a config.json, ``write_model_config``)."""
    v = _vllm_parts()
    model = v["ModelConfig"](model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=8192)
    scheduler_config = v["SchedulerConfig"](
        max_num_seqs=case.max_num_seqs,
        max_num_batched_tokens=case.max_num_batched_tokens,
        max_model_len=8192,
        enable_chunked_prefill=case.chunked_prefill,
        is_encoder_decoder=False,
    )
    cache = v["CacheConfig"](block_size=case.block_size, enable_prefix_caching=case.prefix_caching)
    cache.num_gpu_blocks = case.num_blocks
    config = v["VllmConfig"](model_config=model, scheduler_config=scheduler_config, cache_config=cache)
    spec = v["FullAttentionSpec"](block_size=case.block_size, num_kv_heads=2, head_size=32, dtype=v["torch"].float32)
    groups = [v["KVCacheGroupSpec"](["layer.0"], spec)]
    page = spec.page_size_bytes
    for g in range(case.state_groups):  # vLLM's hybrid groups: a mamba state padded to the attention page
        # without prefix caching vLLM's mamba block spans max_model_len (``MambaModelConfig``): one per sequence
        mamba = v["MambaSpec"](block_size=8192, shapes=((3, 8),), dtypes=(v["torch"].float32,), page_size_padded=page)
        groups.append(v["KVCacheGroupSpec"]([f"mamba.{g}"], mamba))
    kv = v["KVCacheConfig"](num_blocks=case.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    scheduler = v["Scheduler"](
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=v["StructuredOutputManager"](config),
        block_size=8192 if case.state_groups else case.block_size,  # the groups' block sizes' least common multiple
        log_stats=True,
    )
    v["init_none_hash"](v["sha256"])
    hasher = v["get_request_block_hasher"](case.block_size, v["sha256"])
    rng = random.Random(case.seed)
    pending = sorted(enumerate(case.requests), key=lambda item: (item[1].arrival, item[0]))
    out: dict[str, list[Any]] = {}
    token_of: dict[str, int] = {}
    step = 0
    while pending or scheduler.has_requests():
        while pending and pending[0][1].arrival <= step:
            index, request = pending.pop(0)
            prompt = [rng.randrange(1, 4000) for _ in range(request.prompt)]
            for k in range(request.samples):
                rid = f"{index}-{k}"
                token_of[rid] = 1 + (hash(rid) % 4000)
                out[rid] = [None, None, None, 0]
                params = v["SamplingParams"](max_tokens=request.max_tokens, ignore_eos=True)
                scheduler.add_request(
                    v["VRequest"](
                        request_id=rid,
                        prompt_token_ids=list(prompt),
                        sampling_params=params,
                        pooling_params=None,
                        block_hasher=hasher,
                    )
                )
        output = scheduler.schedule()
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            if out[rid][0] is None:
                out[rid][0] = step
            request = scheduler.requests[rid]
            sampled.append([token_of[rid]] if request.num_computed_tokens >= request.num_tokens else [])
        for rid in getattr(output, "preempted_req_ids", ()) or ():
            out[rid][3] += 1
        runner = v["ModelRunnerOutput"](
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled
        )
        engine_outputs = scheduler.update_from_output(output, runner)
        for rid, tokens in zip(ids, sampled, strict=True):
            if tokens and out[rid][1] is None:
                out[rid][1] = step
        for outputs in engine_outputs.values():
            for item in outputs.outputs:
                if item.finish_reason is not None:
                    out[item.request_id][2] = step
        step += 1
        if step > 100_000:
            raise RuntimeError("vLLM's scheduler did not finish the case")
    return {rid: (a, b, c, d) for rid, (a, b, c, d) in out.items()}


def write_model_config(folder: Path) -> Path:
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return folder


# ---------------------------------------------------------------------------- the model


class UnitSteps:
    """Every step takes one second: steps and seconds coincide."""

    def seconds(self, tokens: float, prefill: float, pairs: float, seqs: float, context: float, rows: float) -> float:
        return 1.0

    def decode(self, seqs: int, context: float) -> DecodeRun:
        return DecodeRun(1.0, [])

    def lora_seconds(self, engine: int, loras: set[str]) -> float:
        return 0.0


def run_model(case: Case, fast: bool = True) -> Timeline:
    """The simulator's engine over the case (``fast``), or the reference engine it is held to."""
    settings = EngineSettings(
        max_num_seqs=case.max_num_seqs,
        max_num_batched_tokens=case.max_num_batched_tokens,
        block_size=case.block_size,
        usable_blocks=case.num_blocks - 1,
        enable_prefix_caching=case.prefix_caching,
        enable_chunked_prefill=case.chunked_prefill,
        max_loras=None,
        state_blocks=case.state_groups,
    )
    engine: CohortEngine | VllmEngine = (CohortEngine if fast else VllmEngine)(0, settings, UnitSteps())
    seqs: dict[str, Seq] = {}
    arrivals: dict[int, list[Seq]] = {}
    for index, request in enumerate(case.requests):
        group = PromptGroup(request.prompt, case.block_size)
        for k in range(request.samples):
            seq = Seq(len(seqs), index, group, request.prompt, request.max_tokens, None, float(request.arrival))
            seqs[f"{index}-{k}"] = seq
            arrivals.setdefault(request.arrival, []).append(seq)
    for at in sorted(arrivals):
        engine.arrive(arrivals[at], float(at))
    engine.advance(float("inf"))
    out: Timeline = {}
    for rid, seq in seqs.items():
        # the model records when a step starts (scheduled) or ends (first token, finish); the oracle a step's index,
        # which is its start: an end minus one
        out[rid] = (_step(seq.scheduled_s, 0), _step(seq.first_token_s, 1), _step(seq.finished_s, 1), seq.preemptions)
    return out


def _step(seconds: float | None, back: int) -> int | None:
    return None if seconds is None else round(seconds) - back

