"""A ``config.json`` key known to change the network that the reader does not model is refused (exit 2) with the
key, what it turns on and the modelled families named; keys that change no tensor's size are listed with reasons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scenario_text import GOOD, run_cli, write
from skyrl_sim.schema.architecture import from_hf_config
from skyrl_sim.schema.network_keys import MODELLED, NO_MEMORY_EFFECT, UNMODELLED, is_set

DENSE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
}


def test_the_three_lists_are_disjoint() -> None:
    assert not MODELLED & set(NO_MEMORY_EFFECT)
    assert not MODELLED & set(UNMODELLED)
    assert not set(NO_MEMORY_EFFECT) & set(UNMODELLED)


@pytest.mark.parametrize("key", sorted(UNMODELLED))
def test_every_unmodelled_key_is_refused_by_name(key: str) -> None:
    with pytest.raises(ValueError, match=f"key '{key}'.*modelled families: dense"):
        from_hf_config({**DENSE, key: 8}, "tiny")


@pytest.mark.parametrize("value", [None, False, 0, [], {}])
def test_a_key_that_sets_nothing_is_not_refused(value: object) -> None:
    assert not is_set(value)
    from_hf_config({**DENSE, "final_logit_softcapping": value}, "tiny")


def test_a_key_in_a_text_config_or_beside_it_is_refused() -> None:
    with pytest.raises(ValueError, match="index_topk"):
        from_hf_config({"text_config": {**DENSE, "index_topk": 2048}}, "tiny")
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        from_hf_config({"text_config": dict(DENSE), "num_kv_shared_layers": 4}, "tiny")


@pytest.mark.parametrize("key", sorted(NO_MEMORY_EFFECT))
def test_keys_without_memory_effect_read(key: str) -> None:
    from_hf_config({**DENSE, key: 1}, "tiny")


def test_the_cli_exits_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**DENSE, "attention_chunk_size": 8192}))
    scenario = write(tmp_path, GOOD.replace("model: tiny-dense", f"model: {{config: {config}}}"))
    code, out = run_cli(["check", str(scenario)], capsys)
    assert code == 2
    assert "attention_chunk_size" in out and "chunked local attention" in out and str(config) in out
    assert "Traceback" not in out
