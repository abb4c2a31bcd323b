"""Benchmark: encode + decode of one long sample's routed experts (35,000 tokens x 40 layers x top 8, uint8).

Target: encode to ``{data, shape, dtype}`` + decode with every check under 50 ms. The orjson body around it (dump and
parse of a 15 MB JSON string) is timed too and printed beside it; it costs more than the codec itself.
Prints the best and median of several runs, and the payload sizes. Run: ``.venv/bin/python benchmarks/bench_r3_codec.py``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from skyrl_sim.engine import r3_codec

TOKENS, LAYERS, TOPK, EXPERTS = 35_000, 40, 8, 256
TARGET_MS = 50.0
RUNS = 15


def main() -> None:
    rng = np.random.default_rng(0)
    routes = rng.integers(0, EXPERTS, size=(TOKENS, LAYERS, TOPK), dtype=np.int64).astype(np.uint8)
    timings: dict[str, list[float]] = {"encode": [], "body": [], "parse": [], "decode": [], "codec": [], "total": []}
    body = b""
    for _ in range(RUNS):
        t0 = time.perf_counter()
        payload = r3_codec.encode_routes(routes)
        t1 = time.perf_counter()
        body = r3_codec.dumps_body({"routed_experts": payload})
        t2 = time.perf_counter()
        parsed = r3_codec.loads_body(body)
        t3 = time.perf_counter()
        back = r3_codec.decode_routes(parsed["routed_experts"])
        t4 = time.perf_counter()
        spans = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, (t1 - t0) + (t4 - t3), t4 - t0)
        for key, value in zip(timings, spans, strict=True):
            timings[key].append(value * 1000)
    assert np.array_equal(back, routes)
    print(f"routes {TOKENS:,} x {LAYERS} x {TOPK} uint8 = {routes.nbytes:,} bytes; body {len(body):,} bytes")
    for key, values in timings.items():
        print(f"{key:>7}: best {min(values):7.2f} ms, median {statistics.median(values):7.2f} ms")
    codec = statistics.median(timings["codec"])
    print(f"encode + decode median {codec:.2f} ms vs target {TARGET_MS:.0f} ms: {'OK' if codec < TARGET_MS else 'SLOW'}")
    print(f"with the orjson body (dump + parse) median {statistics.median(timings['total']):.2f} ms")


if __name__ == "__main__":
    main()
