"""Chrome / Perfetto trace of RunResults: a view of the result data, nothing more.

Open the file at https://ui.perfetto.dev (or chrome://tracing). Each run (variant) is one process:

- the **engine** track holds every backend call as a complete slice (``ph: X``) with its shape, peak memory and
  outcome in ``args``, an ``adapter swap`` slice nested at the start of a call that swapped LoRA adapters first (what
  was saved and restored, its bytes), one slice per step of a switch of a device the trainer shares with vLLM
  (``switch: vllm_start``, ``switch: trainer_backload``, ...: its bytes and the device's states after it) nested at the
  start of the call that made it, and an instant event where a call ran out of memory;
- the **requests** track holds every request as an async slice (``ph: b`` / ``e``) from submission to completion,
  with a nested ``queued`` slice until the engine started it;
- the **memory** counter track (``ph: C``) follows the memory model's allocation timeline of each call (its ops spread
  evenly over the call's duration, since the walk has no clock of its own), or, when a call carries no timeline,
  steps to the call's peak while it runs;
- one **vllm engine N** track per inference engine (when samples ran on vLLM): counters of its running and waiting
  sequences and its KV cache usage over time, an instant event wherever its preemption count rose, and each sample
  that engine served as a slice from when it was sent to vLLM until its last token (nested: until its first token).

Timestamps are microseconds of simulated (or wall-clock) time since the run started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from skyrl_sim.results.outputs import write_atomic
from skyrl_sim.results.result import CallRecord, RunResult
from skyrl_sim.results.timeline import timeline_of
from skyrl_sim.units import GIB

US = 1e6
ENGINE_TID = 1
REQUESTS_TID = 2
MEMORY_TID = 3
VLLM_TID = 100  # + the engine's index


def _us(seconds: float) -> float:
    return round(seconds * US, 3)


def _metadata(pid: int, result: RunResult) -> list[dict[str, Any]]:
    name = f"{result.scenario} / {result.variant} ({result.backend}, {result.endpoint})"
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "ts": 0, "args": {"sort_index": pid}},
    ]
    for tid, label in ((ENGINE_TID, "engine"), (REQUESTS_TID, "requests"), (MEMORY_TID, "memory")):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0, "args": {"name": label}})
    for engine in result.inference.get("engines", []):
        tid = VLLM_TID + int(engine["index"])
        label = f"vllm engine {engine['index']}"
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0, "args": {"name": label}})
    return events


def _vllm_events(pid: int, result: RunResult) -> list[dict[str, Any]]:
    """Per engine: running / waiting and KV usage counters, preemption instants, and the samples it served."""
    events: list[dict[str, Any]] = []
    for engine in result.inference.get("engines", []):
        tid = VLLM_TID + int(engine["index"])
        timeline = engine.get("timeline", {})
        last_preemptions = 0.0
        for i, t in enumerate(timeline.get("t", [])):
            ts = _us(t)
            base = {"pid": pid, "tid": tid, "ts": ts}
            sequences = {"running": timeline["running"][i], "waiting": timeline["waiting"][i]}
            events.append({**base, "ph": "C", "name": f"engine {engine['index']} sequences", "args": sequences})
            usage = {"used": round(timeline["kv_usage"][i], 4)}
            events.append({**base, "ph": "C", "name": f"engine {engine['index']} KV cache", "args": usage})
            preemptions = timeline["preemptions"][i]
            if preemptions > last_preemptions:
                name = f"preempted {preemptions - last_preemptions:g} (total {preemptions:g})"
                events.append({**base, "ph": "i", "s": "t", "name": name, "cat": "preemption"})
                last_preemptions = preemptions
    for record in result.requests:
        vllm = record.outputs.get("vllm") if record.outputs else None
        if not vllm or vllm.get("sent_s") is None or vllm.get("finished_s") is None:
            continue
        common = {"cat": "sample", "id": f"{pid}:vllm:{record.id}", "pid": pid, "tid": VLLM_TID + int(vllm["engine"])}
        name = f"sample #{record.id}"
        events.append({**common, "ph": "b", "name": name, "ts": _us(vllm["sent_s"]), "args": {"vllm": vllm}})
        if vllm.get("first_token_s") is not None:
            events.append({**common, "ph": "b", "name": "to first token", "ts": _us(vllm["sent_s"])})
            events.append({**common, "ph": "e", "name": "to first token", "ts": _us(vllm["first_token_s"])})
        events.append({**common, "ph": "e", "name": name, "ts": _us(vllm["finished_s"])})
    return events


def _call_args(call: CallRecord) -> dict[str, Any]:
    args: dict[str, Any] = {"index": call.index, "model": call.model_id, "requests": call.request_ids}
    if call.kind in ("forward_backward", "forward"):
        args.update(
            rows=call.rows,
            padded_rows=call.padded_rows,
            width=call.width,
            microbatches=call.microbatches,
            padding_waste=round(call.padding_waste, 4),
        )
    if call.peak_bytes is not None:
        args["peak_gib"] = round(call.peak_bytes / GIB, 3)
    if call.error:
        args["error"] = call.error
    if call.extra.get("swap"):
        args["swap_s"] = call.extra["swap"]["seconds"]
    if call.extra.get("switches"):
        args["switch_s"] = sum(step["seconds"] for step in call.extra["switches"])
    return args


def _call_events(pid: int, call: CallRecord) -> list[dict[str, Any]]:
    status = "oom" if call.oom else ("error" if call.error else "ok")
    events: list[dict[str, Any]] = [
        {
            "ph": "X",
            "name": call.kind if status == "ok" else f"{call.kind} ({status})",
            "cat": "call",
            "pid": pid,
            "tid": ENGINE_TID,
            "ts": _us(call.start_s),
            "dur": _us(max(call.duration_s, 0.0)),
            "args": _call_args(call),
        }
    ]
    at = call.start_s
    for step in call.extra.get("switches", ()):
        events.append(
            {
                "ph": "X",
                "name": f"switch: {step['step']}",
                "cat": "switch",
                "pid": pid,
                "tid": ENGINE_TID,
                "ts": _us(at),
                "dur": _us(float(step["seconds"])),
                "args": {key: value for key, value in step.items() if key not in ("step", "seconds")},
            }
        )
        at += float(step["seconds"])
    swap = call.extra.get("swap")
    if swap:
        events.append(
            {
                "ph": "X",
                "name": f"adapter swap -> {swap['restored']}",
                "cat": "swap",
                "pid": pid,
                "tid": ENGINE_TID,
                "ts": _us(at),
                "dur": _us(min(float(swap["seconds"]), max(call.duration_s, 0.0))),
                "args": {"saved": swap["saved"], "restored": swap["restored"], "bytes": swap["bytes"]},
            }
        )
    if call.oom is not None:
        events.append(
            {
                "ph": "i",
                "s": "t",
                "name": f"OOM: tried to allocate {call.oom.attempted_bytes / GIB:.2f} GiB",
                "cat": "oom",
                "pid": pid,
                "tid": ENGINE_TID,
                "ts": _us(call.end_s),
                "args": {"where": call.oom.where, "message": call.oom.message},
            }
        )
    return events


def memory_points(call: CallRecord) -> list[tuple[float, int]]:
    """(seconds, allocated bytes) along one call: its allocation timeline spread over the call, or its peak."""
    timeline = timeline_of(call)
    points: list[tuple[float, int]] = []
    if timeline:
        step = call.duration_s / len(timeline)
        points.extend((call.start_s + i * step, row.allocated) for i, row in enumerate(timeline))
    elif call.peak_bytes:
        points.append((call.start_s, call.peak_bytes))
    if points:
        points.append((call.end_s, 0))
    return points


def _memory_events(pid: int, call: CallRecord) -> list[dict[str, Any]]:
    return [
        {"ph": "C", "name": "allocated GiB", "pid": pid, "tid": MEMORY_TID, "ts": _us(t), "args": {"GiB": round(b / GIB, 4)}}
        for t, b in memory_points(call)
    ]


def _request_events(pid: int, result: RunResult) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for record in result.requests:
        if record.submitted_s is None or record.completed_s is None:
            continue
        ident = f"{pid}:{record.id}"
        name = f"{record.type} #{record.id}"
        common = {"cat": "request", "id": ident, "pid": pid, "tid": REQUESTS_TID}
        args = {"status": record.status, "tokens": record.tokens, "client": record.client, "model": record.model_id}
        if record.error:
            args["error"] = record.error
        events.append({**common, "ph": "b", "name": name, "ts": _us(record.submitted_s), "args": args})
        if record.started_s is not None:
            events.append({**common, "ph": "b", "name": "queued", "ts": _us(record.submitted_s)})
            events.append({**common, "ph": "e", "name": "queued", "ts": _us(record.started_s)})
        events.append({**common, "ph": "e", "name": name, "ts": _us(record.completed_s)})
    return events


def trace_events(results: list[RunResult]) -> list[dict[str, Any]]:
    """Every trace event of the runs, one process per run."""
    events: list[dict[str, Any]] = []
    for pid, result in enumerate(results, start=1):
        events += _metadata(pid, result)
        for call in result.calls:
            events += _call_events(pid, call)
            events += _memory_events(pid, call)
        events += _request_events(pid, result)
        events += _vllm_events(pid, result)
    return events


def trace_document(results: list[RunResult]) -> dict[str, Any]:
    """The JSON object format: ``traceEvents`` plus what the runs were."""
    return {
        "traceEvents": trace_events(results),
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "skyrl-sim",
            "runs": [
                {
                    "scenario": r.scenario,
                    "variant": r.variant,
                    "backend": r.backend,
                    "endpoint": r.endpoint,
                    "capacity_gib": None if r.capacity_bytes is None else round(r.capacity_bytes / GIB, 3),
                }
                for r in results
            ],
        },
    }


def write_trace(results: list[RunResult], path: str | Path) -> Path:
    """Write the trace JSON; returns the path written."""
    write_atomic(path, orjson.dumps(trace_document(results)))
    return Path(path)
