"""Probe: a tiny MoE GPTModel in megatron-core 0.16.1 on CPU, one forward/backward, with routed-expert replay.

What it checks, in order:
1. A GPTModel built from ``get_gpt_layer_local_spec(num_experts=..., moe_grouped_gemm=False)`` (no TransformerEngine)
   runs one forward and backward on CPU under gloo (world size 1), through ``get_forward_backward_func``.
2. Megatron's own router replay (``moe_enable_routing_replay``): record the top-k expert ids of every MoE layer, send
   them through skyrl_sim.engine.r3_codec (compact dtype, base64, orjson body) as SkyRL's R3 would, decode them, replay them,
   and check the replayed forward gives the same loss.

Run: ``.venv/bin/python scripts/probe_moe_megatron.py`` (about 10-30 s on 2 cores). Prints one line per step and
``PROBE OK`` at the end; any failure raises with megatron's own error.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from skyrl_sim.engine import r3_codec
from skyrl_sim_plugins.megatron_vllm.single_rank import init_single_rank_group

HIDDEN = 64
HEADS = 4
LAYERS = 2
EXPERTS = 8
TOPK = 2
VOCAB = 256
SEQ = 32
MICRO_BATCHES = 2
MBS = 2


class CudaToCpu(TorchFunctionMode):
    """Maps any ``device='cuda'`` argument to the CPU (megatron's schedules and masks assume CUDA)."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and "cuda" in str(device):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class CpuRngTracker:
    """Stands in for megatron's CUDA RNG tracker: forks the CPU generator instead."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.states = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.states[name] = gen.get_state()

    def is_initialized(self) -> bool:
        return True

    def fork(self, name: str = "model-parallel-rng") -> Any:
        import contextlib

        @contextlib.contextmanager
        def _fork() -> Any:
            saved = torch.get_rng_state()
            if name in self.states:
                torch.set_rng_state(self.states[name])
            try:
                yield
            finally:
                self.states[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

        return _fork()


def step(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.2f} s] {msg}", flush=True)


def main() -> int:
    t0 = time.perf_counter()
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    init_single_rank_group()

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    # megatron-core 0.16.1 bug without TransformerEngine: moe_utils imports te_general_gemm inside a try block and
    # never binds it on ImportError, so the router's gating GEMM raises NameError. Bind it to None (torch.mm path).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    parallel_state.initialize_model_parallel(1, 1)
    tracker = CpuRngTracker()
    tracker.add("model-parallel-rng", 1234)
    tensor_parallel.random._CUDA_RNG_STATE_TRACKER = tracker  # type: ignore[attr-defined]
    tensor_parallel.random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True  # type: ignore[attr-defined]
    torch.manual_seed(0)
    step("parallel state initialised", t0)

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=4 * HIDDEN,
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
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=2 * HIDDEN,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_grouped_gemm=False,
        moe_enable_routing_replay=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    step(f"GPTModel with {EXPERTS} experts, top {TOPK}: {sum(p.numel() for p in model.parameters()):,} params", t0)

    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen) for _ in range(MICRO_BATCHES)]
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]

    def run(action: RouterReplayAction) -> tuple[float, list[torch.Tensor]]:
        RouterReplay.set_global_router_replay_action(action)
        model.zero_grad(set_to_none=True)
        recorded: list[list[torch.Tensor]] = []
        it = iter(batches)

        def forward_step(_iterator: Any, m: torch.nn.Module) -> tuple[torch.Tensor, Callable[..., Any]]:
            tokens = next(it)
            if action == RouterReplayAction.REPLAY_FORWARD:
                RouterReplay.set_replay_data(replay_queue.pop(0))
            positions = torch.arange(SEQ)[None].expand(MBS, SEQ)
            labels = tokens[:, 1:]
            out = m(tokens[:, :-1], positions, mask, labels=labels)

            def loss_fn(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                if action == RouterReplayAction.RECORD:
                    recorded.append([t.clone() for t in RouterReplay.get_recorded_data()])
                loss = output.float().mean()
                return loss, {"loss": loss.detach().clone()}

            return out, loss_fn

        fb = get_forward_backward_func()
        with CudaToCpu():
            losses = fb(
                forward_step_func=forward_step,
                data_iterator=iter(batches),
                model=model,
                num_microbatches=MICRO_BATCHES,
                seq_length=SEQ,
                micro_batch_size=MBS,
                forward_only=False,
            )
        RouterReplay.clear_global_router_replay_action()
        total = float(sum(float(x["loss"]) for x in losses))
        return total, [torch.stack(layers, dim=1) for layers in recorded]  # per micro-batch: [tokens, layers, topk]

    replay_queue: list[list[torch.Tensor]] = []
    loss_rec, routes = run(RouterReplayAction.RECORD)
    grads = sum(1 for p in model.parameters() if p.grad is not None or getattr(p, "main_grad", None) is not None)
    step(f"forward/backward with recording: loss {loss_rec:.6f}, {grads} params with grads", t0)
    step(f"recorded routes per micro-batch: {[tuple(r.shape) for r in routes]} dtype {routes[0].dtype}", t0)

    # Through the R3 wire format and back, as SkyRL's service would ship them to the trainer.
    wire: list[bytes] = [r3_codec.dumps_body({"routed_experts": r3_codec.encode_routes(r.numpy())}) for r in routes]
    decoded = [r3_codec.decode_routes(r3_codec.loads_body(b)["routed_experts"]) for b in wire]
    assert all(np.array_equal(d, r.numpy()) for d, r in zip(decoded, routes, strict=True))
    step(f"codec round trip ok: {[len(b) for b in wire]} wire bytes, dtype {decoded[0].dtype}", t0)

    # Capture what the routers really use while replaying.
    used: list[torch.Tensor] = []
    original_topk = RouterReplay.get_replay_topk

    def capturing_topk(self: RouterReplay, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        probs, indices = original_topk(self, *args, **kwargs)
        if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            used.append(indices.clone())
        return probs, indices

    RouterReplay.get_replay_topk = capturing_topk  # type: ignore[method-assign]

    def replay_decoded() -> tuple[float, list[np.ndarray]]:
        used.clear()
        replay_queue.extend([list(torch.from_numpy(d.astype(np.int64)).unbind(dim=1)) for d in decoded])
        loss, _ = run(RouterReplayAction.REPLAY_FORWARD)
        per_mb = [torch.stack(used[i : i + LAYERS], dim=1).numpy() for i in range(0, len(used), LAYERS)]
        return loss, per_mb

    loss_same, _ = replay_decoded()
    step(f"replay on the same weights: loss {loss_same:.6f} (recorded {loss_rec:.6f}, diff {loss_same - loss_rec:+.2e})", t0)

    # Perturb the routers so free routing differs, then replay the decoded routes: the routers must use them.
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.mlp.router.weight.add_(torch.randn_like(layer.mlp.router.weight))
    loss_free, routes_free = run(RouterReplayAction.RECORD)
    changed = sum(int((a.sort(-1).values != b.sort(-1).values).any()) for a, b in zip(routes, routes_free, strict=True))
    loss_replay, used_routes = replay_decoded()
    same = all(np.array_equal(u, d) for u, d in zip(used_routes, decoded, strict=True))
    step(
        f"after perturbing the routers: free routing re-routes {changed}/{len(routes)} micro-batches, loss {loss_free:.6f}",
        t0,
    )
    step(f"replaying the decoded routes: routers used exactly the recorded ids: {same}; loss {loss_replay:.6f}", t0)
    if not same or changed == 0:
        raise SystemExit("PROBE FAILED: replay did not reproduce the recorded routing")
    dist.destroy_process_group()
    print("PROBE OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
