"""Pipeline parallelism in the memory walk: each stage's layers, 1F1B's micro-batches in flight per stage (checked
against a hand run of the schedule's rules), a call that fails on the first stage while the last fits, and the
single-stage walk unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from project_paths import ROOT
from skyrl_sim.engine.pipeline import (
    event_starts,
    in_flight_microbatches,
    pipeline_stages,
    stage_order,
    stage_plan,
    warmup_microbatches,
)
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.architecture import PRESETS, ModelArch
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.units import GIB
from skyrl_sim_plugins.sim.bound.memory import AllocationWalk
from skyrl_sim_plugins.sim.description import moe_routes
from skyrl_sim_plugins.sim.reference.memory_walk import microbatch_orders
from skyrl_sim_plugins.sim.reference.static_memory import static_bytes

MODEL = dataclasses.replace(PRESETS["tiny-dense"], num_layers=4, layer_types=("full_attention",) * 4)
LENGTHS = [300, 250, 280, 120, 200, 100, 90, 80]  # eight micro-batches of one row


def endpoint(pp: int, memory_gib: float = 4.0) -> Endpoint:
    return Endpoint.model_validate(
        {
            "model": "tiny-dense",
            "hardware": {"profile": "cpu", "device_memory_gib": memory_gib, "reserve_gib": 0, "devices": pp},
            "parallelism": {"tp": 1, "pp": pp, "sequence_parallel": False},
            "trainer": {"recompute": {"granularity": "none"}},
        }
    )


def simulate_1f1b(pp: int, stage: int, num_microbatches: int) -> int:
    """The most micro-batches alive on ``stage``, by running 1F1B's order: warm-up forwards (one per later stage),
    then one forward and one backward each step, then the remaining backwards; a forward makes one alive, a
    backward retires the oldest."""
    warmup = min(pp - stage - 1, num_microbatches)
    events = ["F"] * warmup
    for _ in range(num_microbatches - warmup):
        events += ["F", "B"]
    events += ["B"] * warmup
    alive = most = 0
    for event in events:
        alive += 1 if event == "F" else -1
        most = max(most, alive)
    return most


def test_stage_layers_split_consecutively_with_the_first_stages_one_larger() -> None:
    assert [len(r) for r in pipeline_stages(10, 4)] == [3, 3, 2, 2]
    assert [list(r) for r in pipeline_stages(4, 2)] == [[0, 1], [2, 3]]
    plan = stage_plan(5, 3)
    assert [(s.index, list(s.layers), s.first, s.last) for s in plan] == [
        (0, [0, 1], True, False),
        (1, [2, 3], False, False),
        (2, [4], False, True),
    ]
    assert [(s.first, s.last) for s in stage_plan(2, 1)] == [(True, True)]
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        pipeline_stages(2, 3)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("nmb", [1, 3, 8])
def test_in_flight_microbatches_follow_1f1b(pp: int, nmb: int) -> None:
    """By hand: p=4, m=3 gives stages 0..3 3, 3, 2, 1 in flight; p=2, m=8 gives 2, 1; m=1 gives 1 everywhere."""
    hand = {
        (2, 1): [1, 1], (2, 3): [2, 1], (2, 8): [2, 1],
        (4, 1): [1, 1, 1, 1], (4, 3): [3, 3, 2, 1], (4, 8): [4, 3, 2, 1],
    }  # fmt: skip
    got = [in_flight_microbatches(s, pp, nmb) for s in range(pp)]
    assert got == hand[(pp, nmb)]
    assert got == [simulate_1f1b(pp, s, nmb) for s in range(pp)]
    assert [warmup_microbatches(s, pp, nmb) for s in range(pp)] == [min(pp - s - 1, nmb) for s in range(pp)]
    assert all(in_flight_microbatches(s, pp, nmb, forward_only=True) == 1 for s in range(pp))


def test_bad_stage_is_refused() -> None:
    with pytest.raises(ValueError, match="stage 2 is not one of 2 stages"):
        in_flight_microbatches(2, 2, 3)


def test_each_stage_holds_its_own_weights() -> None:
    ep = endpoint(2)
    first, last = stage_plan(MODEL.num_layers, 2)
    vocab = MODEL.vocab_size * MODEL.hidden_size * 2  # bf16
    first_w, last_w = static_bytes(MODEL, ep, first)["weights"], static_bytes(MODEL, ep, last)["weights"]
    assert first_w == last_w  # two layers each, the embedding on one, the output layer on the other
    assert static_bytes(MODEL, ep)["weights"] == last_w  # no stage given: the last
    four = [static_bytes(MODEL, endpoint(4), stage)["weights"] for stage in stage_plan(MODEL.num_layers, 4)]
    assert four[0] - four[1] == vocab and four[3] - four[2] == vocab  # one layer each; a middle stage has no vocab
    assert four[1] == four[2]


def walk(ep: Endpoint, model: ModelArch = MODEL, kind: str = "forward_backward"):
    return AllocationWalk().evaluate(shape_call(kind, LENGTHS, ep, MEGATRON), ep, model)


def test_the_first_stage_peaks_higher_and_fails_where_the_last_fits() -> None:
    """With eight micro-batches over two stages the first holds two micro-batches' activations at its peak, the last
    one (and its logits); shrink the device between the two peaks: stage 0 fails, the report says so."""
    report = walk(endpoint(2))
    assert report.oom is None and report.stage_peaks is not None and len(report.stage_peaks) == 2
    first, last = report.stage_peaks
    assert first > last
    assert report.peak_bytes == first
    assert "logits" not in report.breakdown or report.breakdown["logits"] == 0  # stage 0 runs no LM head

    tight = endpoint(2, memory_gib=(first + last) / 2 / GIB)
    failed = walk(tight)
    assert failed.oom is not None
    assert failed.oom.where["pp_stage"] == 0
    assert failed.oom.where["in_flight_microbatches"] == 2
    # the last stage alone fits on the same device
    assert last < tight.capacity_bytes


def test_the_first_stage_holds_one_more_micro_batch_than_one_alone() -> None:
    """Stage 0 of 2 with one micro-batch holds only it: its peak is below the same stage's with eight."""
    ep = endpoint(2)
    one = AllocationWalk().evaluate(shape_call("forward_backward", [300], ep, MEGATRON), ep, MODEL)
    assert one.stage_peaks is not None
    many = walk(ep)
    assert many.stage_peaks is not None
    assert many.stage_peaks[0] > one.stage_peaks[0]


def test_a_forward_call_keeps_one_micro_batch_per_stage() -> None:
    report = walk(endpoint(2), kind="forward")
    assert report.oom is None and report.stage_peaks is not None
    rows = report.resolve_timeline()
    assert all(row["layer"] != "pipeline_in_flight" for row in rows)
    assert {row["phase"] for row in rows} == {"forward"}


def test_a_single_stage_walk_has_no_stage_fields() -> None:
    """pp 1: the walk of the whole model, as before (the fast path and the step walk agree, no stage peaks)."""
    ep = endpoint(1)
    shape = shape_call("forward_backward", LENGTHS, ep, MEGATRON)
    fast = AllocationWalk().evaluate(shape, ep, MODEL)
    stepped = AllocationWalk().walk(shape, ep, MODEL)
    assert fast.peak_bytes == stepped.peak_bytes
    assert fast.stage_peaks is None and stepped.stage_peaks is None
    tight = endpoint(1, memory_gib=(fast.peak_bytes - 1) / GIB)
    oom = walk(tight).oom
    assert oom is not None and "pp_stage" not in oom.where


def test_routed_expert_ids_are_sliced_to_each_stage() -> None:
    """R3's compact ids on a stage cover only that stage's MoE layers (40 over 3 stages: 14, 13, 13 layers); the
    slices add up to the whole model's, and the walk of each stage holds its own slice."""
    model = PRESETS["qwen3.6-35b-a3b"]
    ep = load_scenario(ROOT / "scenarios" / "moe_r3.yaml").resolve("compact").endpoint
    ep.parallelism.pp = 3
    slices = [moe_routes.replay_layers(model, 3, stage) for stage in pipeline_stages(model.num_layers, 3)]
    assert sum(slices) == moe_routes.moe_layer_count(model)
    assert max(slices) == moe_routes.stage_moe_layers(model, 3)  # no stage given: the largest
    for stage, count in zip(pipeline_stages(model.num_layers, 3), slices, strict=True):
        tensors = {t.name: t for t in moe_routes.replay_mb_tensors(64, ep, model, stage)}
        assert tensors["r3.arrived"].shape == (64, 40, model.moe.top_k)  # every MoE layer arrives
        assert tensors["r3.replay_ids"].shape == (count, 64, model.moe.top_k)  # the stage's own, in int32
        assert tensors["r3.replay_ids"].dtype == "int32"


def test_a_later_stage_gives_back_its_p2p_tensors_after_each_micro_batch() -> None:
    """The last stage of two runs one micro-batch at a time and frees its received input and everything else after
    each backward; only the input gradient it sent back stays referenced (megatron-core's 1F1B loop keeps it in its
    ``input_tensor_grad`` local until the next ``backward_step`` returns): identical micro-batches after the first
    peak exactly one ``[s, b, h]`` gradient above the first, two or four alike."""
    ep = endpoint(2)
    peaks = []
    for count in (1, 2, 4):
        report = AllocationWalk().evaluate(shape_call("forward_backward", [63] * count, ep, MEGATRON), ep, MODEL)
        assert report.stage_peaks is not None
        peaks.append(report.stage_peaks)
    gradient = 64 * 1 * MODEL.hidden_size * 2  # [s, b, h] bf16 of one 64-token row
    assert peaks[1][1] == peaks[2][1] == peaks[0][1] + gradient
    assert peaks[2][0] > peaks[0][0]  # the first stage holds a second micro-batch


def test_events_follow_1f1b_on_one_clock() -> None:
    """Two stages, three micro-batches, unit forwards and backwards of 2: stage 0 runs F0 F1 B0 F2 B1 B2, stage 1 F0 B0
    F1 B1 F2 B2; each forward waits for the previous stage's, each backward for the next stage's."""
    costs = [[(1.0, 2.0)] * 3, [(1.0, 2.0)] * 3]
    starts = event_starts(costs)
    f, b = "forward", "backward"
    assert stage_order(0, 2, 3) == [(f, 0), (f, 1), (b, 0), (f, 2), (b, 1), (b, 2)]
    assert stage_order(1, 2, 3) == [(f, 0), (b, 0), (f, 1), (b, 1), (f, 2), (b, 2)]
    assert starts[(1, "forward", 0)] == starts[(0, "forward", 0)] + 1
    assert starts[(0, "backward", 0)] == starts[(1, "backward", 0)] + 2  # waits for stage 1's backward to end
    assert starts[(1, "backward", 0)] < starts[(0, "backward", 0)] < starts[(0, "backward", 1)]
    assert event_starts(costs, forward_only=True)[(1, "forward", 2)] == 3.0


def test_when_two_stages_fail_the_first_in_time_is_reported() -> None:
    """Between the two stages' peaks both fail; the report names the stage whose failing event starts first on the
    schedule's clock (the last stage's first backward precedes the first stage's), not the one with less of its own
    work done."""
    ep = endpoint(2)
    model = MODEL
    shape = shape_call("forward_backward", [300, 280], ep, MEGATRON)
    fits = AllocationWalk().evaluate(shape, ep, model)
    assert fits.stage_peaks is not None
    tight = endpoint(2, memory_gib=min(fits.stage_peaks) * 0.8 / GIB)
    walk = AllocationWalk().bind(tight, model)
    report = walk.evaluate(shape)
    stages = [walk.walk_bound(shape, None, stage) for stage in walk.stages()]
    assert all(r.oom is not None for r in stages)
    times = {r.oom.where["pp_stage"]: (r.oom.where["phase"], r.oom.where["microbatch"]) for r in stages}
    assert report.oom is not None
    first = report.oom.where["pp_stage"]
    mbs = shape.microbatches_of_rank(0)
    costs = [
        [o.phase_work for o in microbatch_orders(mbs, shape, tight, model, b.facts, walk.segments_of(b))[1]]
        for b in walk.stages()
    ]
    starts = event_starts(costs)
    other = 1 - first
    assert starts[(first, *times[first])] <= starts[(other, *times[other])]


def test_a_forward_call_keeps_what_the_1f1b_loop_references() -> None:
    """Forward-only, identical micro-batches: the first stage runs each micro-batch after the first beside the previous
    one's output (the loop's ``output_tensor``), exactly one ``[s, b, h]`` more; the last stage keeps nothing of the
    previous micro-batch, but its received input outlives its first layer, to the end of the micro-batch."""
    ep = endpoint(2)
    peaks = []
    for count in (1, 2):
        report = AllocationWalk().evaluate(shape_call("forward", [63] * count, ep, MEGATRON), ep, MODEL)
        assert report.stage_peaks is not None
        peaks.append(report.stage_peaks)
    hidden = 64 * 1 * MODEL.hidden_size * 2  # [s, b, h] bf16 of one 64-token row
    assert peaks[1][0] == peaks[0][0] + hidden
    assert peaks[1][1] == peaks[0][1]
    walk = AllocationWalk().bind(ep, MODEL)
    shape = shape_call("forward", [63], ep, MEGATRON)
    assert [bound.facts.stage for bound in walk.stages()] == stage_plan(4, 2)
    last = walk.walk_bound(shape, None, walk.stages()[1])
    rows = last.resolve_timeline()
    assert [row["layer"] for row in rows] == ["p2p", 2, "p2p", 3, "lm_head", "p2p"]
    assert rows[2]["op"] == "p2p.input_kept" and rows[2]["allocated"] == rows[1]["allocated"] + hidden
    assert rows[4]["allocated"] - rows[5]["allocated"] == hidden  # released after the LM head
