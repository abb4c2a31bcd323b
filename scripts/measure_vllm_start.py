"""Measure vLLM's start step by step and compare it with the simulator's start (``vllm_startup``), no override.

    flock /work/locks/heavy.lock .venv/bin/python scripts/measure_vllm_start.py          # -> validation/vllm-start-cpu/
    python scripts/measure_vllm_start.py --device cuda --out DIR                        # a GPU with vLLM (gpu_check.sh)

vLLM runs in this process (``LLM``, the ``uni`` executor, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on a Llama-layout
model written here (``hf_export``: seeded fp32 weights, ~100 M parameters so the weights stand out of the process's
noise). ``VLLM_CPU_KVCACHE_SPACE`` is unset and no block count is given: the KV cache is what vLLM derives from
``gpu_memory_utilization`` (``cpu_worker.py``: ``determine_available_memory``: ``ceil(utilization x the NUMA node's
memory)`` less the process's resident set), the path the sampling validation never took (it sets the KV size).

Each of the worker's start methods is wrapped (``init_device``, ``load_model``, ``determine_available_memory``,
``initialize_from_config``, ``compile_or_warm_up_model``): the resident set before and after and the peak in between
(``VmHWM``, reset through ``/proc/self/clear_refs`` before each step). The KV cache's bytes and block count are vLLM's
own (the value ``determine_available_memory`` returns, ``kv_cache_config.num_blocks``).

The model's side is ``vllm_start`` on the same settings with the CPU profile, the node's memory as the device's and
two values of ``hardware.reserve_gib`` (the worker's own resident memory, which vLLM's CPU budget counts): the CPU
endpoints' 0, and the resident set vLLM measured before loading the weights.

Not measured on CPU (vllm-cpu cannot): CUDA graphs, the sampler warm-up (the CPU worker has none), the V2 model
runner (it needs Triton's GPU backend), sleep mode. The compiled (non-eager) start needs Inductor's C++ toolchain and
is not run: eager mode has no profile run on CPU (``warming_up_model`` returns at once).

``--device cuda`` (``scripts/gpu_check.sh``, CHECKS=vllm-start) starts vLLM on the GPU with the Qwen3-0.6B shape
(bf16, written here: no model hub) and records each step's ``torch.cuda`` counters (the peak allocated and reserved
since the step began, the device's free memory before and after), the CUDA-graph capture and the sampler warm-up
included (``capture_model``, ``warmup_kernels`` / ``_dummy_sampler_run``), beside the model's steps on the same
device. Not yet run: no GPU with vLLM has been lent to this project.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "validation" / "vllm-start-cpu"
MODEL = {
    "preset": "tiny-dense",
    "name": "llama-100m",
    "hidden_size": 1024,
    "ffn_hidden_size": 2816,
    "num_layers": 8,
    "num_attention_heads": 16,
    "num_kv_heads": 4,
    "head_dim": 64,
    "vocab_size": 32000,
    "tied_embeddings": True,
}
STEPS = ("init_device", "load_model", "determine_available_memory", "initialize_from_config", "compile_or_warm_up_model")


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def wrap_worker(records: list[dict[str, Any]]) -> None:
    """Record the resident set around each start method of vLLM's CPU worker."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    for name in STEPS:
        original = getattr(CPUWorker, name)

        def wrapped(self: Any, *args: Any, __original: Any = original, __name: str = name, **kwargs: Any) -> Any:
            reset_peak()
            before = status_kib("VmRSS") * 1024
            value = __original(self, *args, **kwargs)
            record = {
                "step": __name,
                "rss_before": before,
                "rss_after": status_kib("VmRSS") * 1024,
                "rss_peak": status_kib("VmHWM") * 1024,
            }
            if __name == "determine_available_memory":
                record["kv_cache_bytes"] = int(value)
                record["requested_bytes"] = int(self.requested_cpu_memory)
            if __name == "initialize_from_config":
                record["num_blocks"] = int(args[0].num_blocks)
                record["page_bytes"] = int(args[0].kv_cache_tensors[0].size // args[0].num_blocks)
            records.append(record)
            return value

        setattr(CPUWorker, name, wrapped)


def write_model(directory: Path) -> Any:
    import torch

    from skyrl_sim.schema.architecture import resolve_model
    from skyrl_sim_plugins.megatron_vllm.hf_export import init_hf_weights, write_checkpoint

    arch = resolve_model(MODEL, Path("."))
    write_checkpoint(init_hf_weights(arch, seed=0), arch, directory, torch.float32)
    return arch


def model_side(arch: Any, utilization: float, node_total: int, reserve: int) -> dict[str, Any]:
    """The simulator's start on the same settings (CPU profile, the node's memory as the device's)."""
    from skyrl_sim.schema.endpoint import Endpoint
    from skyrl_sim_plugins.sim.service.inference.vllm_startup import vllm_start

    endpoint = Endpoint.model_validate(
        {
            "name": "vllm-start-cpu",
            "model": MODEL,
            "hardware": {"profile": "cpu", "devices": 1, "device_memory_gib": node_total / 2**30,
                         "reserve_gib": reserve / 2**30},
            "inference": {"gpu_memory_utilization": utilization, "model_dtype": "float32", "enforce_eager": True,
                          "vllm_version": "0.32.0"},
        }
    )
    start = vllm_start(endpoint, arch, node_total)
    return {
        "reserve_bytes": reserve,
        "requested_bytes": start.requested,
        "weights_bytes": start.weights,
        "kv_cache_bytes": start.kv_bytes if start.kv is not None else 0,
        "num_blocks": start.kv.num_blocks if start.kv is not None else 0,
        "bytes_per_block": start.kv.bytes_per_block if start.kv is not None else 0,
        "steps": [s.name for s in start.steps],
    }


QWEN3_06B = {
    "preset": "tiny-dense",
    "name": "qwen3-0.6b-shape",
    "hidden_size": 1024,
    "ffn_hidden_size": 3072,
    "num_layers": 28,
    "num_attention_heads": 16,
    "num_kv_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tied_embeddings": True,
}


def cuda_counters() -> dict[str, int]:
    import torch

    free, total = torch.cuda.mem_get_info()
    return {
        "free": int(free),
        "total": int(total),
        "allocated": int(torch.cuda.memory_allocated()),
        "reserved": int(torch.cuda.memory_reserved()),
    }


def wrap_cuda(records: list[dict[str, Any]]) -> None:
    """Record ``torch.cuda`` counters around each start step of vLLM's GPU worker, the capture and the warm-up."""
    import torch
    from vllm.v1.worker import gpu_worker

    targets: list[tuple[Any, str, str]] = [(gpu_worker.Worker, name, name) for name in STEPS]
    try:
        from vllm.v1.worker.gpu import model_runner as v2

        targets.append((v2.GPUModelRunner, "capture_model", "capture_model (V2)"))
    except ImportError:
        pass
    from vllm.v1.worker import gpu_model_runner as v1

    targets += [(v1.GPUModelRunner, "capture_model", "capture_model (V1)"),
                (v1.GPUModelRunner, "_dummy_sampler_run", "sampler (V1)")]
    for owner, name, label in targets:
        original = getattr(owner, name)

        def wrapped(*args: Any, __original: Any = original, __label: str = label, **kwargs: Any) -> Any:
            torch.cuda.reset_peak_memory_stats()
            before = cuda_counters()
            try:
                return __original(*args, **kwargs)
            finally:
                after = cuda_counters()
                records.append({
                    "step": __label,
                    "before": before,
                    "after": after,
                    "peak_allocated": int(torch.cuda.max_memory_allocated()),
                    "peak_reserved": int(torch.cuda.max_memory_reserved()),
                })

        setattr(owner, name, wrapped)
    if hasattr(gpu_worker, "warmup_kernels"):
        original_warmup = gpu_worker.warmup_kernels

        def warmup(*args: Any, **kwargs: Any) -> Any:
            torch.cuda.reset_peak_memory_stats()
            before = cuda_counters()
            try:
                return original_warmup(*args, **kwargs)
            finally:
                records.append({"step": "warmup_kernels (V2)", "before": before, "after": cuda_counters(),
                                "peak_allocated": int(torch.cuda.max_memory_allocated()),
                                "peak_reserved": int(torch.cuda.max_memory_reserved())})

        gpu_worker.warmup_kernels = warmup


def measure_cuda(args: argparse.Namespace) -> int:
    """vLLM's start on the GPU, step by step, beside the model's (no override)."""
    import torch

    if not torch.cuda.is_available():
        print("measure_vllm_start: no CUDA device")
        return 2
    try:
        import vllm
    except ImportError:
        print("measure_vllm_start: vLLM is not installed here: nothing measured")
        return 3
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    records: list[dict[str, Any]] = []
    wrap_cuda(records)
    from vllm import LLM

    from skyrl_sim.schema.architecture import resolve_model
    from skyrl_sim.schema.endpoint import Endpoint
    from skyrl_sim_plugins.megatron_vllm.hf_export import init_hf_weights, write_checkpoint
    from skyrl_sim_plugins.sim.service.inference.vllm_startup import vllm_start

    arch = resolve_model(QWEN3_06B, Path("."))
    free0, total = torch.cuda.mem_get_info()
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(init_hf_weights(arch, seed=0), arch, Path(tmp), torch.bfloat16)
        llm = LLM(model=tmp, skip_tokenizer_init=True, dtype="bfloat16", gpu_memory_utilization=args.utilization,
                  distributed_executor_backend="uni", max_num_seqs=1024, max_num_batched_tokens=8192, seed=0)
        del llm
    init = next((r for r in records if r["step"] == "init_device"), None)
    context = int(total - init["after"]["free"]) if init else 0
    version = ".".join(vllm.__version__.split(".")[:3])
    endpoint = Endpoint.model_validate({
        "name": "vllm-start-cuda", "model": QWEN3_06B,
        "hardware": {"profile": "h100", "devices": 1, "device_memory_gib": total / 2**30, "reserve_gib": context / 2**30},
        "inference": {"gpu_memory_utilization": args.utilization, "vllm_version": version},
    })
    start = vllm_start(endpoint, arch, int(total))
    summary = {
        "written": datetime.now(UTC).isoformat(timespec="seconds"),
        "vllm": vllm.__version__,
        "device": torch.cuda.get_device_name(),
        "free_before_start": int(free0),
        "measured": records,
        "model": start.as_dict(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for r in records:
        print(f"{r['step']:<30} peak allocated {r['peak_allocated'] / 2**30:7.2f} GiB, free "
              f"{r['before']['free'] / 2**30:7.2f} -> {r['after']['free'] / 2**30:7.2f} GiB")
    for step in start.steps:
        print(f"model {step.name:<24} held {step.held / 2**30:7.2f} GiB, live+attempt "
              f"{(step.live + step.attempt) / 2**30:7.2f} GiB, in budget {step.in_budget}")
    return 0


def markdown(summary: dict[str, Any]) -> str:
    """``summary.md``: the steps vLLM ran and the KV path, measured against the model's."""
    m = summary["measured"]
    mib = 2**20
    lines = [
        "# vLLM's start on CPU against the simulator's (no override)",
        "",
        f"Written by `scripts/measure_vllm_start.py` at {summary['written']} ({summary['machine']['platform']}, "
        f"Python {summary['machine']['python']}): vllm-cpu in process, eager, `gpu_memory_utilization` "
        f"{m['utilization']}, no `VLLM_CPU_KVCACHE_SPACE`, a {summary['model']['name']} Llama in fp32.",
        "",
        "| worker step | resident before MiB | after MiB | peak MiB |",
        "|---|---|---|---|",
    ]
    for r in m["steps"]:
        lines.append(
            f"| `{r['step']}` | {r['rss_before'] / mib:,.0f} | {r['rss_after'] / mib:,.0f} | {r['rss_peak'] / mib:,.0f} |"
        )
    lines += ["", "| | vLLM | model, reserve_gib 0 | model, reserve_gib = the resident set before the weights |",
              "|---|---|---|---|"]
    a, b = summary["model_side"]["reserve_0"], summary["model_side"]["reserve_measured"]
    lines += [
        f"| budget bytes | {m['requested_bytes']:,} | {a['requested_bytes']:,} | {b['requested_bytes']:,} |",
        f"| weights bytes | {m['weights_rss_bytes']:,} (resident growth) | {a['weights_bytes']:,} "
        f"| {b['weights_bytes']:,} |",
        f"| KV cache bytes | {m['kv_cache_bytes']:,} | {a['kv_cache_bytes']:,} | {b['kv_cache_bytes']:,} |",
        f"| bytes per block | {m['page_bytes']:,} | {a['bytes_per_block']:,} | {b['bytes_per_block']:,} |",
        f"| blocks | {m['num_blocks']:,} | {a['num_blocks']:,} | {b['num_blocks']:,} |",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--markdown-only", action="store_true", help="rewrite summary.md from summary.json")
    parser.add_argument("--utilization", type=float, default=None)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.markdown_only:
        (args.out / "summary.md").write_text(markdown(json.loads((args.out / "summary.json").read_text())))
        return 0
    if args.device == "cuda":
        args.utilization = args.utilization or 0.8
        return measure_cuda(args)
    args.utilization = args.utilization or 0.12
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    records: list[dict[str, Any]] = []
    wrap_worker(records)
    from vllm import LLM
    from vllm.utils.cpu_resource_utils import get_memory_node_info

    with tempfile.TemporaryDirectory() as tmp:
        arch = write_model(Path(tmp))
        llm = LLM(
            model=tmp,
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            gpu_memory_utilization=args.utilization,
            distributed_executor_backend="uni",
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            max_model_len=2048,
            seed=0,
        )
        del llm
    node = get_memory_node_info(0)
    by_step = {r["step"]: r for r in records}
    measured = {
        "node_total_bytes": int(node.total_memory),
        "utilization": args.utilization,
        "steps": records,
        "weights_rss_bytes": by_step["load_model"]["rss_after"] - by_step["load_model"]["rss_before"],
        "process_rss_before_weights": by_step["load_model"]["rss_before"],
        "consumed_rss_at_kv_sizing": by_step["determine_available_memory"]["rss_before"],
        "kv_cache_bytes": by_step["determine_available_memory"]["kv_cache_bytes"],
        "requested_bytes": by_step["determine_available_memory"]["requested_bytes"],
        "num_blocks": by_step["initialize_from_config"]["num_blocks"],
        "page_bytes": by_step["initialize_from_config"]["page_bytes"],
        "kv_allocation_rss_bytes": by_step["initialize_from_config"]["rss_after"]
        - by_step["initialize_from_config"]["rss_before"],
    }
    models = {
        "reserve_0": model_side(arch, args.utilization, node.total_memory, 0),
        "reserve_measured": model_side(arch, args.utilization, node.total_memory, measured["process_rss_before_weights"]),
    }
    summary = {
        "written": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
        "model": MODEL,
        "measured": measured,
        "model_side": models,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "summary.md").write_text(markdown(summary))
    print(json.dumps({"measured": {k: v for k, v in measured.items() if k != "steps"}, "model": models}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
