"""Benchmark: the time model's cost per backend call, on the calls of the multi-tenant workload (issue 17).

Runs the simulator's core (no memory walk) once over ``skyrl_sim.traffic.synthetic.multi_tenant_document`` and keeps
every forward_backward / forward call the engine makes (the seed's Qwen3.6-27B H200 TP-4 endpoint, 1-4 rows of
512-8,192 tokens). Then, in CPU seconds (the machine is shared; wall time swings):

- **cold**: a fresh ``RooflineTimeModel`` prices every call in order (a padded micro-batch is read from its block of
  widths, evaluated whole by the compiled ``MicroBatchProgram`` on the block's first use; any other new shape is
  evaluated alone, a repeated one looked up), as a run does;
- **warm**: the same model prices them again (every micro-batch cached: the per-call overhead alone);
- **reference**: ``TimeReference.call``, the op-by-op pricing the fast path equals bit for bit (no cache), on the first
  2,000 calls, and a check that every one of them agrees to the bit.

Measured (2-core shared machine, load average about 2, 20,000 requests = 15,400 calls, 10,799 distinct micro-batch
shapes): cold 13 us per call (24 us in a noisy minute), warm 4.5 us, reference 150 us. Main before the compiled
program: 70 us per call (its op lists rebuilt per micro-batch, its cache of 4,096 micro-batches missing most).
Tiles of widths (``time_program.WidthTile``), same machine, alternating with the code before them: cold 9.2-10.3 us per
call (20.0-24.2 us evaluating each new shape alone), warm 5.0-6.1 us (7.3).

Run: ``.venv/bin/python benchmarks/bench_time_model.py [REQUESTS]`` (default 20000).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from skyrl_sim.engine.shapes import CallShape
from skyrl_sim.plugin_host.costs import MemoryReport
from skyrl_sim.plugin_host.hookspecs import RunContext
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.architecture import ModelArch
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.scenario import ScenarioFile
from skyrl_sim.traffic.synthetic import VARIANT, multi_tenant_document
from skyrl_sim_plugins.sim.backend import SimBackend
from skyrl_sim_plugins.sim.bound.timing import RooflineTimeModel

REQUESTS = 20000
REFERENCE_CALLS = 2000
Call = tuple[CallShape, Endpoint, ModelArch]


class NoMemoryWalk:
    """A memory model that answers at once (only the calls' shapes are wanted)."""

    def evaluate(self, shape: Any, endpoint: Any, model: Any, carried: Any = None) -> MemoryReport:
        return MemoryReport(peak_bytes=0)


class RecordingTimeModel(RooflineTimeModel):
    """The time model, keeping every pass call it is asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def call_seconds(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> float:
        self.calls.append((shape, endpoint, model))
        return super().call_seconds(shape, endpoint, model)


def workload_calls(total: int) -> list[Call]:
    """The pass calls a simulation of ``total`` multi-tenant requests makes, in order."""
    recorder = RecordingTimeModel()
    with tempfile.TemporaryDirectory() as tmp:
        scenario = ScenarioFile(Path(tmp) / "multi_tenant.yaml", raw=multi_tenant_document(total))
        backend = SimBackend(memory=NoMemoryWalk(), time=recorder)
        backend.run(scenario.resolve(VARIANT), RunContext(host=PluginHost(), options={}))
    return recorder.calls


def cpu_seconds(model: RooflineTimeModel, calls: list[Call]) -> float:
    start = time.process_time()
    for shape, endpoint, model_arch in calls:
        model.call_seconds(shape, endpoint, model_arch)
    return time.process_time() - start


def main(total: int = REQUESTS) -> int:
    calls = workload_calls(total)
    n = len(calls)
    cold = warm = float("inf")
    for _ in range(3):
        model = RooflineTimeModel()
        cold = min(cold, cpu_seconds(model, calls))
        warm = min(warm, cpu_seconds(model, calls))
    print(f"{total} requests, {n} pass calls")
    print(f"cold:      {cold:7.3f} s CPU, {cold / n * 1e6:7.1f} us per call")
    print(f"warm:      {warm:7.3f} s CPU, {warm / n * 1e6:7.1f} us per call")
    sample = calls[:REFERENCE_CALLS]
    fast = RooflineTimeModel()
    start = time.process_time()
    references = []
    for shape, endpoint, model_arch in sample:
        bound = fast.bind(endpoint, model_arch)
        references.append(bound.reference.call(shape).seconds(bound.profile.time_coefficients))
    reference = time.process_time() - start
    print(f"reference: {reference:7.3f} s CPU, {reference / len(sample) * 1e6:7.1f} us per call ({len(sample)} calls)")
    mismatches = sum(fast.call_seconds(s, e, m).hex() != r.hex() for (s, e, m), r in zip(sample, references, strict=True))
    print(f"fast path equals the reference bit for bit on {len(sample) - mismatches} of {len(sample)} calls")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:2])))
