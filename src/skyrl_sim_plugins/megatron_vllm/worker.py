"""The torchrun entry point of the real backend's training workers.

Launched as ``python -m torch.distributed.run --nproc-per-node N -m skyrl_sim_plugins.megatron_vllm.worker CONFIG``
(gloo on CPU, NCCL on CUDA). Each rank: imports, joins the process groups, applies the CPU shims, connects to the
parent (``protocol.py``), builds the runtime as SkyRL does (one base model with one live LoRA adapter, writing the
base checkpoint, and an adapter store with a host slot per model id loaded at the start), warms up, applies the
memory limit (``memory_meter.apply_memory_limit``: the device's on CUDA; on CPU the tensor limit of each call's
``LiveTensorMeter``, with an address-space backstop), says hello, then serves commands until ``shutdown``, until the
parent goes away, or until it has been idle for ``idle_timeout_s``.

Commands (every rank gets the same one; every rank answers):
``forward_backward`` / ``forward`` {model_id, shape, datums[, routes][, watch_routes]} -> rows, total_loss, num_tokens,
peak_bytes[, routes] | oom (``routes``: an MoE model's recorded routes per datum, ``r3_codec`` payloads, replayed by
``route_replay``; ``watch_routes``: reply with the ids the routers used per row, recorded when no routes are given);
``optim_step`` {model_id, learning_rate}; ``save_weights_for_sampler`` {model_id, path};
``create_model`` {model_id, lora: [rank, alpha]} -> kind (runtime | adapter), host_bytes | error;
``unload_model`` {model_id} -> kind, host_bytes; ``shutdown``.
Before a per-model command of a model id that is not live the adapter store swaps it in (``adapter_store``); the
reply's ``swap`` says what moved and how long it took (outside the call's memory meter: the copies reuse storage).
An OOM is caught, reported with its attempted size, and the worker carries on with the next command. Under pipeline
parallelism each rank is one stage; a stage whose call another stage failed replies ``peer_failed`` (see
``pipeline_stage``), and every send or receive waits at most the process group's timeout (``idle_timeout_s``).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from skyrl_sim_plugins.megatron_vllm import protocol


def _arch_from_dict(data: dict[str, Any]) -> Any:
    from skyrl_sim.api import LinearAttentionDims, MlaDims, ModelArch, MoeDims

    fields = dict(data)
    fields["layer_types"] = tuple(fields.get("layer_types", ()))
    if fields.get("moe") is not None:
        fields["moe"] = MoeDims(**{**fields["moe"], "moe_layers": tuple(fields["moe"].get("moe_layers", ()))})
    if fields.get("mla") is not None:
        fields["mla"] = MlaDims(**fields["mla"])
    if fields.get("linear_attention") is not None:
        fields["linear_attention"] = LinearAttentionDims(**fields["linear_attention"])
    return ModelArch(**fields)


class Worker:
    """One rank: its models and the command loop."""

    def __init__(self, config: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel

        from skyrl_sim.api import Endpoint
        from skyrl_sim_plugins.megatron_vllm.cpu_shims import apply_cpu_shims

        self.config = config
        self.rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank)
        else:
            # default: the cores this process may use shared evenly by the ranks (TP 2 on 2 cores: one thread each),
            # so ranks do not oversubscribe the cores and call durations measure the work, not the contention
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
            torch.set_num_threads(int(config.get("threads") or 0) or max(1, cores // ranks))
        # every collective and pipeline send or receive waits at most this long (then raises)
        timeout = datetime.timedelta(seconds=float(config.get("idle_timeout_s", 3600)))
        if not cuda:
            from skyrl_sim_plugins.megatron_vllm.memory_meter import single_worker_gloo

            single_worker_gloo()  # a collective's tensors are freed where the caller drops them (the meter's peaks)
        dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=timeout)
        apply_cpu_shims()
        self.endpoint = Endpoint.model_validate(config["endpoint"])
        self.arch = _arch_from_dict(config["arch"])
        self.fsdp = self.endpoint.trainer.strategy == "fsdp"  # SkyRL's FSDP worker: no megatron parallel state
        if self.fsdp:
            torch.manual_seed(int(config["seed"]))
            self.tp_rank, self.dp_rank, self.pp_rank = 0, dist.get_rank(), 0
            self._connect(config)
            return
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.endpoint.parallelism.tp,
            pipeline_model_parallel_size=self.endpoint.parallelism.pp,
            expert_model_parallel_size=self.endpoint.parallelism.ep,  # EP splits the data-parallel ranks' experts
        )
        if self.endpoint.parallelism.pp > 1:
            from skyrl_sim_plugins.megatron_vllm.pipeline_stage import install_cpu_p2p

            install_cpu_p2p()
        tensor_parallel.model_parallel_cuda_manual_seed(int(config["seed"]))
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self._connect(config)

    def _connect(self, config: dict[str, Any]) -> None:
        self.model: Any = None  # the base model with the live adapter (trainer.LoraModel, fsdp_trainer.FsdpModel)
        self.store: Any = None  # its adapter store (adapter_store.AdapterStore)
        self.refused: str | None = None  # why the models loaded at the start do not fit (told in the hello)
        self.sock = socket.create_connection(tuple(config["address"]), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # ------------------------------------------------------------------ setup

    def create_models(self) -> None:
        """The runtime: one base model with its live adapter (its base checkpoint written), warmed up, and the adapter
        store with a slot per model id loaded at the start."""
        from skyrl_sim.api import TenancyError, lora_signature
        from skyrl_sim_plugins.megatron_vllm.adapter_store import AdapterStore
        from skyrl_sim_plugins.megatron_vllm.trainer import LoraModel

        seed, longest = int(self.config["seed"]), int(self.config["max_sequence_length"])
        if self.fsdp:
            from skyrl_sim_plugins.megatron_vllm.fsdp_trainer import FsdpModel

            self.model = FsdpModel(self.arch, self.endpoint, seed, longest)
        else:
            self.model = LoraModel(self.arch, self.endpoint, seed, longest)
        if "linear_attention" not in self.arch.layer_types:  # a hybrid is trained only (hf_export.from_megatron)
            self._save(str(Path(self.config["run_dir"]) / "checkpoints" / "base"))
        self._warm_up(self.model)
        tenancy = self.endpoint.tenancy
        limit = int(tenancy.host_memory_gib * 2**30) if tenancy.host_memory_gib is not None else None
        signature = lora_signature(self.endpoint.lora.rank, self.endpoint.lora.alpha)
        self.store = AdapterStore(self.model.adapter_state(), signature, limit, tenancy.keep_runtime_warm_on_last_unload)
        try:
            for model_id in self.config["model_ids"]:
                self.store.create(model_id, signature)
        except TenancyError as exc:
            self.refused = str(exc)

    def _warm_up(self, model: Any) -> None:
        """One tiny forward_backward so lazily created threads and buffers exist before the memory limit is set."""
        from skyrl_sim.api import MicroBatch, round_up

        tp = self.endpoint.parallelism.tp
        from skyrl_sim.api import CallShape

        dp = self.endpoint.parallelism.dp
        mbs = tuple(MicroBatch(r, (2,), round_up(2, tp), packed=False) for r in range(dp))
        shape = CallShape("forward_backward", 1, dp, dp, 2, (2,) * dp, mbs, 2)
        model.run_pass(shape, [1], forward_only=False)
        model.optimizer.zero_grad()  # gradient buffers stay allocated, as every call finds them

    def hello(self) -> None:
        from skyrl_sim_plugins.megatron_vllm.memory_meter import apply_allocator_settings, apply_memory_limit

        limit = self.config.get("memory_limit_bytes")
        applied = apply_memory_limit(int(limit) if limit else None)
        if self.config.get("allocator_settings"):
            applied = {**applied, **apply_allocator_settings(str(self.config["allocator_settings"]))}
        protocol.send(
            self.sock,
            {
                "hello": True,
                "token": os.environ.get(protocol.TOKEN_ENV, ""),
                "rank": self.rank,
                "tp_rank": self.tp_rank,
                "dp_rank": self.dp_rank,
                "pp_rank": self.pp_rank,
                "pid": os.getpid(),
                "memory": applied,
                "slot_bytes": self.store.slot_bytes,
                "host_bytes": self.store.host_bytes,
                "refused": self.refused,
            },
        )

    # ------------------------------------------------------------------ commands

    def _save(self, path: str) -> None:
        """The live model's weights, LoRA merged, as a Hugging Face checkpoint at ``path`` (rank 0 writes)."""
        import torch.distributed as dist

        from skyrl_sim_plugins.megatron_vllm.hf_export import from_megatron, write_checkpoint

        model = self.model
        if self.fsdp:  # every rank gathers the full weights; rank 0 writes them
            merged = model.merged_state_dict()
            if self.rank == 0:
                write_checkpoint(merged, self.arch, Path(path), model.dtype)
            dist.barrier()
            return
        from megatron.core import parallel_state
        shard = model.merged_shard()
        ep = self.endpoint.parallelism.ep
        if ep > 1:  # every expert, from the expert-parallel ranks that hold them (``hf_export.merge_expert_shards``)
            from skyrl_sim_plugins.megatron_vllm.hf_export import merge_expert_shards

            held: list[Any] = [None] * ep
            dist.all_gather_object(held, shard, group=parallel_state.get_expert_model_parallel_group())
            shard = merge_expert_shards(held, self.arch)
        shards: list[Any] = [None] * self.endpoint.parallelism.tp
        if self.endpoint.parallelism.pp > 1:  # every stage's part, gathered and joined per TP rank
            from skyrl_sim_plugins.megatron_vllm.pipeline_stage import join_stages

            parts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, (self.dp_rank, self.tp_rank, shard))
            shards = join_stages(parts, len(shards))
        elif len(shards) == 1:
            shards[0] = shard
        else:
            dist.all_gather_object(shards, shard, group=parallel_state.get_tensor_model_parallel_group())
        if self.rank == 0:
            write_checkpoint(from_megatron(shards, self.arch), self.arch, Path(path), model.dtype)
        dist.barrier()

    def _pass(self, message: dict[str, Any]) -> dict[str, Any]:
        import torch

        from skyrl_sim.api import attempted_bytes
        from skyrl_sim_plugins.megatron_vllm.batch import shape_from_dict
        from skyrl_sim_plugins.megatron_vllm.failure_site import ModuleScope, failure_site
        from skyrl_sim_plugins.megatron_vllm.memory_meter import (
            CallMemory,
            fsdp_storage_hooks,
            is_oom,
            process_buffers,
        )
        from skyrl_sim_plugins.megatron_vllm.pipeline_stage import PeerStageFailed, StageFailure

        model = self.model
        shape = shape_from_dict(message["shape"])
        forward_only = message["cmd"] == "forward"
        routes = decoded_routes(message.get("routes"))  # R3: the host's copy, decoded before the call's meter
        if not forward_only:
            model.snapshot_grads()  # outside the meter: restoring a failed call is this backend's bookkeeping
        start = time.perf_counter()
        limit = self.config.get("tensor_limit_bytes")  # CPU: the meter refuses what passes it (CUDA: the device does)
        meter = CallMemory([*model.held_tensors(), *process_buffers()], int(limit) if limit else None)
        scope = ModuleScope(model.model)
        stage = StageFailure(meter, scope, model.stage)
        try:
            with meter, scope, fsdp_storage_hooks(meter.meter if self.fsdp else None):
                watch = bool(message.get("watch_routes"))
                result = model.run_pass(
                    shape, list(message["datums"]), forward_only, message.get("rl"), stage.hooks(), routes, watch
                )
        except Exception as exc:  # an OOM is a result; anything else is reported as the call's error
            text = f"{type(exc).__name__}: {exc}"
            reply: dict[str, Any] = {"ok": False, "error": text, "seconds": time.perf_counter() - start}
            reply["peak_bytes"] = stage.peak_bytes or meter.peak_bytes or (meter.meter.peak_bytes if meter.meter else None)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # hand the failed call's cached blocks back before the next call
            if isinstance(exc, PeerStageFailed):
                reply["peer_failed"] = True
            elif is_oom(exc):
                refusal = meter.meter.refusal if meter.meter else None
                site = stage.site if stage.site is not None else failure_site(exc, scope.current, refusal)
                reply["oom"] = {"attempted_bytes": attempted_bytes(text), "message": text, **site}
                if model.stage is not None:
                    reply["oom"]["pp_stage"] = model.stage.index
                    reply["failed_at"] = stage.failed_at
            else:
                reply["traceback"] = traceback.format_exc(limit=6)
            return reply
        return {
            "ok": True,
            "seconds": time.perf_counter() - start,
            "peak_bytes": meter.peak_bytes,
            "rows": {str(k): v for k, v in result.rows.items()},
            "total_loss": result.total_loss,
            "num_tokens": result.num_tokens,
            "entropy": result.entropy,
            **({"routes": encoded_routes(result.routes)} if result.routes else {}),
        }

    def _lifecycle(self, message: dict[str, Any]) -> dict[str, Any]:
        """``create_model`` / ``unload_model``: a slot registered or freed (SkyRL's refusals are the reply's error)."""
        from skyrl_sim.api import TenancyError, lora_signature

        model_id = str(message["model_id"])
        if message["cmd"] == "unload_model":
            kind = self.store.unload(model_id)
        else:
            try:
                kind = self.store.create(model_id, lora_signature(*message["lora"]))
            except TenancyError as exc:
                return {"ok": False, "error": str(exc), "host_bytes": self.store.host_bytes}
        return {"ok": True, "kind": kind, "host_bytes": self.store.host_bytes}

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        cmd = message.get("cmd")
        if cmd in ("create_model", "unload_model"):
            return self._lifecycle(message)
        model_id = message.get("model_id")
        if cmd in ("forward_backward", "forward", "optim_step", "save_weights_for_sampler"):
            if model_id not in self.store.slots:
                return {"ok": False, "error": f"Model {model_id} not loaded"}
            swap = self.store.swap_to(str(cmd), str(model_id))  # before the call, as ensure_active_adapter
            reply = self._run(message)
            reply["swap"] = swap
            return reply
        if cmd == "crash":  # test hook: die like a killed worker would
            os._exit(int(message.get("code", 17)))
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    def _run(self, message: dict[str, Any]) -> dict[str, Any]:
        """One per-model command on the live adapter."""
        cmd = message["cmd"]
        if cmd in ("forward_backward", "forward"):
            return self._pass(message)
        if cmd == "optim_step":
            metrics = self.model.optim_step(float(message["learning_rate"]))
            return {"ok": True, "metrics": metrics}
        self._save(message["path"])
        return {"ok": True, "path": message["path"]}

    def serve(self) -> None:
        idle = float(self.config.get("idle_timeout_s", 3600))
        while True:
            try:
                message = protocol.recv(self.sock, idle)
            except protocol.ProtocolError:
                return  # the parent is gone or silent: exit
            if message.get("cmd") == "shutdown":
                protocol.send(self.sock, {"ok": True})
                return
            if message.get("cmd") == "crash" and int(message.get("rank", 0)) != self.rank:
                protocol.send(self.sock, {"ok": True})
                continue
            protocol.send(self.sock, self.handle(message))


def decoded_routes(payloads: list[Any] | None) -> list[Any] | None:
    """Each datum's recorded routes from the wire (``r3_codec``'s strict decoder; None where a datum has none)."""
    if payloads is None:
        return None
    from skyrl_sim.api import r3_codec

    return [None if p is None else r3_codec.decode_routes(p) for p in payloads]


def encoded_routes(routes: dict[int, Any]) -> dict[str, Any]:
    """The ids the routers used, per row index of the call, on the wire (``r3_codec``)."""
    from skyrl_sim.api import r3_codec

    return {str(index): r3_codec.encode_routes(ids) for index, ids in sorted(routes.items())}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m skyrl_sim_plugins.megatron_vllm.worker CONFIG.json", file=sys.stderr)
        return 2
    config = json.loads(Path(args[0]).read_text())
    worker = Worker(config)
    worker.create_models()
    worker.hello()
    try:
        worker.serve()
    finally:
        worker.sock.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
