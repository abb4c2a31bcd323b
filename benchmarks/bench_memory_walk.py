"""How long the allocation walk takes on the seed's largest call: the 193-request drain (208 rows, 13 micro-batches
x 64 layers, width 35,001) on the seed endpoint. Target: under 0.5 s per call. Then two MoE calls: moe_r3's on
Qwen3.6-35B-A3B (TransformerEngine's grouped experts) and moe_r3_tiny's two-micro-batch call on tiny-moe-cpu (the local
spec's experts one by one).

Prints the cold time (the op step arrays compiled for each micro-batch shape), the warm time (step arrays cached), and the
time of a walk that must cover all 13 micro-batches (capacity raised so nothing stops it early).

    .venv/bin/python benchmarks/bench_memory_walk.py
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.units import GIB
from skyrl_sim_plugins.sim.bound.memory import AllocationWalk

ROOT = Path(__file__).resolve().parent.parent


def lengths_193() -> list[int]:
    text = (ROOT / "scenarios" / "queue_drain_193.yaml").read_text()
    block = text[text.index("lengths: [") : text.index("]", text.index("lengths: ["))]
    return [int(x) for x in re.findall(r"\d+", block)]


def timed(walk: AllocationWalk, shape: object, endpoint: object, model: object) -> tuple[float, object]:
    start = time.perf_counter()
    report = walk.evaluate(shape, endpoint, model)  # type: ignore[arg-type]
    return time.perf_counter() - start, report


def main() -> None:
    variant = load_scenario(ROOT / "scenarios" / "queue_drain_193.yaml").resolve("no-cap")
    endpoint, model = variant.endpoint, variant.model
    lengths = lengths_193()
    shape = shape_call("forward_backward", lengths, endpoint, MEGATRON)
    print(f"call: {shape.rows} rows -> {shape.padded_rows}, width {shape.width:,}, {len(shape.microbatches)} micro-batches")
    walk = AllocationWalk()
    cold, report = timed(walk, shape, endpoint, model)
    warm, _ = timed(walk, shape, endpoint, model)
    oom = report.oom  # type: ignore[attr-defined]
    print(f"seed endpoint: cold {cold * 1000:.1f} ms, warm {warm * 1000:.1f} ms; OOM at {oom.where if oom else None}")
    roomy = endpoint.model_copy(deep=True)
    roomy.hardware.device_memory_gib = 100_000.0
    walk = AllocationWalk()
    cold, report = timed(walk, shape, roomy, model)
    warm, _ = timed(walk, shape, roomy, model)
    peak = report.peak_bytes / GIB  # type: ignore[attr-defined]
    print(f"all 13 micro-batches: cold {cold * 1000:.1f} ms, warm {warm * 1000:.1f} ms; peak {peak:.2f} GiB")
    print("target: < 500 ms per call:", "met" if cold < 0.5 else "NOT met")
    moe_call()
    local_moe_call()


def local_moe_call() -> None:
    """The local spec's MoE walk: moe_r3_tiny's last forward_backward on tiny-moe-cpu (5 rows -> 8, 2 micro-batches,
    8 experts one by one per layer, replay compact)."""
    variant = load_scenario(ROOT / "scenarios" / "moe_r3_tiny.yaml").resolve("compact")
    shape = shape_call("forward_backward", [400, 380, 350, 300, 40], variant.endpoint, MEGATRON)
    walk = AllocationWalk()
    cold, report = timed(walk, shape, variant.endpoint, variant.model)
    warm, _ = timed(walk, shape, variant.endpoint, variant.model)
    peak = report.peak_bytes / 2**20  # type: ignore[attr-defined]
    print(
        f"MoE local spec (moe_r3_tiny, {len(shape.microbatches)} micro-batches): cold {cold * 1000:.1f} ms, "
        f"warm {warm * 1000:.1f} ms; peak {peak:.1f} MiB"
    )


def moe_call() -> None:
    """The MoE walk: moe_r3's second forward_backward (16,384 packed slots, 20 MoE layers, replay int32-all-layers)."""
    variant = load_scenario(ROOT / "scenarios" / "moe_r3.yaml").resolve("int32-all-layers")
    shape = shape_call("forward_backward", [8191, 6143], variant.endpoint, MEGATRON)
    walk = AllocationWalk()
    cold, report = timed(walk, shape, variant.endpoint, variant.model)
    warm, _ = timed(walk, shape, variant.endpoint, variant.model)
    peak = report.peak_bytes / GIB  # type: ignore[attr-defined]
    print(
        f"MoE (moe_r3, {len(shape.microbatches)} micro-batches): cold {cold * 1000:.1f} ms, warm {warm * 1000:.1f} ms; "
        f"peak {peak:.2f} GiB"
    )


if __name__ == "__main__":
    main()
