"""The CUDA graphs' memory (``vllm_budget.cuda_graph_bytes``) against the installed vLLM's own code: the graphs its
dispatcher captures per mode and size (``CudagraphDispatcher.get_capture_descs``, run here on CPU), and the lower
bound that code puts on their memory (one forward's live peak in the shared pool and in the warm-up's cache, and
``profile_cudagraph_memory``'s floor for every later graph)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from skyrl_sim.schema.architecture import resolve_model
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim_plugins.sim.service.inference import vllm_budget as budget

MODEL = "qwen3-8b"
SETTINGS = ((1024, 8192), (256, 8192), (64, 8192), (200, 300), (4, 2048))


def endpoint(**inference: Any) -> Endpoint:
    body = {
        "name": "graphs",
        "model": MODEL,
        "hardware": {"profile": "h100", "devices": 1, "device_memory_gib": 79.19, "reserve_gib": 0.78},
        "inference": {"vllm_version": "0.32.0", **inference},
    }
    return Endpoint.model_validate(body)


def vllm_capture_descs(seqs: int, tokens: int) -> dict[str, tuple[int, ...]]:
    """vLLM's dispatcher on the same settings: the sizes ``_set_cudagraph_sizes`` picks, the keys
    ``initialize_cudagraph_keys`` makes for ``FULL_AND_PIECEWISE``, listed by ``get_capture_descs``."""
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode
    from vllm.config.vllm import VllmConfig
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    compilation = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    config = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False),
        compilation_config=compilation,
        scheduler_config=SimpleNamespace(max_num_seqs=seqs, max_num_batched_tokens=tokens),
        uniform_decode_query_len=1,
        num_speculative_tokens=0,
        speculative_config=None,
        performance_mode="balanced",
        parallel_config=SimpleNamespace(tensor_parallel_size=1, enable_sequence_parallelism=False),
        lora_config=None,
    )
    VllmConfig._set_cudagraph_sizes(config)
    # The constructor checks the model was compiled piecewise (a real model's compilation); the key logic does not
    # depend on it, so the dispatcher is set up with the attributes its constructor gives it.
    dispatcher = object.__new__(CudagraphDispatcher)
    dispatcher.vllm_config = config
    dispatcher.compilation_config = compilation
    dispatcher.uniform_decode_query_len = 1
    dispatcher.cudagraph_keys = {CUDAGraphMode.PIECEWISE: set(), CUDAGraphMode.FULL: set()}
    dispatcher.keys_initialized = False
    dispatcher.specialize_lora_count = False
    dispatcher.cudagraph_mode = CUDAGraphMode.NONE
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE, 1)
    return {mode.name: tuple(d.num_tokens for d in descs) for mode, descs in dispatcher.get_capture_descs()}


@pytest.mark.parametrize(("seqs", "tokens"), SETTINGS)
def test_the_graphs_per_mode_and_size_are_vllms_own(seqs: int, tokens: int) -> None:
    e = endpoint(max_num_seqs=seqs, max_num_batched_tokens=tokens)
    assert budget.cudagraph_capture_descs(e) == vllm_capture_descs(seqs, tokens)


def test_no_graphs_without_capture() -> None:
    e = endpoint(enforce_eager=True)
    assert budget.cudagraph_capture_descs(e) == {}
    assert budget.cuda_graph_bytes(e, resolve_model(e.model, Path("."))) == 0


@pytest.mark.parametrize(("seqs", "tokens"), SETTINGS)
def test_the_estimate_is_at_least_what_vllms_code_must_take(seqs: int, tokens: int) -> None:
    """A lower bound from vLLM's code alone: the first capture of the largest size keeps one forward's live peak in
    the shared pool and as much in the warm-up's cache, and every later graph of either mode counts at least
    ``_MIN_PER_GRAPH_BYTES`` (``profile_cudagraph_memory``). The estimate (the largest size's activations in every
    layer, ``cuda_graph_bytes``) never falls below it, and its size is the largest descriptor of any mode."""
    from vllm.v1.worker.gpu.cudagraph_utils import _MIN_PER_GRAPH_BYTES

    e = endpoint(max_num_seqs=seqs, max_num_batched_tokens=tokens)
    model = resolve_model(e.model, Path("."))
    descs = vllm_capture_descs(seqs, tokens)
    largest = max(sizes[0] for sizes in descs.values())
    later = sum(len(sizes) - 1 for sizes in descs.values())
    lower_bound = 2 * budget.forward_peak_bytes(e, model, largest) + later * _MIN_PER_GRAPH_BYTES
    estimate = budget.cuda_graph_bytes(e, model)
    assert estimate == budget.forward_peak_bytes(e, model, largest) * model.num_layers
    assert estimate >= lower_bound
