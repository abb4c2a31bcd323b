"""The CUDA graphs' memory rule (``vllm_budget.cuda_graph_bytes``) against the installed vLLM's own code: the graphs
its dispatcher captures per mode and size (``CudagraphDispatcher.get_capture_descs``, run here on CPU), the per-graph
floor of its ``profile_cudagraph_memory``, and the composition that code uses (the largest first capture over the
modes, shared pool, plus the later graphs), with no term that grows with the model's depth."""

from __future__ import annotations

import dataclasses
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


def test_the_per_graph_floor_is_vllms() -> None:
    from vllm.v1.worker.gpu.cudagraph_utils import _MIN_PER_GRAPH_BYTES

    assert budget.GRAPH_MEMORY_FLOOR_BYTES == _MIN_PER_GRAPH_BYTES


@pytest.mark.parametrize(("seqs", "tokens"), SETTINGS)
def test_the_largest_first_capture_plus_the_later_graphs(seqs: int, tokens: int) -> None:
    """FULL and PIECEWISE share one pool: the first captures overlay (the larger, PIECEWISE's), never add; each
    later graph of either mode counts the floor."""
    e = endpoint(max_num_seqs=seqs, max_num_batched_tokens=tokens)
    model = resolve_model(e.model, Path("."))
    descs = vllm_capture_descs(seqs, tokens)
    largest = descs["PIECEWISE"][0]
    later = sum(len(sizes) - 1 for sizes in descs.values())
    expected = 2 * budget.forward_peak_bytes(e, model, largest) + later * budget.GRAPH_MEMORY_FLOOR_BYTES
    assert budget.cuda_graph_bytes(e, model) == expected
    assert budget.first_capture_bytes(e, model, descs["FULL"][0]) <= budget.first_capture_bytes(e, model, largest)


def test_the_graphs_memory_does_not_grow_with_depth() -> None:
    """Freed intermediates return to the shared pool and are reused within and across captures: a deeper model of
    the same widths keeps no more (the earlier per-layer sum grew with every layer)."""
    e = endpoint()
    model = resolve_model(e.model, Path("."))
    deeper = dataclasses.replace(model, num_layers=2 * model.num_layers, layer_types=model.layer_types * 2)
    assert budget.cuda_graph_bytes(e, deeper) == budget.cuda_graph_bytes(e, model) > 0
