"""The classic caching allocator model against ``torch.cuda``: the same allocation sequences, reserved bytes step by step.

Each sequence is a list of operations: ``["malloc", id, nbytes]``, ``["free", id]``, ``["empty_cache"]``. The model
(``sim.reference.caching_allocator.CachingAllocator``) and PyTorch's own allocator (``torch.empty`` of ``nbytes``
bytes, ``del``, ``torch.cuda.empty_cache()``, with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False``) replay it,
and after every operation ``memory_reserved()`` and ``memory_allocated()`` are compared with the model's reserve and
allocated bytes; an out-of-memory error must come at the same operation. The device's own limit is not deterministic
(the driver's share, other processes), so a sequence that should run out sets a memory fraction
(``torch.cuda.set_per_process_memory_fraction``, the model's ``memory_fraction_bytes``): that check is the
allocator's, before any ``cudaMalloc``.

The sequences: the rule cases of ``tests/test_caching_allocator.py`` and one rank's allocations over calls of the
``mid-cuda`` endpoint (8 of Qwen3-8B's layers) at varying lengths, as the simulator's walk orders them.

Usage: ``python scripts/gpu_check_allocator.py --out DIR`` (on CUDA: both sides, ``allocator_check.json`` in DIR, exit
1 on a mismatch); ``--model-only`` writes the model's side without torch (a rehearsal on any machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

if "--model-only" not in sys.argv:  # before torch is imported by anything: the classic allocator, no expandable segments
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from skyrl_sim_plugins.sim.reference.caching_allocator import (  # noqa: E402
    AllocatorSettings,
    CachingAllocator,
    CachingAllocatorOutOfMemory,
)

MIB = 1 << 20
BIG = 1 << 50  # the model's device: room for anything (the fraction, when set, is the limit)


def rule_sequences() -> dict[str, dict[str, Any]]:
    """The worked examples of tests/test_caching_allocator.py as operation lists."""

    def slivers() -> list[list[Any]]:
        ops: list[list[Any]] = []
        for i, rows in enumerate((40, 44, 48, 52, 56)):
            ops += [["malloc", f"a{i}", rows * MIB], ["free", f"a{i}"], ["malloc", f"k{i}", rows // 2 * MIB]]
            ops.append(["empty_cache"])
        return ops + [["malloc", "big", 200 * MIB]]

    def vllm_pr41268() -> list[list[Any]]:  # vLLM PR #41268: 530 MiB buffers freed, 270 MiB weights kept
        ops: list[list[Any]] = []
        for i in range(6):
            ops += [["malloc", f"w13_{i}", 530 * MIB], ["free", f"w13_{i}"], ["malloc", f"w2_{i}", 270 * MIB]]
        return ops

    return {
        "vllm_pr41268_split": {"ops": vllm_pr41268()},
        "small_pool_packing": {"ops": [["malloc", f"s{i}", 512 * 1024] for i in range(4)] + [["malloc", "s4", 1]]},
        "split_20_mib": {"ops": [["malloc", "a", 3 * MIB], ["malloc", "b", 5 * MIB]]},
        "no_split_under_1_mib": {"ops": [["malloc", "a", 11 * MIB]]},
        "best_fit": {
            "ops": [
                ["malloc", "big", 50 * MIB],
                ["malloc", "small", 30 * MIB],
                ["free", "big"],
                ["free", "small"],
                ["malloc", "again", 25 * MIB],
            ]
        },
        "merge_and_empty_cache": {
            "ops": [["malloc", "a", 3 * MIB], ["malloc", "b", 4 * MIB], ["free", "a"], ["free", "b"], ["empty_cache"]]
        },
        "empty_cache_keeps_split": {"ops": [["malloc", "a", 3 * MIB], ["empty_cache"]]},
        "slivers_across_calls": {"ops": slivers(), "fraction_bytes": 400 * MIB},
        # last: PyTorch cannot set max_split_size back to unlimited in the same process
        "vllm_pr41268_max_split_20": {"ops": vllm_pr41268(), "max_split_mb": 20},
    }


def walk_sequences(calls: int = 4) -> dict[str, dict[str, Any]]:
    """One rank's allocations over ``calls`` forward_backward calls of varying lengths on the mid-cuda endpoint, in
    the walk's order, with SkyRL's empty_cache after each (the call sequence the classic replay runs)."""
    lengths = [[2000, 3100], [4000, 1200, 2600], [5200, 800], [3000, 3000, 3000]][:calls]
    return {"mid_cuda_calls": {"ops": call_operations("mid-cuda", lengths)}}


def call_operations(endpoint_name: str, calls: list[list[int]]) -> list[list[Any]]:
    """Rank 0's allocations and frees over forward_backward calls of these datum lengths, in the walk's order, the
    static memory first and ``empty_cache`` after each call; frees matched as ``RankAllocator`` matches them."""
    from skyrl_sim.engine.shapes import MEGATRON, shape_call
    from skyrl_sim.plugin_host.costs import CarriedMemory
    from skyrl_sim.schema.architecture import resolve_model
    from skyrl_sim.schema.endpoint import Endpoint
    from skyrl_sim.schema.endpoint_files import load_endpoint
    from skyrl_sim_plugins.sim.bound.classic_allocator import rank_call_steps
    from skyrl_sim_plugins.sim.bound.memory import AllocationWalk
    from skyrl_sim_plugins.sim.reference.static_memory import static_bytes

    data, path = load_endpoint(endpoint_name, ROOT / "scenarios" / "queue_drain_17.yaml")
    endpoint = Endpoint.model_validate(data)
    model = resolve_model(endpoint.model, Path(path).parent)
    ops: list[list[Any]] = []
    live: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    serial = 0

    def malloc(key: str, nbytes: int) -> None:
        nonlocal serial
        serial += 1
        name = f"t{serial}"
        live.setdefault(key, []).append(name)
        sizes[name] = nbytes
        ops.append(["malloc", name, nbytes])

    walk = AllocationWalk().bind(endpoint, model)
    carried = CarriedMemory()
    for part, nbytes in static_bytes(model, endpoint).items():
        if nbytes > 0:
            malloc(f"static:{part}", nbytes)
    for lengths in calls:
        shape = shape_call("forward_backward", lengths, endpoint, MEGATRON)
        steps, _ = rank_call_steps(walk, shape, 0, carried.held(0))
        carried = walk.evaluate(shape, carried).carried  # megatron's buffers, for the next call
        for item in steps:
            step = item.step
            if step.nbytes > 0:
                malloc(step.key, step.nbytes)
            elif step.nbytes < 0:
                name = release(live, sizes, step.key, -step.nbytes)
                if name is not None:  # a free of nothing live is skipped, as RankAllocator skips it
                    ops.append(["free", name])
        ops.append(["empty_cache"])
    return ops


def release(live: dict[str, list[str]], sizes: dict[str, int], key: str, nbytes: int) -> str | None:
    """The live tensor a free releases, as ``RankAllocator._release`` picks it: the latest of its key and size, else
    the latest of its size under any key."""
    for names in (live.get(key, []), *live.values()):
        for i in range(len(names) - 1, -1, -1):
            if sizes[names[i]] == nbytes:
                return names.pop(i)
    return None


def model_side(ops: list[list[Any]], fraction_bytes: int | None, max_split_mb: int | None) -> list[dict[str, Any]]:
    """The model's reserve and allocated bytes after each operation (``oom`` where it raises)."""
    split = max_split_mb * MIB if max_split_mb is not None else None
    allocator = CachingAllocator(BIG, AllocatorSettings(max_split_size=split, memory_fraction_bytes=fraction_bytes))
    live: dict[str, Any] = {}
    rows = []
    for op in ops:
        oom = False
        if op[0] == "malloc":
            try:
                live[op[1]] = allocator.malloc(op[2])
            except CachingAllocatorOutOfMemory:
                oom = True
        elif op[0] == "free":
            allocator.free(live.pop(op[1]))
        else:
            allocator.empty_cache()
        rows.append({"reserved": allocator.reserved, "allocated": allocator.allocated, "oom": oom})
        if oom:
            break
    return rows


def torch_side(ops: list[list[Any]], fraction_bytes: int | None, max_split_mb: int | None) -> list[dict[str, Any]]:
    """PyTorch's reserve and allocated bytes after each operation, on the current CUDA device."""
    import torch

    if max_split_mb is not None:
        torch.cuda.memory._set_allocator_settings(f"max_split_size_mb:{max_split_mb}")

    torch.cuda.empty_cache()
    base_reserved, base_allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    if base_reserved:
        raise SystemExit("gpu_check_allocator: the allocator is not empty at the start of a sequence")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(fraction_bytes / total if fraction_bytes else 1.0)
    live: dict[str, Any] = {}
    rows = []
    for op in ops:
        oom = False
        if op[0] == "malloc":
            try:
                live[op[1]] = torch.empty(op[2], dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError:
                oom = True
        elif op[0] == "free":
            del live[op[1]]
        else:
            torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved() - base_reserved
        allocated = torch.cuda.memory_allocated() - base_allocated
        rows.append({"reserved": reserved, "allocated": allocated, "oom": oom})
        if oom:
            break
    live.clear()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
    return rows


def compare(model: list[dict[str, Any]], measured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operations where the two sides differ."""
    out = []
    for i in range(max(len(model), len(measured))):
        a = model[i] if i < len(model) else None
        b = measured[i] if i < len(measured) else None
        if a != b:
            out.append({"op": i, "model": a, "torch": b})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    parser.add_argument("--model-only", action="store_true", help="the model's side only (no torch, no CUDA)")
    parser.add_argument("--calls", type=int, default=4, help="mid-cuda calls to replay")
    args = parser.parse_args()
    rules = rule_sequences()
    last = {name: rules.pop(name) for name in [n for n, seq in rules.items() if "max_split_mb" in seq]}
    sequences = {**rules, **walk_sequences(args.calls), **last}  # max_split_size cannot be unset: those run last
    report: dict[str, Any] = {"sequences": {}}
    mismatches = 0
    for name, sequence in sequences.items():
        ops, fraction, split = sequence["ops"], sequence.get("fraction_bytes"), sequence.get("max_split_mb")
        entry: dict[str, Any] = {"operations": len(ops), "model": model_side(ops, fraction, split)}
        if not args.model_only:
            entry["torch"] = torch_side(ops, fraction, split)
            entry["mismatches"] = compare(entry["model"], entry["torch"])
            mismatches += len(entry["mismatches"])
            print(f"{name}: {len(ops)} operations, {len(entry['mismatches'])} mismatches", flush=True)
        else:
            last = entry["model"][-1]
            print(f"{name}: {len(ops)} operations, model ends at {last['reserved']} reserved (oom {last['oom']})")
        report["sequences"][name] = entry
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "allocator_check.json").write_text(json.dumps(report))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
