"""Probe: megatron-core 0.16.1's 1F1B pipeline schedule with two stages on CPU, and each stage's peak tensor bytes.

What it does, on each of two ranks (one stage each) under gloo:
1. builds its stage of a tiny GPTModel (``pre_process`` on the first stage: the embedding; ``post_process`` on the
   last: the output layer and loss) from ``get_gpt_layer_local_spec`` (no TransformerEngine);
2. runs ``forward_backward_pipelining_without_interleaving`` (through ``get_forward_backward_func``) over
   ``MICRO_BATCHES`` micro-batches, the activations crossing stages by point-to-point send/recv on gloo;
3. meters every tensor storage alive during the call (``LiveTensorMeter``, the real backend's CPU meter) and the
   largest number of micro-batches the stage held at once (forwards whose backward had not run yet).

Only the layer norms are trainable (a stand-in for LoRA: the big linears are frozen, their inputs still saved for the
input gradients), so the metered bytes are activations, their gradients and the p2p buffers.

Run: ``/work/main/.venv/bin/python -m torch.distributed.run --nproc-per-node 2 scripts/probe_pp_megatron.py``
(about 10-30 s). Each rank prints ``stage S: peak ... held ...`` and rank 0 prints ``PROBE OK``; ``--json PATH``
writes both stages' numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_moe_megatron import CpuRngTracker, CudaToCpu  # noqa: E402

from skyrl_sim_plugins.megatron_vllm.memory_meter import LiveTensorMeter  # noqa: E402

HIDDEN = 128
FFN = 352
HEADS = 4
KV_HEADS = 2
LAYERS = 4
VOCAB = 512
SEQ = 64
MBS = 1
MICRO_BATCHES = 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=MICRO_BATCHES)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--json", default=None, help="write both stages' numbers here (rank 0)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=world)
    tracker = CpuRngTracker()
    tracker.add("model-parallel-rng", 1234)
    tensor_parallel.random._CUDA_RNG_STATE_TRACKER = tracker  # type: ignore[attr-defined]
    tensor_parallel.random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True  # type: ignore[attr-defined]
    torch.manual_seed(0)

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=KV_HEADS,
        kv_channels=HIDDEN // HEADS,
        ffn_hidden_size=FFN,
        use_cpu_initialization=True,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_model_parallel_size=world,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,  # gloo has no coalesced batch_isend_irecv: single isend/irecv pairs
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    first, last = rank == 0, rank == world - 1
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=args.seq,
        position_embedding_type="rope",
        pre_process=first,
        post_process=last,
    )
    for name, param in model.named_parameters():
        param.requires_grad_("layernorm" in name or "norm" in name.split(".")[-2])
    layers = len(model.decoder.layers)

    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, VOCAB, (MBS, args.seq + 1), generator=gen) for _ in range(args.micro_batches)]
    mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool), diagonal=1)[None, None]
    live = {"now": 0, "most": 0}
    it = iter(batches)

    def forward_step(_iterator: Any, m: torch.nn.Module) -> tuple[torch.Tensor, Callable[..., Any]]:
        tokens = next(it)
        positions = torch.arange(args.seq)[None].expand(MBS, args.seq)
        live["now"] += 1
        live["most"] = max(live["most"], live["now"])
        out = m(tokens[:, :-1], positions, mask, labels=tokens[:, 1:] if last else None)
        out.register_hook(lambda g: live.__setitem__("now", live["now"] - 1))  # this micro-batch's backward began

        def loss_fn(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = output.float().mean()
            return loss, {"loss": loss.detach().clone()}

        return out, loss_fn

    held = [p for p in model.parameters()]
    meter = LiveTensorMeter(held)
    fb = get_forward_backward_func()
    with CudaToCpu(), meter:
        fb(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=model,
            num_microbatches=args.micro_batches,
            seq_length=args.seq,
            micro_batch_size=MBS,
            forward_only=False,
        )
    numbers = {
        "stage": rank,
        "layers": layers,
        "weights_bytes": meter.baseline,
        "peak_bytes": meter.peak_bytes,
        "call_peak_bytes": meter.high,
        "held_microbatches": live["most"],
    }
    print(
        f"[{time.perf_counter() - t0:6.2f} s] stage {rank}: {layers} layers, weights {meter.baseline:,} B, call peak "
        f"{meter.high:,} B above them, at most {live['most']} micro-batches held",
        flush=True,
    )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, numbers)
    if rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"micro_batches": args.micro_batches, "seq": args.seq, "stages": gathered}, f, indent=1)
        print("PROBE OK", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
