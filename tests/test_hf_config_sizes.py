"""A Hugging Face ``config.json`` gives sizes as JSON integers and switches as booleans: anything else (``"256"``,
``256.9``, ``true`` as a size, ``"false"`` as a switch) is refused with the key named, not read through ``int()``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scenario_text import GOOD, run_cli, write
from skyrl_sim.schema.architecture import from_hf_config

DENSE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
}
MOE = {**DENSE, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}


def test_a_well_formed_config_reads() -> None:
    arch = from_hf_config(dict(DENSE), "tiny")
    assert (arch.hidden_size, arch.num_kv_heads, arch.head_dim) == (256, 2, 64)
    assert from_hf_config(dict(MOE), "tiny-moe").moe is not None


@pytest.mark.parametrize(
    "key",
    ["hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size", "num_key_value_heads"],
)
@pytest.mark.parametrize("bad", ["256", 256.9, True, 2.0, None, [256]])
def test_a_size_that_is_no_integer_is_refused_with_its_key(key: str, bad: object) -> None:
    if bad is None and key in ("intermediate_size", "num_key_value_heads"):
        return  # optional sizes: null is "not given"
    with pytest.raises(ValueError, match=f"'{key}'|no '{key}'"):
        from_hf_config({**DENSE, key: bad}, "tiny")


@pytest.mark.parametrize("key", ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"])
@pytest.mark.parametrize("bad", ["8", 8.5, True])
def test_moe_sizes_are_strict_too(key: str, bad: object) -> None:
    with pytest.raises(ValueError, match=f"'{key}'"):
        from_hf_config({**MOE, key: bad}, "tiny-moe")


@pytest.mark.parametrize("key", ["tie_word_embeddings", "attn_output_gate"])
def test_a_switch_must_be_a_boolean(key: str) -> None:
    with pytest.raises(ValueError, match=f"'{key}'"):
        from_hf_config({**DENSE, key: "false"}, "tiny")


@pytest.mark.parametrize("bad", ['"256"', "256.9", "true"])
def test_the_cli_names_the_file_and_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(DENSE).replace('"hidden_size": 256', f'"hidden_size": {bad}'))
    scenario = write(tmp_path, GOOD.replace("model: tiny-dense", f"model: {{config: {config}}}"))
    code, out = run_cli(["check", str(scenario)], capsys)
    assert code == 2
    assert str(config) in out and "'hidden_size' must be an integer" in out and "Traceback" not in out
