"""``--backend megatron`` end to end on CPU: the miniature seed table, the simulator's calls and shapes, a killed
worker, and sampling before and after training."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import yaml

from project_paths import SCENARIOS
from skyrl_sim.errors import UserError
from skyrl_sim.results.expectations import unmet
from skyrl_sim.schema.scenario import load_scenario

pytestmark = pytest.mark.real

TINY = SCENARIOS / "queue_drain_17_tiny.yaml"


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line mentions ``text`` (the run dir: torchrun and its ranks carry it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if text in cmdline and "zombie" not in state:
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def drain(host, tmp_path_factory):
    """Every variant of the miniature drain on the real backend and on the simulator."""
    scenario = load_scenario(TINY)
    run_dir = tmp_path_factory.mktemp("drain")
    real = {v: host.run(scenario.resolve(v), "megatron", {"run_dir": str(run_dir)}) for v in scenario.variant_names}
    sim = {v: host.run(scenario.resolve(v), "sim") for v in scenario.variant_names}
    return scenario, real, sim, run_dir


def test_real_backend_reproduces_the_seed_table_in_miniature(drain):
    scenario, real, _, run_dir = drain
    for name, result in real.items():
        assert unmet(result, scenario.resolve(name).expectations) == [], name
    for name in ("no-cap", "cap-only"):
        [oom_call] = real[name].oom_calls
        assert 9 in oom_call.request_ids and oom_call.padded_rows == 16
        assert "tried to allocate" in oom_call.oom.message
        # the failing allocation is the long micro-batch's attention scores: [16 rows, heads / tp, S_mb, S_mb] fp32
        variant = scenario.resolve(name)
        heads = variant.model.num_attention_heads // variant.endpoint.parallelism.tp
        assert oom_call.oom.attempted_bytes == 16 * heads * oom_call.width**2 * 4
    nine = real["cap-aware"].request(9)
    assert nine.metrics["num_tokens:sum"] == 1750
    assert len(nine.outputs["logprobs"][0]) == 1750
    assert nine.metrics["total_loss:sum"] == pytest.approx(sum(nine.outputs["elementwise_loss"][0]), rel=1e-5)
    assert processes_mentioning(str(run_dir)) == []


def test_real_calls_and_shapes_equal_the_simulators_call_by_call(drain):
    _, real, sim, _ = drain
    fields = ("kind", "request_ids", "rows", "padded_rows", "width", "microbatches")
    for name in real:
        got = [tuple(getattr(c, f) for f in fields) for c in real[name].calls]
        want = [tuple(getattr(c, f) for f in fields) for c in sim[name].calls]
        assert got == want, name


def test_peak_memory_is_measured_per_call_and_grows_with_the_call(drain):
    _, real, _, _ = drain
    calls = real["cap-aware"].calls
    assert all(c.peak_bytes and c.peak_bytes > 0 for c in calls)
    long_call = next(c for c in calls if 9 in c.request_ids)
    assert long_call.peak_bytes > 3 * max(c.peak_bytes for c in calls[:8])


def write_scenario(tmp_path: Path, endpoint: str, requests: list[dict], mode: str = "after_previous") -> Path:
    body = {
        "name": "real_small",
        "endpoint": str(SCENARIOS / "endpoints" / f"{endpoint}.yaml"),
        "workload": {"clients": [{"name": "c", "model_id": "m", "submit": {"mode": mode}, "requests": requests}]},
    }
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_a_killed_worker_fails_the_affected_requests_and_ends_the_run(host, tmp_path):
    requests = [
        {"type": "forward_backward", "lengths": [20]},
        {"type": "forward_backward", "lengths": [30]},
        {"type": "optim_step"},
        {"type": "forward_backward", "lengths": [25]},
    ]
    scenario = load_scenario(write_scenario(tmp_path, "tiny-cpu-tp2", requests))
    run_dir = tmp_path / "run"
    options = {"run_dir": str(run_dir), "kill_rank_before_call": "2:1", "call_timeout_s": "60"}
    started = time.monotonic()
    result = host.run(scenario.resolve("default"), "megatron", options)
    assert time.monotonic() - started < 600  # ends, without a hang (two ranks' start on a loaded machine included)
    statuses = [r.status for r in result.requests]
    assert statuses[0] == "completed" and statuses[1:] == ["failed"] * 3, statuses
    assert "training worker failed" in result.requests[1].error
    assert all("backend stopped" in r.error for r in result.requests[2:])
    assert len(result.calls) == 2
    deadline = time.monotonic() + 10
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(run_dir)) == []


def test_workers_that_do_not_start_leave_their_log_for_the_cause(host, tmp_path):
    """A start-up failure's error names the workers' log, and the log is still there (only the checkpoints of the
    scratch run dir go): the cause of a rank that died before its hello stays readable."""
    scenario = load_scenario(write_scenario(tmp_path, "tiny-cpu-tp1", [{"type": "forward_backward", "lengths": [8]}]))
    with pytest.raises(UserError, match="the training workers did not start") as failure:
        host.run(scenario.resolve("default"), "megatron", {"startup_timeout_s": "0.001"})
    log = re.search(r"\(log: (\S+workers\.log)\)", str(failure.value))
    assert log, str(failure.value)
    assert Path(log.group(1)).is_file()
    assert not (Path(log.group(1)).parent / "checkpoints").exists()
    deadline = time.monotonic() + 10
    while processes_mentioning(str(Path(log.group(1)).parent)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(Path(log.group(1)).parent)) == []


def test_sample_after_training_differs_from_the_base_sample(host, tmp_path):
    pytest.importorskip("skyrl_sim_plugins.megatron_vllm.sampler")
    sample = {"type": "sample", "prompt_tokens": 12, "max_tokens": 8}
    requests = [
        {**sample, "checkpoint": ""},
        {"type": "forward_backward", "datums": [12, 12]},
        {"type": "optim_step", "learning_rate": 0.02},
        {"type": "forward_backward", "datums": [12]},
        {"type": "optim_step", "learning_rate": 0.02},
        {"type": "save_weights_for_sampler", "checkpoint": "trained"},
        {**sample, "checkpoint": "trained"},
    ]
    scenario = load_scenario(write_scenario(tmp_path, "tiny-cpu-tp1", requests))
    run_dir = tmp_path / "run"
    result = host.run(scenario.resolve("default"), "megatron", {"run_dir": str(run_dir)})
    failed = [(r.id, r.error) for r in result.failed]
    assert failed == []
    before, after = result.request(1).outputs["samples"], result.request(7).outputs["samples"]
    assert len(before[0]) == len(after[0]) == 8
    assert before != after
    assert os.path.isdir(run_dir / "real_small-default" / "checkpoints" / "m" / "trained")
    assert processes_mentioning(str(run_dir)) == []
