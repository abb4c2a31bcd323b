"""The sampling plot of a run whose samples ran on vLLM: per engine, over time, its running and waiting sequences,
its KV cache usage and where preemption starts; below, each sample's wait, time to first token and completion.

Drawn from the run's ``inference`` section and its requests' ``outputs["vllm"]`` (``skyrl_sim.results.inference``),
so a simulated run and a measured one plot the same way.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from skyrl_sim.results.outputs import write_with  # noqa: E402
from skyrl_sim.results.result import RunResult  # noqa: E402

DPI = 100
FIGSIZE = (12.0, 8.0)


def plot_sampling(result: RunResult, path: str | Path) -> Path:
    """Three panels sharing the time axis: sequences running / waiting per engine, KV usage per engine with
    preemption marks, and per sample its queue wait (submitted to sent to vLLM), time to first token and last token."""
    fig, (seqs, kv, samples) = plt.subplots(3, 1, figsize=FIGSIZE, dpi=DPI, sharex=True, height_ratios=[1, 1, 1.4])
    for engine in result.inference.get("engines", []):
        timeline = engine.get("timeline", {})
        t = timeline.get("t", [])
        if not t:
            continue
        label = f"engine {engine['index']}"
        seqs.step(t, timeline["running"], where="post", label=f"{label} running", lw=1.2)
        seqs.step(t, timeline["waiting"], where="post", label=f"{label} waiting", lw=1.0, ls="--")
        kv.step(t, [100 * u for u in timeline["kv_usage"]], where="post", label=label, lw=1.2)
        rises = [t[i] for i in range(1, len(t)) if timeline["preemptions"][i] > timeline["preemptions"][i - 1]]
        if rises:
            kv.plot(rises, [100.0] * len(rises), "v", color="#c62828", markersize=4, label=f"{label} preemption")
    seqs.set_ylabel("sequences")
    seqs.legend(loc="upper right", fontsize=8, ncol=2)
    kv.set_ylabel("KV cache used (%)")
    kv.set_ylim(0, 105)
    if kv.get_legend_handles_labels()[0]:
        kv.legend(loc="lower right", fontsize=8)
    rows = [r for r in result.requests if r.type == "sample" and r.outputs.get("vllm")]
    for y, record in enumerate(rows):
        vllm = record.outputs["vllm"]
        if record.submitted_s is not None and vllm.get("sent_s") is not None:
            samples.plot([record.submitted_s, vllm["sent_s"]], [y, y], color="#9e9e9e", lw=1)
        if vllm.get("sent_s") is not None and vllm.get("first_token_s") is not None:
            samples.plot([vllm["sent_s"], vllm["first_token_s"]], [y, y], color="#ef6c00", lw=2)
        start = vllm.get("first_token_s") or vllm.get("sent_s")
        if start is not None and vllm.get("finished_s") is not None:
            samples.plot([start, vllm["finished_s"]], [y, y], color="#8e24aa", lw=2)
        if record.completed_s is not None:
            samples.plot([record.completed_s], [y], "|", color="#2e7d32", markersize=5)
    samples.set_ylabel("sample (request order)")
    samples.set_xlabel("time (s)")
    legend = "grey: waiting for the engine, orange: to first token, purple: generating, green: result written"
    samples.set_title(legend, fontsize=9)
    mode = result.inference.get("mode", "?")
    fig.suptitle(f"{result.scenario} / {result.variant} ({result.backend}): {mode} sampling on vLLM")
    for ax in (seqs, kv, samples):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    write_with(Path(path), lambda temp: fig.savefig(temp, dpi=DPI))
    plt.close(fig)
    return Path(path)
