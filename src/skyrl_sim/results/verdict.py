"""The one verdict of a run: PASS, AT RISK or FAIL, with the reasons, computed here and read by every command.

- **FAIL**: an expectation of the variant is unmet (``results.expectations.unmet``): a request failed, a call ran out
  of memory where none should, a count or a range is off.
- **AT RISK**: every expectation holds, but a call that completed has less headroom (capacity minus what it held at
  its peak, allocator pages included) than the margin around its peak: the variant's own memory band
  (``results.band.band_for`` on the variant's resolved endpoint, so a variant that changes ``tp``, the layer spec or
  the hardware profile is judged with its own band), or ``--margin``. The simulator cannot tell such a call from one
  that runs out of memory on the real device.
- **PASS**: neither.

``check`` judges a variant against its expectations. ``sweep --require completed`` and ``advise`` judge against
``COMPLETION`` (every request completes, no call out of memory) instead: a point of a sweep or a configuration of a
search changes the settings a variant's expectations pin (its calls, its padded rows), so those would fail every point
but the variant's own; the margin applies the same way. Only PASS passes: ``check`` exits 1 on AT RISK, and a sweep
point or an advised configuration that ``check`` would call AT RISK reads AT RISK there too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from skyrl_sim.results.band import Margin, Validated, band_for, headroom_state, held_bytes, parse_margin
from skyrl_sim.results.expectations import unmet
from skyrl_sim.results.result import CallRecord, RunResult
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.expect import Expectations
from skyrl_sim.units import GIB, format_size, gib

VLLM_START_CHECKS = frozenset(
    {"vllm_config", "request_memory", "kv_cache_memory", "kv_cache_size", "mamba_cache_blocks", "lora_vocab"}
)
"""vLLM's own start-up checks (``where.check`` of a ``vllm_start`` failure): a refusal before any allocation, so a
failed call reports what the check needed, not a size it tried to allocate."""

Status = Literal["PASS", "AT RISK", "FAIL"]
PASS: Status = "PASS"
AT_RISK: Status = "AT RISK"
FAIL: Status = "FAIL"
COMPLETION = Expectations(all_completed=True, oom_calls=0)
"""What a sweep point (``--require completed``) or an advised configuration must meet: every request completes, no
call runs out of memory."""


@dataclass(frozen=True)
class Verdict:
    """One run's verdict: its status, the unmet expectations (FAIL), the calls inside the margin (AT RISK), the margin."""

    variant: str
    status: Status
    problems: tuple[str, ...]
    risks: tuple[str, ...]
    margin: Margin
    failing_calls: tuple[str, ...] = ()
    """A FAIL's calls that ran out of memory, one line each (where, how much): the call to look at."""

    @property
    def passed(self) -> bool:
        return self.status == PASS

    @property
    def reasons(self) -> tuple[str, ...]:
        """Why the run did not pass: its unmet expectations and the calls that ran out of memory when it failed, else
        its calls at risk (empty: PASS). ``check`` prints them on the verdict line; the JUnit failure carries them."""
        return self.problems + self.failing_calls if self.problems else self.risks

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "problems": list(self.problems),
            "risks": list(self.risks),
            "failing_calls": list(self.failing_calls),
            "margin": self.margin.to_dict(),
        }


def judge(result: RunResult, expectations: Expectations, margin: Margin) -> Verdict:
    """The verdict of one run against its expectations, with ``margin`` (the run's own band, or ``--margin``)."""
    problems = tuple(unmet(result, expectations))
    risks = tuple(at_risk_lines(result, margin))
    status: Status = FAIL if problems else AT_RISK if risks else PASS
    failing = tuple(oom_lines(result)) if problems else ()
    return Verdict(result.variant, status, problems, risks, margin, failing)


def at_risk_calls(result: RunResult, margin: Margin) -> list[CallRecord]:
    """Completed calls whose headroom is smaller than the margin."""
    return [
        c
        for c in result.calls
        if c.oom is None and not c.error and headroom_state(c, result.capacity_bytes, margin) == "at_risk"
    ]


def at_risk_lines(result: RunResult, margin: Margin) -> list[str]:
    """One line per AT RISK call: its peak with the band, the capacity, and the headroom against the margin."""
    capacity = result.capacity_bytes or 0
    lines = []
    for call in at_risk_calls(result, margin):
        held = held_bytes(call)
        assert call.peak_bytes is not None and held is not None
        lines.append(
            f"call #{call.index} AT RISK: peak {peak_text(call.peak_bytes, margin)} GiB of {capacity / GIB:.2f}, "
            f"headroom {(capacity - held) / GIB:.2f} GiB < {margin.bytes_at(call.peak_bytes) / GIB:.2f} GiB "
            f"({margin.describe()})"
        )
    return lines


def oom_lines(result: RunResult) -> list[str]:
    """One line per call that ran out of memory: where, and how much it tried to allocate (for a FAIL's details)."""
    lines = []
    for call in result.oom_calls:
        assert call.oom is not None
        where = call.oom.where
        place = ", ".join(f"{key} {where[key]}" for key in ("phase", "op") if where.get(key))
        if "pp_stage" in where:  # a pipeline-parallel walk: the stage that ran out
            place += f", pipeline stage {where['pp_stage']}"
        if where.get("fragmented"):  # the classic allocator: the free memory is there, in no one piece
            place += (
                f"; free memory fragmented: {where['reserved_unallocated_bytes'] / GIB:.2f} GiB reserved but "
                f"unallocated, largest free block {where['largest_free_block_bytes'] / GIB:.2f} GiB"
            )
        if where.get("check") in VLLM_START_CHECKS:
            if where["check"] == "kv_cache_memory":  # the weights, activations and graphs take the whole budget
                needs = ": its budget leaves no memory for the KV cache"
            else:
                needs = f", needs {format_size(call.oom.attempted_bytes)}" if call.oom.attempted_bytes else ""
            what = f"refused by vLLM's start-up check {where['check']}{needs}"
        else:
            what = f"tried to allocate {call.oom.attempted_bytes / GIB:.2f} GiB"
        lines.append(f"call #{call.index} {call.kind} OOM: {what}" + (f" ({place})" if place else ""))
    return lines


def peak_text(peak: int | None, margin: Margin | None) -> str:
    """``133.30 ± 2.67``: a peak in GiB with the memory band around it (the band, not a ``--margin``)."""
    if peak is None or margin is None:
        return gib(peak)
    return f"{peak / GIB:.2f} ± {margin.band.bytes_at(peak) / GIB:.2f}"


def variant_margin(
    endpoint: Endpoint, scenario_path: str | Path | None, text: str | None, known: list[Validated] | None = None
) -> Margin:
    """The margin one variant is judged with: ``--margin`` (``text``) when given, else the band of the variant's own
    resolved endpoint (``known``: the validated endpoints, read once for many variants)."""
    return parse_margin(text, band_for(endpoint, scenario_path, known))
