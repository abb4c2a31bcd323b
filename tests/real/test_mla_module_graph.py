"""Multi-latent attention with DeepSeek-style MoE (a dense first layer, shared experts) against megatron-core's own
module graph, built on CPU (``model_builder.latent_module_graph``: megatron-core 0.16.1's ``MLASelfAttention``, its
local MoE layer, the project's flash core attention). The real backend does not train this family yet (its weights
come from an HF layout without MLA tensors); what is held here is that the layer description the memory walk, the
time model and vLLM's cache read has megatron's linears, widths and parameter counts, and that the graph trains."""

from __future__ import annotations

import pytest
import torch

from skyrl_sim.schema.architecture import PRESETS
from skyrl_sim_plugins.sim.description.layer_ops import MoE, decoder_layer

pytestmark = pytest.mark.real

ARCH = PRESETS["tiny-mla-moe"]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from megatron.core import parallel_state, tensor_parallel

    from skyrl_sim_plugins.megatron_vllm.cpu_shims import apply_cpu_shims
    from skyrl_sim_plugins.megatron_vllm.model_builder import latent_module_graph
    from skyrl_sim_plugins.megatron_vllm.single_rank import init_single_rank_group

    init_single_rank_group()
    apply_cpu_shims()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    return latent_module_graph(ARCH, seed=0, dtype=torch.float32)


def megatron_names(index: int) -> dict[str, str]:
    """The description's linear names in layer ``index`` as megatron-core names their weights."""
    layer = decoder_layer(ARCH, index)
    names = {f"attention.{lin.name}": f"self_attention.{lin.name}.weight" for lin in layer.attention.linears}
    if isinstance(layer.mlp, MoE):
        for lin in layer.mlp.experts.linears:
            names[f"expert.{lin.name}"] = f"mlp.experts.local_experts.0.{lin.name}.weight"
        assert layer.mlp.shared is not None
        for lin in layer.mlp.shared.linears:
            names[f"shared.{lin.name}"] = f"mlp.shared_experts.{lin.name}.weight"
    else:
        for lin in layer.mlp.linears:
            names[f"mlp.{lin.name}"] = f"mlp.{lin.name}.weight"
    return names


@pytest.mark.parametrize("index", range(ARCH.num_layers))
def test_every_linear_has_megatrons_name_and_widths(model: torch.nn.Module, index: int) -> None:
    params = dict(model.decoder.layers[index].named_parameters())
    layer = decoder_layer(ARCH, index)
    linears = {f"attention.{lin.name}": lin for lin in layer.attention.linears}
    if isinstance(layer.mlp, MoE):
        linears |= {f"expert.{lin.name}": lin for lin in layer.mlp.experts.linears}
        assert layer.mlp.shared is not None
        linears |= {f"shared.{lin.name}": lin for lin in layer.mlp.shared.linears}
    else:
        linears |= {f"mlp.{lin.name}": lin for lin in layer.mlp.linears}
    for key, name in megatron_names(index).items():
        assert tuple(params[name].shape) == (linears[key].n_out, linears[key].n_in), name


@pytest.mark.parametrize("index", range(ARCH.num_layers))
def test_each_layers_parameter_count_is_megatrons(model: torch.nn.Module, index: int) -> None:
    counted = sum(p.numel() for p in model.decoder.layers[index].parameters())
    assert counted == ARCH.layer_parameter_count(index)


def test_the_whole_model_counts_as_megatrons_and_trains(model: torch.nn.Module) -> None:
    """Embedding, layers, final norm and output layer; one forward and backward on CPU."""
    assert sum(p.numel() for p in model.parameters()) == ARCH.parameter_count()
    tokens = torch.randint(0, ARCH.vocab_size, (2, 48))
    positions = torch.arange(48).view(1, -1).expand(2, -1)
    logits = model(tokens, positions, None)
    logits.float().logsumexp(-1).mean().backward()
    assert logits.shape == (2, 48, ARCH.vocab_size)
    assert model.decoder.layers[0].self_attention.linear_kv_down_proj.weight.grad is not None
