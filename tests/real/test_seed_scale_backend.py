"""The seed-scale endpoint (``seed-scale-h200-tp1``: flash attention, the fused LM-head log-prob, bf16 model and bf16
LoRA adapters) on the real backend: its preflight accepts the full endpoint without running it, and the same
endpoint, cut down with ``--set`` to a few layers, narrow widths and the seed drain's lengths over 100, runs every
variant of queue_drain_17.yaml through the real workers on CPU with the simulator's calls and shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from project_paths import SCENARIOS
from scenario_text import run_cli
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.megatron_vllm.backend import check_variant

pytestmark = pytest.mark.real

ENDPOINT = "seed-scale-h200-tp1"
SCENARIO = SCENARIOS / "queue_drain_17.yaml"
SEED_LENGTHS = [3693, 5363, 4319, 3097, 3940, 3494, 3659, 3967, 35000, 5271, 3861, 4449, 3660, 4075, 4969, 5111, 4011]
# two layers, the seed shard's head layout (6 query heads, 1 KV group) at head size 32, FFN and vocabulary narrowed,
# chunks of 64 positions so the long row's head runs several; no memory limit (a CPU run of an H200 endpoint: the
# limit would be address-space headroom, not the card's)
CUT = {
    "model": {
        "preset": "seed-shard",
        "num_layers": 2,
        "hidden_size": 192,
        "head_dim": 32,
        "ffn_hidden_size": 256,
        "vocab_size": 1024,
    },
    "trainer.logprobs_chunk_size": 64,
    "memory_limit_gib": None,
    "workload.clients.0.requests.0.lengths": [round(n / 100) for n in SEED_LENGTHS],
}


@pytest.mark.parametrize("variant", ["no-cap", "cap-only", "cap-aware"])
def test_preflight_accepts_the_full_seed_scale_endpoint(variant: str) -> None:
    resolved = load_scenario(SCENARIO, endpoint=ENDPOINT).resolve(variant)
    trainer = resolved.endpoint.trainer
    assert trainer.fused_lm_head_logprob and trainer.attention_kernel == "flash" and trainer.params_dtype == "bf16"
    assert resolved.endpoint.lora.dtype in (None, "bf16")
    check_variant(resolved)  # raises a UserError naming the key it refuses


def test_cut_down_endpoint_runs_every_variant_on_the_real_backend(tmp_path: Path, capsys) -> None:
    out = tmp_path / "real.json"
    sets = [f"{key}={json.dumps(value)}" for key, value in CUT.items()]
    args = ["run", str(SCENARIO), "--endpoint", ENDPOINT, "--backend", "megatron", "--all-variants", "--json", str(out)]
    code, text = run_cli(args + [part for s in sets for part in ("--set", s)], capsys)
    assert code == 0, text
    data = json.loads(out.read_text())
    real = data if isinstance(data, list) else data["runs"]
    assert [r["variant"] for r in real] == ["no-cap", "cap-only", "cap-aware"]
    scenario = load_scenario(SCENARIO, endpoint=ENDPOINT)
    for run in real:
        sim = PluginHost().run(scenario.resolve(run["variant"], CUT), "sim")
        shapes = [(c["kind"], c["rows"], c["padded_rows"], c["width"]) for c in run["calls"]]
        assert shapes == [(c.kind, c.rows, c.padded_rows, c.width) for c in sim.calls], run["variant"]
        assert all(r["status"] == "completed" for r in run["requests"]), run["variant"]
        assert all(c["peak_bytes"] and not c.get("oom") for c in run["calls"])
    long_row = next(r for r in real[2]["requests"] if r["id"] == 9)
    assert long_row["metrics"]["num_tokens:sum"] == 350  # the long request, alone in its one-row call
