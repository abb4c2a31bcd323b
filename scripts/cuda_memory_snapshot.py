"""CUDA allocator snapshot of single real-backend calls, lined up with the simulator's walk of the same calls.

    python3 scripts/cuda_memory_snapshot.py OUT_DIR [--endpoint mid-cuda] [--calls 1x3694,1x5364,1x3694,4x2000]

Builds the real backend's ``LoraModel`` for the endpoint on one GPU (NCCL, TP 1) and runs each call (ROWSxLENGTH,
in order, in one process, so megatron's persistent buffers carry from call to call as in a service) under
``torch.cuda.memory._record_memory_history``. It replays the allocator trace to the call's peak and writes, per call,
the live allocations at the peak with their Python frames, beside the walk's peak and breakdown for the same shape and
carried state: ``OUT_DIR/snapshot_report.json`` and a printed summary. This is how the walk's CUDA terms (megatron's
fp32 softmax copies, PyTorch's softmax-backward temporary, the global scores buffer) were found; run it again when
a new kernel or stack version is suspected of changing what a call holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KEEP = ("megatron", "skyrl_sim", "torch/nn", "torch/autograd", "torch/utils/checkpoint")


def frames_of(frames: list[dict[str, Any]]) -> list[str]:
    """The project's, megatron's and torch's frames of an allocation, innermost first, as file:line:function."""
    sites = []
    for frame in frames:
        name = frame["filename"]
        if any(k in name for k in KEEP):
            short = name.split("site-packages/")[-1]
            sites.append(f"{short}:{frame['line']}:{frame['name']}")
    return sites[:5]


def live_at_peak(snapshot: dict[str, Any], base: int) -> tuple[int, dict[int, tuple[int, list[str]]]]:
    """Replay the device trace: the highest total and the allocations alive at that moment."""
    current, best, live, at_peak = base, base, {}, {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            current += event["size"]
            live[event["addr"]] = (event["size"], frames_of(event.get("frames", [])))
            if current > best:
                best, at_peak = current, dict(live)
        elif event["action"] == "free_completed":
            current -= event["size"]
            live.pop(event["addr"], None)
    return best, at_peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder for snapshot_report.json")
    parser.add_argument("--endpoint", default="mid-cuda")
    parser.add_argument("--calls", default="1x3694,1x5364,1x3694,4x2000", help="ROWSxLENGTH,... run in order")
    parser.add_argument("--top", type=int, default=40, help="allocations listed per call")
    args = parser.parse_args(argv)
    calls = [tuple(int(x) for x in item.split("x")) for item in args.calls.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from skyrl_sim_plugins.megatron_vllm.single_rank import init_single_rank_group

    if not torch.cuda.is_available():
        print("cuda_memory_snapshot: no CUDA device", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    init_single_rank_group("nccl")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    from skyrl_sim.engine.shapes import MEGATRON, shape_call
    from skyrl_sim.plugin_host.costs import CarriedMemory
    from skyrl_sim.schema.scenario import load_scenario
    from skyrl_sim_plugins.megatron_vllm.trainer import LoraModel
    from skyrl_sim_plugins.sim.bound.memory import AllocationWalk

    variant = load_scenario(ROOT / "scenarios" / "queue_drain_17_tiny.yaml", args.endpoint).resolve("cap-aware")
    endpoint, arch = variant.endpoint, variant.model
    model = LoraModel(arch, endpoint, 0, max(length for _, length in calls) + 8)
    walk, carried = AllocationWalk(), CarriedMemory()
    report: list[dict[str, Any]] = []
    for rows, length in calls:
        lengths = [length] * rows
        shape = shape_call("forward_backward", lengths, endpoint, MEGATRON)
        modelled = walk.evaluate(shape, endpoint, arch, carried)
        carried = modelled.carried
        item: dict[str, Any] = {"rows": rows, "length": length, "width": shape.width}
        try:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=400000)
            model.run_pass(shape, lengths, forward_only=False)
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            replayed, at_peak = live_at_peak(snapshot, base)
            top = sorted(at_peak.values(), key=lambda x: -x[0])[: args.top]
            item |= {
                "base_allocated": base,
                "real_peak": int(torch.cuda.max_memory_allocated()),
                "replayed_peak": replayed,
                "walk_peak": modelled.peak_bytes,
                "walk_breakdown": modelled.breakdown,
                "top_live_at_peak": [{"bytes": size, "frames": frames} for size, frames in top],
            }
            error = (modelled.peak_bytes - item["real_peak"]) / item["real_peak"]
            print(
                f"{rows}x{length}: real {item['real_peak'] / 2**30:.2f} GiB, walk {modelled.peak_bytes / 2**30:.2f} GiB "
                f"({error:+.1%})"
            )
            for size, frames in top[:8]:
                print(f"   {size / 2**30:8.3f} GiB  {frames[:2]}")
        except Exception:  # a failed call is reported and the next one still runs
            item["error"] = traceback.format_exc(limit=4)
            torch.cuda.memory._record_memory_history(enabled=None)
            torch.cuda.empty_cache()
            print(item["error"], file=sys.stderr)
        report.append(item)
        (out / "snapshot_report.json").write_text(json.dumps(report, default=str, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
