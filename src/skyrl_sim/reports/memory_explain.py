"""``check --explain``: the memory timeline of each failing call, condensed for a terminal.

The walk's timeline has one row per segment (embedding, each layer's forward, the LM head, each layer's backward) of
the micro-batch that set the peak or failed, and one row per op of the failing segment. Here consecutive layers of
the same phase collapse into ranges, the peak is marked, and the failing segment is printed op by op.

A call that failed at a switch of a device the trainer shares with vLLM (``sim.colocation``: vLLM's start, a wake, a
weight sync, the trainer's backload) has no layer timeline: its table says what was on the device, what the switch
tried to add, the message the failing part raises, the requests SkyRL fails with it, and the steps that ran before.
A later call that fails the same way is one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from skyrl_sim.results.result import CallRecord, RunResult
from skyrl_sim.results.timeline import TimelineRow, timeline_of
from skyrl_sim.results.verdict import VLLM_START_CHECKS
from skyrl_sim.units import gib


@dataclass
class Span:
    """Consecutive timeline rows of one phase shown as one table row: their layers, the op and size at their highest
    point, that point, and the allocated bytes after the last of them. An op row of the failing segment is a span of
    one (``op_row`` set)."""

    microbatch: int
    phase: str
    first_layer: int | str
    last_layer: int | str
    op: str
    bytes: int
    peak: int
    allocated: int
    op_row: TimelineRow | None = None

    @classmethod
    def of(cls, row: TimelineRow) -> Span:
        return cls(
            row.microbatch,
            row.phase,
            row.layer,
            row.layer,
            row.op,
            row.bytes,
            row.high,
            row.allocated,
            row if row.is_op else None,
        )

    @property
    def layers(self) -> str:
        first, last = self.first_layer, self.last_layer
        if first == last:
            return str(first)
        return f"{first}-{last}" if isinstance(first, int) and isinstance(last, int) and first < last else f"{first}..{last}"


def condensed_rows(timeline: list[TimelineRow], keep_ops: int = 12) -> list[Span]:
    """Segment rows merged into runs of consecutive layers per phase; the failing segment's last ops kept as they are."""
    out: list[Span] = []
    for row in (r for r in timeline if not r.is_op):
        last = out[-1] if out else None
        if last and isinstance(row.layer, int) and last.phase == row.phase and isinstance(last.last_layer, int):
            last.last_layer = row.layer
            last.allocated = row.allocated
            if row.high > last.peak:
                last.peak, last.op, last.bytes = row.high, row.op, row.bytes
            continue
        out.append(Span.of(row))
    out.extend(Span.of(row) for row in [r for r in timeline if r.is_op][-keep_ops:])
    return out


def explain_table(result: RunResult) -> list[Table]:
    """One table per call that ran out of memory."""
    tables = []
    seen: dict[tuple[Any, ...], int] = {}
    for call in result.oom_calls:
        assert call.oom is not None
        where = call.oom.where
        if where.get("phase") == "weight_sync" and "side" in where:
            tables.append(sync_table(result.variant, call))
            continue
        if where.get("phase") == "vllm_start" and "on_device" not in where and where.get("start"):
            tables.append(own_device_start_table(result.variant, call))
            continue
        if "on_device" in where:
            key = (where.get("phase"), call.oom.attempted_bytes, call.oom.message)
            if key in seen:
                tables.append(Table(title=f"{result.variant} call {call.index}: the same {key[0]} failure as call "
                                    f"{seen[key]} (requests {request_span(call.request_ids)})", title_justify="left"))
            else:
                seen[key] = call.index
                tables.append(switch_table(result.variant, call))
            continue
        title = (
            f"{result.variant} call {call.index}: OOM in {where.get('phase')} at layer {where.get('layer')}, "
            f"{where.get('op')} {where.get('shape')} {where.get('dtype')}, tried {gib(call.oom.attempted_bytes)} GiB "
            f"with {gib(call.oom.allocated_bytes or 0)} of {gib(call.oom.capacity_bytes or 0)} GiB allocated"
        )
        carried = where.get("carried_bytes")
        if where.get("fails_only_after_earlier_calls"):
            title += (
                f"; it fits when run alone: it fails only because earlier calls left {gib(carried or 0)} GiB held "
                "(megatron's persistent attention-scores buffer, grown to the largest earlier call)"
            )
        elif carried:
            title += f"; earlier calls left {gib(carried)} GiB held (it fails when run alone too)"
        table = Table(title=title, title_justify="left", caption=breakdown_caption(call), caption_justify="left")
        for column in ("mb", "phase", "layers", "op at peak / op", "bytes GiB", "peak GiB", "allocated after GiB", ""):
            table.add_column(column, justify="left" if column in ("phase", "layers", "op at peak / op", "") else "right")
        spans = condensed_rows(timeline_of(call))
        top = max((s.peak for s in spans if s.op_row is None), default=0)
        for span in spans:
            mark = ""
            if span.op_row is not None and span.op_row.failed:
                mark = "[red]FAILED[/red]"
            elif span.op_row is None and span.peak == top:
                mark = "[bold]peak[/bold]"
            stage = span.op_row.stage if span.op_row is not None else None
            phase = span.phase if not stage or stage == span.phase else f"{span.phase} ({stage})"
            table.add_row(
                str(span.microbatch),
                phase,
                span.layers,
                span.op,
                gib(span.bytes),
                gib(span.peak),
                gib(span.allocated),
                mark,
            )
        tables.append(table)
    return tables


BREAKDOWN_NAMES = {
    "weights": "weights",
    "adapters": "adapters",
    "gradients": "gradients",
    "master_weights": "fp32 master weights",
    "optimizer_state": "optimizer state",
    "fsdp_units": "FSDP units in flight",
    "saved_activations": "saved activations",
    "logits": "logits",
    "transient": "transient",
    "routed_expert_replay": "replayed expert ids",
    "persistent_buffers": "persistent buffers",
}
"""The breakdown's categories as the caption names them (the trainer's state first: ``description.trainers``)."""


def breakdown_caption(call: CallRecord) -> str:
    """What the rank held at the call's peak (or failure), category by category: the trainer's own state (weights,
    LoRA adapters, or a full fine-tune's gradients and optimizer state; FSDP's units in flight) and the call's."""
    breakdown = (call.memory or {}).get("breakdown") or {}
    parts = [f"{label} {gib(breakdown[key])}" for key, label in BREAKDOWN_NAMES.items() if breakdown.get(key)]
    return "held at the peak (GiB): " + ", ".join(parts) if parts else ""


def request_span(ids: list[int]) -> str:
    """``3`` or ``3..9 (7)``: a call's request ids."""
    return str(ids[0]) if len(ids) == 1 else f"{ids[0]}..{ids[-1]} ({len(ids)})"


def switch_table(variant: str, call: CallRecord) -> Table:
    """A switch failure: the device's parties before it, the size tried, the message, and the steps before it."""
    assert call.oom is not None
    where = call.oom.where
    device = where["on_device"]
    title = (
        f"{variant} call {call.index} {call.kind}: OOM in {where.get('phase')} ({where.get('check') or where.get('step')}"
        f"), {tried_text(where, call.oom.attempted_bytes, device['total_bytes'])}; fails requests "
        f"{request_span(call.request_ids)}\n{escape(call.oom.message)}"
    )
    table = Table(title=title, title_justify="left")
    for column in ("on the device", "state", "GiB"):
        table.add_column(column, justify="right" if column == "GiB" else "left")
    table.add_row("trainer", str(device["trainer"]), gib(device["trainer_bytes"]))
    table.add_row("vLLM", str(device["vllm"]), gib(device["vllm_bytes"]))
    for key, value in device.get("while_vllm_sleeps", {}).items():
        if key != "total_bytes" and value:
            table.add_row("while vLLM sleeps", key.removesuffix("_bytes").replace("_", " "), gib(value))
    add_start_rows(table, where)
    if where.get("check") != "vllm_config":  # a refused config allocates nothing
        table.add_row("tried to add", str(where.get("start_step") or where.get("phase")), gib(call.oom.attempted_bytes))
    for step in call.extra.get("switches", ()):
        table.add_row(f"before: {step['step']}", step.get("detail", ""), gib(step["bytes_moved"]))
    return table


def tried_text(where: dict[str, Any], attempted: int, total: int) -> str:
    """What a switch's failure tried against what it had: an allocation against the device's free memory; a refusal
    by one of vLLM's start-up checks against what that check compares (``request_memory``: the device's free memory;
    the KV cache checks: what the budget leaves the KV cache)."""
    check, free = where.get("check"), where.get("free_bytes", 0)
    if check not in VLLM_START_CHECKS:
        return f"tried {gib(attempted)} GiB with {gib(free)} of {gib(total)} GiB free"
    if check == "request_memory":
        return f"refused: its budget is {gib(attempted)} GiB with {gib(free)} of {gib(total)} GiB free"
    if check == "mamba_cache_blocks":
        return "refused before its CUDA-graph capture"
    if check == "vllm_config":
        return "refused its engine config before any worker started"
    if check == "lora_vocab":
        return "refused the vocabulary in its LM head's LoRA layer while loading"
    return f"refused: the KV cache needs {gib(attempted)} GiB, its budget leaves {gib(free)} GiB"


def add_start_rows(table: Table, where: dict[str, Any]) -> None:
    """vLLM's start up to its failing step: its context, each earlier step's bytes (in its budget or on top of it),
    and the failing step's own tensors already allocated."""
    start = where.get("start")
    if not start or where.get("check") == "vllm_config":  # no worker started
        return
    table.add_row("vLLM start", f"context (outside its budget of {gib(start['requested_bytes'])} GiB)",
                  gib(start["context_bytes"]))
    for step in start["steps"]:
        if step["step"] == where.get("start_step"):
            live = where.get("start_live_bytes", step["live_bytes"])
            if live:
                table.add_row(f"vLLM start: {step['step']}", "its tensors already allocated", gib(live))
            break
        inside = "in the budget" if step["in_budget"] else "on top of the budget"
        table.add_row(f"vLLM start: {step['step']}", f"{inside}; {step.get('detail', '')}", gib(step["held_bytes"]))


def own_device_start_table(variant: str, call: CallRecord) -> Table:
    """vLLM's start that failed on a device of its own (``placement.colocate_all: false``): the steps before the
    failing one, the size tried and what was free."""
    assert call.oom is not None
    where = call.oom.where
    title = (
        f"{variant} call {call.index} {call.kind}: OOM in vllm_start on vLLM's own device ({where.get('check')}), "
        f"{tried_text(where, call.oom.attempted_bytes, call.oom.capacity_bytes or 0)}; fails requests "
        f"{request_span(call.request_ids)}\n{escape(call.oom.message)}"
    )
    table = Table(title=title, title_justify="left")
    for column in ("on the device", "state", "GiB"):
        table.add_column(column, justify="right" if column == "GiB" else "left")
    add_start_rows(table, where)
    table.add_row("tried to add", str(where.get("start_step")), gib(call.oom.attempted_bytes))
    return table


def sync_table(variant: str, call: CallRecord) -> Table:
    """A weight sync to engines on their own GPUs that ran out: the side, the bucket, and what was free."""
    assert call.oom is not None
    where = call.oom.where
    title = (
        f"{variant} call {call.index} {call.kind}: OOM in weight_sync on the {where.get('side')} side, packed bucket "
        f"{int(where.get('bucket', 0)) + 1} of {where.get('buckets')}; fails requests {request_span(call.request_ids)}"
        f"\n{escape(call.oom.message)}"
    )
    table = Table(title=title, title_justify="left")
    for column in ("term", "GiB"):
        table.add_column(column, justify="right" if column == "GiB" else "left")
    table.add_row(f"free on the {where.get('side')} GPU", gib(where.get("free_bytes", 0)))
    table.add_row("earlier buckets still referenced", gib(where.get("sync_buffers_bytes", 0)))
    table.add_row("tried to add (one packed bucket)", gib(call.oom.attempted_bytes))
    table.add_row("largest bucket", gib(where.get("largest_bucket_bytes", 0)))
    return table


def print_explain(console: Console, result: RunResult) -> None:
    for table in explain_table(result):
        console.print(table)
