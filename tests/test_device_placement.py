"""vLLM's devices against the placement. Colocated (``placement.colocate_all``, SkyRL's default), the engines run on
the trainer's devices and SkyRL asserts ``num_engines x tensor_parallel_size`` equals them (``_build_policy``): a
stated count that differs is refused with the keys and SkyRL's reason. On devices of their own, vLLM's devices are
added to the trainer's and reported. An engine count the simulator cannot run in bounded time is refused by its
limit."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from project_paths import ROOT
from scenario_text import run_cli
from skyrl_sim.schema.limits import MAX_DEVICES, MAX_ENGINES

FOUR = {
    "name": "four",
    "model": "qwen3-8b",
    "hardware": {"profile": "h200", "devices": 4},
    "parallelism": {"dp": 4},
    "trainer": {"strategy": "megatron"},
}
SAMPLES = [{"type": "save_weights_for_sampler", "checkpoint": "s"}]
SAMPLES += [{"type": "sample", "checkpoint": "s", "prompt_tokens": 64, "max_tokens": 32, "count": 4}]


def scenario(tmp_path, endpoint: dict, name: str = "s.yaml") -> str:
    path = tmp_path / name
    body = {"name": "s", "endpoint": endpoint, "workload": {"clients": [{"requests": SAMPLES}]}}
    path.write_text(yaml.safe_dump(body))
    return str(path)


def with_(base: dict, **sections: dict) -> dict:
    out = json.loads(json.dumps(base))
    for key, value in sections.items():
        out.setdefault(key, {}).update(value)
    return out


REFUSED = [
    ({"inference": {"num_engines": 8}}, "8 x 1 = 8 devices"),
    ({"inference": {"tensor_parallel_size": 8}}, "1 x 8 = 8 devices"),
    ({"inference": {"num_engines": 2}}, "2 x 1 = 2 devices"),
    ({"inference": {"num_engines": 2, "tensor_parallel_size": 4}}, "2 x 4 = 8 devices"),
    ({"inference": {"num_engines": 10**6}}, f"less than or equal to {MAX_ENGINES}"),
    ({"inference": {"num_engines": 10**6}, "placement": {"colocate_all": False}}, f"less than or equal to {MAX_ENGINES}"),
    (
        {"inference": {"num_engines": MAX_ENGINES, "tensor_parallel_size": 512}, "placement": {"colocate_all": False}},
        f"over the limit of {MAX_DEVICES:,}",
    ),
]


@pytest.mark.parametrize(("change", "reason"), REFUSED, ids=[r for _, r in REFUSED])
def test_engines_that_do_not_fit_the_placement_are_refused(tmp_path, capsys, change, reason):
    started = time.process_time()
    code, out = run_cli(["check", scenario(tmp_path, with_(FOUR, **change)), "--quiet"], capsys)
    assert code == 2 and reason in out and "Traceback" not in out, out
    if "colocate_all" not in json.dumps(change) and "less than" not in reason:
        assert "num_policy_gpus must equal num_rollout_gpus" in out
    assert time.process_time() - started < 10  # 10^6 engines ran past 60 s


def test_a_set_or_a_grid_that_breaks_the_placement_is_refused_before_any_point_runs(tmp_path, capsys):
    path = scenario(tmp_path, with_(FOUR, inference={"num_engines": 4}))
    code, out = run_cli(["check", path, "--quiet", "--set", "inference.tensor_parallel_size=2"], capsys)
    assert code == 2 and "4 x 2 = 8 devices" in out, out
    code, out = run_cli(["sweep", path, "--grid", "inference.num_engines=4,8", "--jobs", "1"], capsys)
    assert code == 2 and "8 x 1 = 8 devices" in out and "--grid" in out, out


@pytest.mark.parametrize(
    "change",
    [
        {"inference": {"num_engines": 4}},
        {"inference": {"num_engines": 2, "tensor_parallel_size": 2}},
        {"inference": {"tensor_parallel_size": 4}},
        {},  # SkyRL's defaults stated nowhere: the simulator follows the busiest device and says so in the run's log
        {"trainer": {"strategy": "jax"}, "inference": {"num_engines": 8}},  # no vLLM on the JAX backend
    ],
)
def test_engines_that_cover_the_trainers_devices_run(tmp_path, capsys, change):
    code, out = run_cli(["check", scenario(tmp_path, with_(FOUR, **change)), "--quiet"], capsys)
    assert code in (0, 1) and "Traceback" not in out, out


def test_engines_on_devices_of_their_own_are_added_and_reported(tmp_path, capsys):
    endpoint = with_(FOUR, inference={"num_engines": 2, "tensor_parallel_size": 4}, placement={"colocate_all": False})
    path = scenario(tmp_path, endpoint)
    code, out = run_cli(["run", path], capsys)
    assert code == 0, out
    assert "devices: 4 for the trainer + 8 for vLLM (2 engine(s) x tensor_parallel_size 4" in out and "= 12" in out
    (tmp_path / "ep.yaml").write_text(yaml.safe_dump(endpoint))
    code, out = run_cli(["endpoints", "show", str(tmp_path / "ep.yaml")], capsys)
    assert code == 0 and "# devices: 4 for the trainer + 8 for vLLM" in out, out


def test_from_skyrl_refuses_what_skyrl_asserts(tmp_path, capsys):
    model = str(ROOT / "tests" / "data" / "skyrl_launches" / "qwen3-0.6b" / "config.json")
    args = ["endpoints", "from-skyrl", "--base-model", model, "--gpus", "4", "--backend-config"]
    colocated = {"generator.inference_engine.num_engines": 8}
    code, out = run_cli([*args, json.dumps(colocated)], capsys)
    assert code == 2 and "8 x 1 = 8 devices" in out and "Traceback" not in out, out
    separate = {**colocated, "trainer.placement.colocate_all": False}
    code, out = run_cli([*args, json.dumps(separate)], capsys)
    assert code == 0, out
    matched = {"generator.inference_engine.num_engines": 2, "generator.inference_engine.tensor_parallel_size": 2}
    code, out = run_cli([*args, json.dumps(matched)], capsys)
    assert code == 0, out


def test_vllm_tensor_parallel_must_divide_the_heads(tmp_path, capsys):
    """vLLM refuses a tensor parallel size that does not split the attention heads (qwen3-8b: 32); more ranks than KV
    heads is allowed (vLLM replicates them)."""
    separate = {"placement": {"colocate_all": False}}
    code, out = run_cli(
        ["check", scenario(tmp_path, with_(FOUR, inference={"tensor_parallel_size": 3}, **separate))], capsys
    )
    assert code == 2 and "inference.tensor_parallel_size" in out and "32 attention heads" in out, out
    code, out = run_cli(
        ["check", scenario(tmp_path, with_(FOUR, inference={"tensor_parallel_size": 16}, **separate))], capsys
    )
    assert code in (0, 1) and "Traceback" not in out, out
