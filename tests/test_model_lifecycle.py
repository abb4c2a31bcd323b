"""Model lifecycle in the engine rules: a request whose model is not loaded fails as SkyRL fails it.

The cases are SkyRL 0.4.0's: ``_filter_valid_requests`` for batches (a pass, a sample from a checkpoint), the checks
in ``process_*`` for singles, ``create_model`` loads, ``unload_model`` unloads (and is ignored when not loaded).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_sim.engine.request import Request
from skyrl_sim.engine.rules import apply_single, not_loaded_error, plan_iteration
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.endpoint import Engine
from skyrl_sim.schema.requests import PASSES
from skyrl_sim.schema.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]


def req(i: int, kind: str, model: str = "a", checkpoint: str = "") -> Request:
    return Request(id=i, type=kind, model_id=model, datums=(8,) if kind in PASSES else (), checkpoint=checkpoint)


def test_forward_queued_before_its_create_model_fails_instead_of_batching() -> None:
    queue = [req(1, "create_model"), req(2, "forward"), req(3, "forward_backward")]
    plan = plan_iteration(queue, Engine(), loaded=frozenset())
    assert [r.id for r in plan.rejected] == [2, 3]
    assert plan.forward == () and plan.forward_backward == ()
    assert [r.id for r in plan.singles] == [1]


def test_without_lifecycle_every_model_is_loaded() -> None:
    queue = [req(1, "create_model"), req(2, "forward")]
    plan = plan_iteration(queue, Engine())
    assert plan.rejected == ()
    assert [c.request_ids for c in plan.forward] == [[2]]


def test_other_models_still_batch() -> None:
    queue = [req(1, "forward_backward", "a"), req(2, "forward_backward", "b")]
    plan = plan_iteration(queue, Engine(), loaded=frozenset({"b"}))
    assert [c.request_ids for c in plan.forward_backward] == [[2]]
    assert [r.id for r in plan.rejected] == [1]


def test_sample_checks_the_model_only_when_it_names_a_checkpoint() -> None:
    queue = [req(1, "sample", "a", checkpoint="ck"), req(2, "sample", "b")]
    plan = plan_iteration(queue, Engine(sampling="serial"), loaded=frozenset())
    assert [r.id for r in plan.rejected] == [1]
    assert [c.request_ids for c in plan.samples] == [[2]]


def test_rejected_passes_still_cut_chunks() -> None:
    """SkyRL's chunks are cut from the selected set; each chunk is filtered when it runs."""
    queue = [req(1, "forward_backward", "x"), req(2, "forward_backward", "a"), req(3, "forward_backward", "a")]
    plan = plan_iteration(queue, Engine(forward_backward_max_request_count=2), loaded=frozenset({"a"}))
    assert [c.request_ids for c in plan.forward_backward] == [[2], [3]]
    assert "forward_backward request batch split 2" in plan.log


def test_singles_follow_create_and_unload_in_order() -> None:
    loaded: frozenset[str] | None = frozenset()
    outcomes = []
    for request in [req(1, "optim_step"), req(2, "create_model"), req(3, "optim_step"), req(4, "unload_model")]:
        loaded, error = apply_single(request, loaded)
        outcomes.append(error)
    assert outcomes == [not_loaded_error("a", single=True), None, None, None]
    assert loaded == frozenset()
    _, error = apply_single(req(5, "unload_model"), frozenset())
    assert error is None  # unloading a model that is not loaded is ignored, not failed


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["forward_backward", "forward", "optim_step", "sample", "create_model", "unload_model"]),
            st.sampled_from(["a", "b"]),
            st.booleans(),
        ),
        min_size=1,
        max_size=12,
    ),
    st.sets(st.sampled_from(["a", "b"])),
)
def test_no_request_of_an_unloaded_model_reaches_a_call(items: list[tuple[str, str, bool]], start: set[str]) -> None:
    pending = [req(i + 1, kind, model, "ck" if ckpt else "") for i, (kind, model, ckpt) in enumerate(items)]
    loaded: frozenset[str] | None = frozenset(start)
    while pending:
        plan = plan_iteration(pending, Engine(sampling="serial"), loaded)
        ran = set(plan.request_ids())
        assert ran
        for call in plan.batch_calls():
            for request in call.requests:
                assert loaded is not None
                assert request.model_id in loaded or (request.type == "sample" and not request.checkpoint)
        for request in plan.rejected:
            assert request.type in PASSES or request.type == "sample"
        for request in plan.singles:
            loaded, _ = apply_single(request, loaded)
        pending = [r for r in pending if r.id not in ran]


def test_simulator_fails_a_forward_submitted_before_create_model(tmp_path: Path) -> None:
    body = {
        "name": "lifecycle",
        "endpoint": str(ROOT / "scenarios" / "endpoints" / "skyrl-jax-cpu.yaml"),
        "workload": {
            "loaded_models": [],
            "clients": [
                {
                    "name": "t",
                    "model_id": "m",
                    "submit": {"mode": "back_to_back", "gap_s": 0},
                    "requests": [
                        {"type": "create_model"},
                        {"type": "forward", "lengths": [5]},
                        {"type": "forward_backward", "lengths": [5]},
                        {"type": "optim_step"},
                        {"type": "unload_model"},
                        {"type": "optim_step"},
                    ],
                }
            ],
        },
    }
    path = tmp_path / "lifecycle.yaml"
    path.write_text(yaml.safe_dump(body))
    result = PluginHost().run(load_scenario(path).resolve("default"), "sim")
    status = {r.id: (r.status, r.error) for r in result.requests}
    assert status[1] == ("completed", None)
    assert status[2] == ("failed", "Model m not loaded")
    assert status[3] == ("failed", "Model m not loaded")
    assert status[4] == ("completed", None)  # the same singles phase, after create_model has loaded the model
    assert status[5] == ("completed", None)
    assert status[6] == ("failed", not_loaded_error("m", single=True))
    assert [c.kind for c in result.calls] == ["create_model", "optim_step", "unload_model", "optim_step"]
