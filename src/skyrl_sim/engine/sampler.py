"""The engine's sampler: where samples run on vLLM, concurrently, each completing when its own generation ends.

SkyRL 0.4.0 samples in one of three ways (``rules.sampling_mode``), and a backend's sampler serves all three:

- **continuous** (``engine.py``: ``_ContinuousSampler``): the engine loop admits samples (``submit``) and goes on;
  the sampler writes each request's result to the futures table when the last of its ``num_samples`` generations
  ends; before blocking work the loop waits for all of them (``drain``);
- **serial**: one wave per iteration (``wave``): the wave's samples run concurrently as well (SkyRL gathers one HTTP
  request per sample), but every result of the wave is written when the whole wave has ended;
- **forwarded** (``api.py``: ``_should_forward_sample_requests``): the futures table hands each sample to
  ``submit`` as it is submitted; the engine never sees it.

A sampler writes results itself (``FuturesTable.finish``), at the time they happen: the simulator's from clock
timers (``Clock.call_at``), the real backend's from its HTTP client's threads. ``drain`` and ``wave`` are the
engine's waits, as steps of its clock (the simulator sleeps until the last generation ends; the real sampler blocks,
with a time-out, and yields nothing).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from skyrl_sim.engine.clients import Sleep
from skyrl_sim.engine.outcome import CallOutcome
from skyrl_sim.engine.request import Request


@dataclass
class WaveResults:
    """What a serial wave's requests have given so far: outputs by request id, and each failed request's error.
    ``Sampler.wave`` returns them in its ``CallOutcome`` once the whole wave has ended."""

    outputs: dict[int, dict[str, Any]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)


class Sampler(Protocol):
    def submit(self, requests: Sequence[Request]) -> None:
        """Admit ``requests`` now: each runs concurrently with everything else, and its result (completed, or failed
        with the reason) is written to the futures table when its own generations end."""
        ...

    def in_flight(self) -> int:
        """Requests admitted whose results are not written yet."""
        ...

    def drain(self) -> Generator[Sleep, None, None]:
        """The engine's steps until every admitted request's result is written."""
        ...

    def report(self) -> dict[str, Any]:
        """The run's ``inference`` section (``RunResult.inference``): the engines' KV cache, counters and timelines,
        modelled or read from the servers' metrics; empty when no sample ran."""
        ...

    def wave(self, requests: Sequence[Request]) -> Generator[Sleep, None, CallOutcome]:
        """Run ``requests`` concurrently and return, once all have ended, what a serial sample call returns (per
        request outputs, ``failed`` per request); nothing is written to the table (the engine writes the wave)."""
        ...
