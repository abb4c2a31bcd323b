"""The vLLM server's own counters (``GET /metrics``, Prometheus text), read while samples run, kept per run.

vLLM V1 exports, per engine (``vllm/v1/metrics/loggers.py``): ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` (gauges), ``vllm:kv_cache_usage_perc`` (the fraction of usable KV blocks in use),
``vllm:num_preemptions_total`` (a counter), ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total``, the
prefix cache's queries and hits, and ``vllm:cache_config_info`` whose labels carry the cache settings, among them
``num_gpu_blocks`` (the block pool's size, the null block included) and ``block_size``. ``MetricsPoller`` reads them
every ``interval_s`` while requests are in flight and once at the end, into the shape the simulator's
``inference`` section has (``timeline`` per engine), so ``compare`` puts the two side by side.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
POLL_S = 0.25


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text exposition: (name, labels, value); comments and malformed lines skipped."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(4))
        except ValueError:
            continue
        labels = dict(LABEL.findall(match.group(3) or ""))
        out.append((match.group(1), labels, value))
    return out


def engine_counters(text: str) -> dict[str, dict[str, float]]:
    """Per engine label, the counters this module keeps (``running``, ``waiting``, ``kv_usage``, ``preemptions``,
    ``prompt_tokens``, ``generation_tokens``, ``prefix_cache_queries``, ``prefix_cache_hits``, ``num_gpu_blocks``,
    ``block_size``)."""
    names = {
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:num_preemptions_total": "preemptions",
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:generation_tokens_total": "generation_tokens",
        "vllm:prefix_cache_queries_total": "prefix_cache_queries",
        "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    }
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in parse_metrics(text):
        engine = labels.get("engine", "0")
        if name in names:
            counters = out.setdefault(engine, {})
            counters[names[name]] = counters.get(names[name], 0.0) + value
        elif name == "vllm:cache_config_info":
            counters = out.setdefault(engine, {})
            for key in ("num_gpu_blocks", "block_size"):
                if labels.get(key, "").isdigit():
                    counters[key] = float(labels[key])
    return out


class MetricsPoller:
    """Reads ``/metrics`` through ``fetch`` (returns the body text, or raises ``OSError``) every ``interval_s`` while
    ``active()`` says requests are in flight, on a daemon thread; ``stop`` reads once more and ends it."""

    def __init__(
        self,
        fetch: Callable[[], str],
        active: Callable[[], bool],
        clock: Callable[[], float],
        interval_s: float = POLL_S,
    ) -> None:
        self.fetch = fetch
        self.active = active
        self.clock = clock
        self.interval_s = interval_s
        self.timelines: dict[str, dict[str, list[float]]] = {}
        self.last: dict[str, dict[str, float]] = {}
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-metrics", daemon=True)
        self._thread.start()

    def read(self) -> None:
        """One reading, appended to every engine's timeline."""
        try:
            counters = engine_counters(self.fetch())
        except (OSError, ValueError):
            self.errors += 1
            return
        now = self.clock()
        for engine, values in counters.items():
            self.last[engine] = values
            timeline = self.timelines.setdefault(
                engine, {"t": [], "running": [], "waiting": [], "kv_usage": [], "preemptions": []}
            )
            timeline["t"].append(round(now, 6))
            for key in ("running", "waiting", "kv_usage", "preemptions"):
                timeline[key].append(values.get(key, 0.0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.active():
                self.read()

    def stop(self, timeout_s: float = 5.0, final_read: bool = True) -> None:
        """End the polling thread; with ``final_read``, read the counters once more (the run's last values)."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        if final_read:
            self.read()

    def report(self) -> list[dict[str, Any]]:
        """Per engine: the last counters and the timeline, in the simulator's ``inference.engines`` shape."""
        engines = []
        for engine in sorted(self.timelines, key=lambda e: (len(e), e)):
            last = self.last.get(engine, {})
            blocks = last.get("num_gpu_blocks")
            timeline = dict(self.timelines[engine])
            if blocks:
                timeline["kv_blocks"] = [round(u * (blocks - 1)) for u in timeline["kv_usage"]]
            engines.append(
                {
                    "index": int(engine) if engine.isdigit() else engine,
                    "num_gpu_blocks": int(blocks) if blocks else None,
                    "preemptions": int(last.get("preemptions", 0)),
                    "prompt_tokens": int(last.get("prompt_tokens", 0)),
                    "generation_tokens": int(last.get("generation_tokens", 0)),
                    "prefix_cache_hit_tokens": int(last.get("prefix_cache_hits", 0)),
                    "timeline": timeline,
                }
            )
        return engines


def wait_until(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True
