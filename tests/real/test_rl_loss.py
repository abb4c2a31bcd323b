"""The real backend's RL path (``megatron_vllm.rl_loss`` through ``LoraModel._loss``), checked against a reference
computed from the full logits.

On CPU ranks with a gloo group and megatron-core's parallel state (TP 1 and TP 2, each rank holding its shard of the
vocabulary): ``importance_sampling`` and ``ppo`` over the re-expanded logits (megatron's vocab-parallel
cross-entropy) and over the fused LM head (hidden states and the output weight shard), rows of different lengths
left-padded to the global width. The reference takes ``log_softmax`` over the whole vocabulary and writes SkyRL's
formulas out by hand; the loss, every logit's (or hidden state's) gradient and the entropy metric must agree.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.real

ROWS, WIDTH, VOCAB, HIDDEN = 3, 37, 64, 16
LENGTHS = [37, 30, 21]  # tokens per row (input + last target), left-padded to the global width


def reference(
    loss_fn: str, full: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, old: torch.Tensor, adv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SkyRL's loss and the entropy metric from the whole vocabulary's logits ``[b, W, V]`` (fp32)."""
    logp = torch.log_softmax(full, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if loss_fn == "importance_sampling":
        per_token = -(torch.exp(lp - old) * adv)
    else:
        ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
        per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.9, 1.3) * adv)
    entropy = -(logp.exp() * logp).sum(-1)[:, : WIDTH - 1]
    metric = (entropy * mask[:, : WIDTH - 1]).sum() / mask[:, : WIDTH - 1].sum()
    return (per_token * mask).sum(), metric


def inputs(seed: int) -> dict[str, torch.Tensor]:
    """The same random call on every rank: logits (or hidden states and weight), targets, mask and RL inputs."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.zeros(ROWS, WIDTH, VOCAB)
    raw = torch.randn(ROWS, WIDTH, VOCAB, generator=gen) * 2
    targets = torch.zeros(ROWS, WIDTH, dtype=torch.long)
    mask = torch.zeros(ROWS, WIDTH)
    for r, n in enumerate(LENGTHS):
        full[r, WIDTH - n :] = raw[r, :n]
        targets[r, WIDTH - n : WIDTH - 1] = torch.randint(0, VOCAB, (n - 1,), generator=gen)
        mask[r, WIDTH - n : WIDTH - 1] = 1.0
    old = -torch.rand(ROWS, WIDTH, generator=gen) * 4  # the sampler's log-probs: some ratios clip, some do not
    adv = torch.randn(ROWS, WIDTH, generator=gen)
    hidden = torch.randn(ROWS, WIDTH, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) / 4
    return dict(raw=raw, full=full, targets=targets, mask=mask, old=old, adv=adv, hidden=hidden, weight=weight)


def rank_main(rank: int, world: int, init_file: str, fused: bool, results: Any) -> None:
    # a rendezvous file, not a port: nothing another process on the machine can take first
    timeout = __import__("datetime").timedelta(seconds=120)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout)
    from megatron.core import parallel_state

    from skyrl_sim.schema.endpoint import Endpoint
    from skyrl_sim_plugins.megatron_vllm.batch import MicroBatchTensors
    from skyrl_sim_plugins.megatron_vllm.cpu_shims import apply_cpu_shims
    from skyrl_sim_plugins.megatron_vllm.trainer import CallResult, LoraModel

    apply_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        data = inputs(11)
        shard = slice(rank * VOCAB // world, (rank + 1) * VOCAB // world)
        model = LoraModel.__new__(LoraModel)  # the loss path alone: no GPT model is built
        model.endpoint = Endpoint.model_validate(
            {
                "model": "tiny-dense",
                "hardware": {"profile": "cpu", "devices": world},
                "parallelism": {"tp": world, "sequence_parallel": False},
                # the entropy in 5-token chunks, the fused head's log-probs and entropy in 8-token chunks
                "trainer": {"fused_lm_head_logprob": fused, "logprobs_chunk_size": 8, "vocab_entropy_chunk_size": 5},
            }
        )
        model.fused_head, model.tp, model.device = fused, world, torch.device("cpu")
        mb = MicroBatchTensors(
            tokens=torch.zeros(ROWS, WIDTH, dtype=torch.long),
            lengths=LENGTHS,
            targets=data["targets"],
            loss_mask=data["mask"],
            row_index=list(range(ROWS)),
            global_width=WIDTH,
            sampling_logprobs=data["old"],
            advantages=data["adv"],
        )
        out = {}
        ppo = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.3}
        for loss_fn, config in (("importance_sampling", {}), ("ppo", ppo)):
            if fused:
                hidden = data["hidden"].clone().requires_grad_(True)
                model.output_weight = data["weight"][shard].contiguous()
                given = hidden
            else:
                logits = data["raw"][..., shard].clone().requires_grad_(True)  # [b, S_mb, V/tp], real tokens first
                model.output_weight = None
                given = logits
            result = CallResult()
            loss, _, _ = model._loss(result, mb, {"loss_fn": loss_fn, "config": config}, given)
            loss.backward()
            grad = given.grad.clone()
            if fused:  # each rank's hidden-state gradient covers its vocabulary shard: summed over TP upstream
                dist.all_reduce(grad)
            # plain lists: a tensor sent through the queue would live in this process's shared memory, gone at exit
            out[loss_fn] = (float(loss.detach()), grad.tolist(), result.entropy[0])
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("fused", [False, True])
def test_rl_losses_and_entropy_match_the_full_logits_reference(tmp_path, world: int, fused: bool) -> None:
    context = mp.get_context("spawn")
    results = context.Queue()
    init_file = str(tmp_path / "rendezvous")
    processes = [context.Process(target=rank_main, args=(r, world, init_file, fused, results)) for r in range(world)]
    for p in processes:
        p.start()
    got = [out for _, out in sorted(results.get(timeout=240) for _ in range(world))]
    for p in processes:
        p.join(timeout=60)
        assert p.exitcode == 0
    data = inputs(11)
    for loss_fn in ("importance_sampling", "ppo"):
        if fused:
            hidden = data["hidden"].clone().requires_grad_(True)
            full = torch.matmul(hidden, data["weight"].t())
            source = hidden
        else:
            raw = data["raw"].clone().requires_grad_(True)
            full = torch.zeros(ROWS, WIDTH, VOCAB)
            for r, n in enumerate(LENGTHS):
                full[r, WIDTH - n :] = raw[r, :n]
            source = raw
        loss, metric = reference(loss_fn, full, data["targets"], data["mask"], data["old"], data["adv"])
        loss.backward()
        for rank, out in enumerate(got):
            value, grad, entropy = out[loss_fn]
            assert value == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-5), (loss_fn, rank)
            assert entropy == pytest.approx(float(metric), rel=1e-5), (loss_fn, rank)
            expected = source.grad if fused else source.grad[..., rank * VOCAB // world : (rank + 1) * VOCAB // world]
            torch.testing.assert_close(torch.tensor(grad), expected, rtol=1e-4, atol=1e-5)
