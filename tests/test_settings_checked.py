"""Settings are checked where SkyRL checks them: a loss's ``loss_fn_config`` holds exactly what that loss reads on the
endpoint's backend; ``from-skyrl`` follows the config's ``strategy`` as SkyRL does; ``endpoints show`` and ``list``
refuse the flags they would ignore; an empty value says what to give; ``--jobs`` past the CPUs is capped and said;
a model id is visible text."""

from __future__ import annotations

import json

import pytest
import yaml

from project_paths import ROOT
from scenario_text import GOOD, run_cli, write
from skyrl_sim.commands.executors import check_jobs, usable_cpus

RL = """
name: rl
endpoint:
  model: tiny-dense
  trainer: {strategy: STRATEGY}
  hardware: {profile: cpu, devices: 1, device_memory_gib: 8, reserve_gib: 0}
workload:
  clients:
    - requests:
        - type: forward_backward
          loss_fn: LOSS
          loss_fn_config: CONFIG
          loss_fn_inputs: {logprobs: -6.0, advantages: 1.0}
          datums: [20]
"""


def rl(tmp_path, loss: str, config: dict, strategy: str = "megatron"):
    text = RL.replace("STRATEGY", strategy).replace("LOSS", loss).replace("CONFIG", json.dumps(config))
    return write(tmp_path, text)


REFUSED = [
    ("ppo", {"clip_lo_threshold": 0.8}, "megatron", "clip_lo_threshold", "reads only clip_low_threshold"),
    ("ppo", {"clip_low_threshold": 1.2, "clip_high_threshold": 0.8}, "megatron", "clip_low_threshold", "[0, 1]"),
    ("ppo", {"clip_low_threshold": -0.1}, "megatron", "clip_low_threshold", "outside [0, 1]"),
    ("ppo", {"clip_high_threshold": 0.5}, "megatron", "clip_high_threshold", "below 1"),
    ("gspo", {"eps_clip_low": 0.2}, "fsdp", "eps_clip_low", "reads only clip_low_threshold"),
    ("importance_sampling", {"clip_low_threshold": 0.8}, "megatron", "clip_low_threshold", "reads no setting"),
    ("cispo", {"clip_high_threshold": 1.2}, "megatron", "clip_high_threshold", "reads no setting"),
    ("dppo", {"delta_low": -0.2}, "megatron", "delta_low", "negative"),
    ("dppo", {"clip_low_threshold": 0.8}, "megatron", "clip_low_threshold", "reads only delta_low"),
    ("gspo", {"clip_low_threshold": 0.8}, "jax", "clip_low_threshold", "on the JAX backend"),
]


@pytest.mark.parametrize(("loss", "config", "strategy", "key", "reason"), REFUSED, ids=[r[3] + "-" + r[0] for r in REFUSED])
def test_a_loss_setting_the_loss_does_not_read_is_refused(tmp_path, capsys, loss, config, strategy, key, reason):
    code, out = run_cli(["check", str(rl(tmp_path, loss, config, strategy)), "--quiet"], capsys)
    assert code == 2 and "Traceback" not in out, out
    assert f"loss_fn_config.{key}" in out and reason in out, out


@pytest.mark.parametrize(
    ("loss", "config", "strategy"),
    [
        ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, "megatron"),
        ("gspo", {"clip_low_threshold": 0.0, "clip_high_threshold": 1.0}, "fsdp"),
        ("dppo", {"delta_low": 0.05, "delta_high": 0.0}, "megatron"),
        ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0}, "jax"),
    ],
)
def test_the_settings_a_loss_reads_are_accepted(tmp_path, capsys, loss, config, strategy):
    code, out = run_cli(["check", str(rl(tmp_path, loss, config, strategy)), "--quiet"], capsys)
    assert code in (0, 1) and "Traceback" not in out, out


def test_a_variant_or_set_that_adds_a_setting_is_blamed(tmp_path, capsys):
    path = rl(tmp_path, "ppo", {"clip_low_threshold": 0.8})
    key = "workload.clients.0.requests.0.loss_fn"
    code, out = run_cli(["check", str(path), "--quiet", "--set", f"{key}=importance_sampling"], capsys)
    assert code == 2 and "--set" in out and "importance_sampling" in out and "reads no setting" in out, out


@pytest.mark.parametrize(
    "key", ["trainer.bogus.low=1", "trainer.bogus=1", "inference.bogus.deeper.still=x", "trainer.expandable_segments=true"]
)
def test_a_refused_key_a_set_creates_is_blamed_on_the_set(tmp_path, capsys, key):
    path = write(tmp_path, GOOD)
    code, out = run_cli(["check", str(path), "--quiet", "--set", key], capsys)
    assert code == 2 and "error: --set" in out and "Traceback" not in out, out


@pytest.mark.parametrize(
    ("setting", "named"),
    [("parallelism.tp=1000", "parallelism.tp 1000"), ("hardware.devices=3", "hardware.devices is 3")],
)
def test_sizes_that_must_agree_are_blamed_on_the_set_that_broke_them(capsys, setting, named):
    """The parallel sizes and the device count are checked together (a validator of the whole endpoint): the error
    names the --set that broke the agreement and each size, not the endpoint file that was fine before it."""
    code, out = run_cli(["check", str(ROOT / "scenarios" / "queue_drain_17.yaml"), "--quiet", "--set", setting], capsys)
    key = setting.split("=")[0]
    assert code == 2 and f"error: --set, key '{key}'" in out and named in out, out
    assert "Value error" not in out and "Traceback" not in out, out


MODEL = str(ROOT / "tests" / "data" / "skyrl_launches" / "qwen3-0.6b" / "config.json")
FROM = ["endpoints", "from-skyrl", "--base-model", MODEL, "--gpus", "1"]


def test_from_skyrl_follows_the_configs_strategy_as_skyrl_does(tmp_path, capsys):
    out = tmp_path / "ep.yaml"
    config = {"strategy": "fsdp", "trainer.strategy": "megatron"}
    code, text = run_cli([*FROM, "--backend", "megatron", "--backend-config", json.dumps(config), "--out", str(out)], capsys)
    assert code == 0, text
    endpoint = yaml.safe_load(out.read_text())
    assert endpoint["trainer"]["strategy"] == "fsdp" and endpoint["name"].endswith("-fsdp")
    assert "replaces --backend megatron's: SkyRL runs fsdp" in text
    assert "NOT MAPPED trainer.strategy" in text and "overwrites it" in text
    code, text = run_cli([*FROM, "--backend-config", json.dumps({"strategy": "deepspeed"})], capsys)
    assert code == 2 and "only fsdp or megatron" in text, text


@pytest.mark.parametrize("size", [0, -2, 1.5, True, None, [2], "x", 1e300])
@pytest.mark.parametrize("key", ["tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"])
def test_from_skyrl_refuses_a_model_parallel_size_that_is_no_positive_integer(capsys, key, size):
    config = {f"trainer.policy.megatron_config.{key}": size}
    code, out = run_cli([*FROM, "--backend-config", json.dumps(config)], capsys)
    assert code == 2 and key in out and "Traceback" not in out, out


@pytest.mark.parametrize(
    "args",
    [
        ["endpoints", "show", "tiny-cpu-tp1", "--gpus", "8"],
        ["endpoints", "show", "tiny-cpu-tp1", "--lora-rank", "4"],
        ["endpoints", "show", "tiny-cpu-tp1", "--out", "x.yaml"],
        ["endpoints", "show", "tiny-cpu-tp1", "--backend", "fsdp"],
        ["endpoints", "list", "--gpu", "h100"],
        ["endpoints", "from-skyrl", "extra-name", "--base-model", MODEL, "--gpus", "1"],
    ],
)
def test_endpoints_refuses_the_flags_it_would_ignore(tmp_path, capsys, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(args, capsys)
    assert code == 2 and "Traceback" not in out, out
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--set", "skyrl_version="], "give one"),
        (["--set", "skyrl_version=''"], "'0.4.0' or 'pr1874'"),
        (["--set", "skyrl_version=null"], "'0.4.0' or 'pr1874'"),
    ],
)
def test_an_empty_version_says_what_to_give(tmp_path, capsys, args, needle):
    code, out = run_cli(["check", str(write(tmp_path, GOOD)), "--quiet", *args], capsys)
    assert code == 2 and needle in out and "write null" not in out, out


def test_an_empty_grid_value_says_what_to_give(tmp_path, capsys):
    code, out = run_cli(["sweep", str(write(tmp_path, GOOD)), "--grid", "skyrl_version=,0.4.0"], capsys)
    assert code == 2 and "give one" in out and "write null" not in out, out


@pytest.mark.parametrize("model_id", ["", "   ", "a\nb", "tab\there", "x" * 5000])
def test_a_model_id_is_visible_text(tmp_path, capsys, model_id):
    text = GOOD.replace("    - requests:", f"    - model_id: {json.dumps(model_id)}\n      requests:")
    code, out = run_cli(["check", str(write(tmp_path, text)), "--quiet"], capsys)
    assert code == 2 and "model_id" in out and "Traceback" not in out, out


def test_jobs_past_the_cpus_are_capped_and_said(tmp_path, capsys):
    cpus = usable_cpus()
    assert check_jobs(cpus + 5) == cpus
    assert f"running {cpus} workers" in capsys.readouterr().err
    assert check_jobs(cpus + 5, address="10.0.0.1:6379") == cpus + 5  # a cluster's CPUs are its own
    assert check_jobs(1) == 1 and check_jobs(None) is None
    code, out = run_cli(
        ["sweep", str(write(tmp_path, GOOD)), "--grid", "engine.cap_aware_padding=true,false", "--jobs", "200"], capsys
    )
    assert code == 0 and f"--jobs 200: this machine has {cpus} CPU(s)" in out, out
    for bad in ("0", "-3", "257"):
        code, out = run_cli(
            ["sweep", str(write(tmp_path, GOOD)), "--grid", "engine.cap_aware_padding=true", "--jobs", bad], capsys
        )
        assert code == 2 and "--jobs" in out, out


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--gpus", "0"], "--gpus"),
        (["--lora-rank", "-1"], "--lora-rank"),
        (["--device-memory-gib", "nan"], "--device-memory-gib"),
        (["--device-memory-gib", "inf"], "--device-memory-gib"),
        (["--gpu", "nosuch", "--device-memory-gib", "80"], "--gpu"),
    ],
)
def test_from_skyrl_names_the_flag_a_bad_value_came_from(capsys, flags, named):
    code, out = run_cli([*FROM[:-2], *(["--gpus", "1"] if "--gpus" not in flags else []), *flags], capsys)
    assert code == 2 and out.startswith(f"error: {named}") and "Traceback" not in out, out
