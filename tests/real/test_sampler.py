"""The sampler: server lifecycle on small real servers (fast), then vLLM itself on tiny random Llama checkpoints (real).

The fast tests run a throw-away Python HTTP server that spawns a grandchild, so "the whole process group is gone"
means something. The ``real`` tests start vLLM twice per module (one start per checkpoint; each costs 15-90 s here)
and compare its greedy output token for token with transformers' ``generate`` on the same checkpoint.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyrl_sim.schema.architecture import PRESETS
from skyrl_sim_plugins.megatron_vllm import vllm_server
from skyrl_sim_plugins.megatron_vllm.generation_client import GenerationRejected
from skyrl_sim_plugins.megatron_vllm.local_ports import free_port
from skyrl_sim_plugins.megatron_vllm.sampler import SamplerError, VllmSampler, checkpoint_fingerprint
from skyrl_sim_plugins.megatron_vllm.vllm_server import (
    SERVED_MODEL_NAME,
    ServerError,
    ServerProcess,
    ServerStartTimeout,
    VllmServer,
    group_members,
)

ARCH = PRESETS["tiny-dense"]

SERVER_SCRIPT = textwrap.dedent(
    """
    import signal, subprocess, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    port, mode = int(sys.argv[1]), sys.argv[2]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a grandchild to clean up
    print("child", child.pid, flush=True)
    if mode == "die":
        sys.exit(3)
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if mode != "never-ready" else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "server.py"
    path.write_text(SERVER_SCRIPT)
    return path


def launch(script: Path, tmp_path: Path, mode: str) -> ServerProcess:
    port = free_port()
    return ServerProcess([sys.executable, str(script), str(port), mode], port=port, log_path=tmp_path / f"{mode}.log")


def wait_gone(pgid: int, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return group_members(pgid)


# ---------------------------------------------------------------------------------------------------------- lifecycle


def test_server_process_starts_healthy_and_stop_kills_the_whole_group(script: Path, tmp_path: Path) -> None:
    server = launch(script, tmp_path, "ok")
    server.start(timeout_s=30)
    try:
        assert server.alive() and server.start_seconds is not None
        assert server.pgid is not None and len(group_members(server.pgid)) == 2  # the server and its grandchild
    finally:
        server.stop()
    assert group_members(server.pgid) == []
    server.stop()  # idempotent


def test_sigterm_ignored_escalates_to_sigkill(script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_server, "STOP_GRACE_S", 0.5)
    server = launch(script, tmp_path, "ignore-term")
    server.start(timeout_s=30)
    pgid = server.pgid
    assert pgid is not None
    began = time.monotonic()
    server.stop()
    assert group_members(pgid) == []
    assert time.monotonic() - began >= 0.5  # it waited the grace period before SIGKILL


def test_a_server_that_dies_during_startup_reports_its_log(script: Path, tmp_path: Path) -> None:
    server = launch(script, tmp_path, "die")
    with pytest.raises(ServerError, match=r"exited with code 3[\s\S]*child \d+"):
        server.start(timeout_s=30)
    assert server.pgid is not None and wait_gone(server.pgid) == []  # the grandchild went too


def test_a_server_never_healthy_times_out_and_is_stopped(script: Path, tmp_path: Path) -> None:
    server = launch(script, tmp_path, "never-ready")
    began = time.monotonic()
    with pytest.raises(ServerStartTimeout, match="not healthy"):
        server.start(timeout_s=3)
    assert time.monotonic() - began < 60  # the 3 s start timeout and the stop, not a hang (margin for a loaded machine)
    assert server.pgid is not None and group_members(server.pgid) == []


def test_interpreter_exit_stops_a_server_nobody_stopped(script: Path, tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from skyrl_sim_plugins.megatron_vllm.local_ports import free_port
        from skyrl_sim_plugins.megatron_vllm.vllm_server import ServerProcess
        port = free_port()
        server = ServerProcess([sys.executable, {str(script)!r}, str(port), "ok"], port=port,
                               log_path=Path({str(tmp_path / "atexit.log")!r}))
        server.start(timeout_s=30)
        print(server.pgid, flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pgid = int(done.stdout.split()[-1])
    assert wait_gone(pgid) == []


# ------------------------------------------------------------------------------------------------ checkpoint handling


def write_checkpoint(path: Path, seed: int) -> Path:
    """A tiny random LlamaForCausalLM checkpoint, written the way the training side writes one."""
    torch = pytest.importorskip("torch")
    hf_export = pytest.importorskip("skyrl_sim_plugins.megatron_vllm.hf_export")
    return hf_export.write_checkpoint(hf_export.init_hf_weights(ARCH, seed), ARCH, path, torch.float32)


def test_fingerprint_follows_the_weights_not_only_the_path(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "a", seed=1)
    first = checkpoint_fingerprint(ckpt)
    assert checkpoint_fingerprint(ckpt) == first
    time.sleep(0.01)
    write_checkpoint(ckpt, seed=2)  # saved again under the same name
    assert checkpoint_fingerprint(ckpt) != first
    assert checkpoint_fingerprint(tmp_path / "a" / ".." / "a") == checkpoint_fingerprint(ckpt)


@pytest.mark.parametrize(
    ("setup", "message"),
    [("missing", "does not exist"), ("no-config", "no config.json"), ("no-weights", "no weights")],
)
def test_unusable_checkpoints_are_refused_before_any_start(tmp_path: Path, setup: str, message: str) -> None:
    ckpt = tmp_path / "ckpt"
    if setup != "missing":
        ckpt.mkdir()
    if setup == "no-weights":
        (ckpt / "config.json").write_text("{}")
    with VllmSampler(tmp_path / "work") as sampler:
        with pytest.raises(SamplerError, match=message):
            sampler.sample(ckpt, [[1, 2]], max_tokens=2, num_samples=1, seed=0)
        assert sampler.server is None


@pytest.mark.parametrize(
    ("prompts", "kwargs", "message"),
    [
        ([[1, 2], []], {}, "prompt 1 is empty"),
        (
            [[1, ARCH.vocab_size]],
            {},
            f"token id {ARCH.vocab_size}, outside the checkpoint's vocabulary of {ARCH.vocab_size}",
        ),
        ([[1]], {"max_tokens": 0}, "max_tokens"),
        ([[1]], {"num_samples": 0}, "num_samples"),
        ([[1]], {"temperature": -1.0}, "temperature"),
    ],
)
def test_bad_sample_arguments_fail_before_any_start(tmp_path: Path, prompts: list, kwargs: dict, message: str) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", seed=1)
    args = {"max_tokens": 2, "num_samples": 1, "seed": 0} | kwargs
    with VllmSampler(tmp_path / "work") as sampler:
        with pytest.raises(ValueError, match=message):
            sampler.sample(ckpt, prompts, **args)
        assert sampler.server is None


def test_vllm_command_line_serves_the_checkpoint_offline(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", seed=1)
    server = VllmServer(ckpt, tmp_path / "logs", return_routed_experts=True, extra_args=["--max-num-seqs", "8"])
    argv = server.argv(port=4321)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(argv[3::], argv[4::], strict=False))
    assert pairs["--model"] == str(ckpt) and pairs["--port"] == "4321" and pairs["--host"] == "127.0.0.1"
    assert pairs["--dtype"] == "float32" and pairs["--served-model-name"] == SERVED_MODEL_NAME
    assert {"--skip-tokenizer-init", "--enforce-eager", "--enable-return-routed-experts"} <= set(argv)
    assert argv[-2:] == ["--max-num-seqs", "8"]
    env = server.environment()
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1" and "VLLM_CPU_KVCACHE_SPACE" in env


# -------------------------------------------------------------------------------------------------------- real vLLM

PROMPTS = [[5, 17, 200, 3, 9], [100, 101, 102, 103, 104, 105, 106, 107, 108], [42] * 3 + list(range(300, 314))]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {"a": write_checkpoint(root / "a", seed=1), "b": write_checkpoint(root / "b", seed=2)}


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    """transformers' greedy ``generate`` on each checkpoint (end-of-sequence disabled, as the sampler does)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out: dict[str, list[list[int]]] = {}
    for name, path in checkpoints.items():
        model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        rows = []
        with torch.no_grad():
            for prompt in PROMPTS:
                ids = torch.tensor([prompt])
                generated = model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=0
                )
                rows.append(generated[0, len(prompt) :].tolist())
        out[name] = rows
    return out


@pytest.fixture(scope="module")
def sampler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmSampler]:
    pytest.importorskip("vllm")
    s = VllmSampler(tmp_path_factory.mktemp("sampler"), startup_timeout_s=300)
    try:
        yield s
    finally:
        s.close()
        print(f"\nvLLM start times (s): {[round(t, 1) for t in s.start_seconds]}")


@pytest.mark.real
def test_greedy_matches_transformers_token_for_token(sampler: VllmSampler, checkpoints: dict, reference: dict) -> None:
    out = sampler.sample(checkpoints["a"], PROMPTS, max_tokens=MAX_TOKENS, num_samples=1, seed=0)
    assert [samples[0] for samples in out] == reference["a"]
    assert all(len(samples) == 1 and len(samples[0]) == MAX_TOKENS for samples in out)


@pytest.mark.real
def test_greedy_is_repeatable_on_the_same_server(sampler: VllmSampler, checkpoints: dict, reference: dict) -> None:
    pid, starts = sampler.server_pid, len(sampler.start_seconds)
    out = sampler.sample(checkpoints["a"], PROMPTS, max_tokens=MAX_TOKENS, num_samples=3, seed=5)
    assert sampler.server_pid == pid and len(sampler.start_seconds) == starts  # same checkpoint: no restart
    assert [samples for samples in out] == [[row] * 3 for row in reference["a"]]


@pytest.mark.real
def test_seeded_sampling_with_temperature(sampler: VllmSampler, checkpoints: dict, reference: dict) -> None:
    def draw(seed: int) -> list[list[list[int]]]:
        return sampler.sample(
            checkpoints["a"], PROMPTS[:2], max_tokens=MAX_TOKENS, num_samples=2, seed=seed, temperature=1.0
        )

    first = draw(7)
    assert draw(7) == first  # same seed, same samples
    assert draw(8) != first
    assert all(a != b for a, b in first)  # two samples of one prompt differ
    assert [samples[0] for samples in first] != reference["a"][:2]  # not greedy
    assert all(len(s) == MAX_TOKENS and all(0 <= t < ARCH.vocab_size for t in s) for p in first for s in p)


@pytest.mark.real
def test_a_request_vllm_refuses_is_a_clear_immediate_error(sampler: VllmSampler, checkpoints: dict) -> None:
    assert sampler.client is not None
    sent = sampler.client.requests_sent
    with pytest.raises(GenerationRejected, match=r"HTTP 400") as info:
        sampler.sample(checkpoints["a"], [[1, 2, 3]], max_tokens=10**6, num_samples=1, seed=0)
    assert "max_tokens" in str(info.value) or "context length" in str(info.value)
    assert sampler.client.requests_sent == sent + 1  # not retried
    assert sampler.sample(checkpoints["a"], [[1, 2, 3]], max_tokens=2, num_samples=1, seed=0)  # server still serves


@pytest.mark.real
def test_new_checkpoint_restarts_the_server_and_changes_the_output(
    sampler: VllmSampler, checkpoints: dict, reference: dict
) -> None:
    old_pgid, starts = sampler.server_pgid, len(sampler.start_seconds)
    assert old_pgid is not None
    out = sampler.sample(checkpoints["b"], PROMPTS, max_tokens=MAX_TOKENS, num_samples=1, seed=0)
    assert len(sampler.start_seconds) == starts + 1 and sampler.served_checkpoint == str(checkpoints["b"].resolve())
    assert group_members(old_pgid) == []  # the previous server is gone, children included
    assert [samples[0] for samples in out] == reference["b"]
    assert reference["b"] != reference["a"]


@pytest.mark.real
def test_an_exception_inside_the_with_block_stops_the_server(sampler: VllmSampler) -> None:
    pgid = sampler.server_pgid
    assert pgid is not None and group_members(pgid)

    class Boom(Exception):
        pass

    with pytest.raises(Boom), sampler:
        raise Boom
    assert group_members(pgid) == [] and sampler.server is None and sampler.server_pid is None
