"""SkyRL's scheduling rules: worked examples from the engine notes and hypothesis properties over random queues."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_sim.engine.request import BARRIERS, Request
from skyrl_sim.engine.rules import actionable, apply_single, barriers, plan_iteration
from skyrl_sim.engine.shapes import FSDP, MEGATRON, call_micro_batch_size, shape_call
from skyrl_sim.schema.endpoint import Endpoint, Engine
from skyrl_sim.schema.requests import PASSES

TYPES = ["forward_backward", "forward", "optim_step", "sample", "save_weights_for_sampler", "load_weights"]


def req(i: int, kind: str, model: str = "a", tokens: int = 10, checkpoint: str = "") -> Request:
    datums = (tokens,) if kind in PASSES else ()
    return Request(id=i, type=kind, model_id=model, datums=datums, checkpoint=checkpoint)


def drain(pending: list[Request], engine: Engine) -> list:
    """Run iterations until the queue is empty; every iteration must make progress."""
    plans = []
    while pending:
        plan = plan_iteration(pending, engine)
        ran = set(plan.request_ids())
        assert ran, "an iteration with pending work ran nothing"
        plans.append((list(pending), plan))
        pending = [r for r in pending if r.id not in ran]
    return plans


def test_barrier_splits_fb_opt_pairs_into_iterations():
    queue = [req(1, "forward_backward"), req(2, "optim_step"), req(3, "forward_backward"), req(4, "optim_step")]
    plans = drain(queue, Engine())
    assert [plan.request_ids() for _, plan in plans] == [[1, 2], [3, 4]]


def test_barriers_are_per_model():
    queue = [req(1, "optim_step", "a"), req(2, "forward_backward", "a"), req(3, "forward_backward", "b")]
    plan = plan_iteration(queue, Engine())
    assert [c.request_ids for c in plan.forward_backward] == [[3]]
    assert [r.id for r in plan.singles] == [1]


def test_groups_per_model_in_order_of_first_appearance():
    queue = [req(1, "forward_backward", "b"), req(2, "forward_backward", "a"), req(3, "forward_backward", "b")]
    plan = plan_iteration(queue, Engine())
    assert [(c.model_id, c.request_ids) for c in plan.forward_backward] == [("b", [1, 3]), ("a", [2])]


def test_cap_chunks_in_id_order_and_logs_split():
    queue = [req(i, "forward_backward") for i in range(1, 6)]
    plan = plan_iteration(queue, Engine(forward_backward_max_request_count=2))
    assert [c.request_ids for c in plan.forward_backward] == [[1, 2], [3, 4], [5]]
    assert plan.log == ("forward_backward request batch split 3",)
    assert [c.request_ids for c in plan_iteration(queue, Engine()).forward_backward] == [[1, 2, 3, 4, 5]]


def test_forward_is_never_chunked():
    queue = [req(i, "forward") for i in range(1, 6)]
    plan = plan_iteration(queue, Engine(forward_backward_max_request_count=1))
    assert [c.request_ids for c in plan.forward] == [[1, 2, 3, 4, 5]]


def test_continuous_sampling_admits_only_older_samples_first():
    queue = [req(1, "sample"), req(2, "forward_backward"), req(3, "sample")]
    plan = plan_iteration(queue, Engine(sampling="continuous"))
    assert [r.id for r in plan.admitted] == [1]
    assert plan.drain == ("forward_backward",)
    assert plan.samples == ()
    alone = plan_iteration([req(3, "sample"), req(4, "sample")], Engine(sampling="continuous"))
    assert [r.id for r in alone.admitted] == [3, 4]
    assert alone.drain == ()


def test_serial_sampling_one_batch_one_checkpoint_per_model_and_cap():
    queue = [
        req(1, "sample", "a", checkpoint="c1"),
        req(2, "sample", "a", checkpoint="c2"),
        req(3, "sample", "b", checkpoint="x"),
        req(4, "sample", "a", checkpoint="c1"),
    ]
    plan = plan_iteration(queue, Engine(sampling="serial"))
    assert [c.request_ids for c in plan.samples] == [[1, 3, 4]]
    capped = plan_iteration(queue, Engine(sampling="serial", sample_max_num_sequences=2))
    assert [c.request_ids for c in capped.samples] == [[1, 3]]


queues = st.lists(
    st.tuples(st.sampled_from(TYPES), st.sampled_from(["a", "b", "c"]), st.integers(1, 5000)), min_size=1, max_size=40
)


@settings(max_examples=200, deadline=None)
@given(queues, st.one_of(st.none(), st.integers(1, 6)), st.sampled_from(["continuous", "serial"]))
def test_properties_over_random_queues(items, cap, sampling):
    queue = [
        req(i + 1, kind, model, tokens, "ck" if kind == "sample" else "") for i, (kind, model, tokens) in enumerate(items)
    ]
    engine = Engine(forward_backward_max_request_count=cap, sampling=sampling)
    seen: list[int] = []
    for snapshot, plan in drain(queue, engine):
        barrier = barriers(snapshot)
        for call in plan.batch_calls():
            ids = call.request_ids
            # id order is kept inside a call (and a call is one model, except a serial cross-model sample batch)
            assert ids == sorted(ids)
            if call.kind in PASSES:
                assert {r.model_id for r in call.requests} == {call.model_id}
                # no pass crosses its model's destructive barrier
                assert all(r.id < barrier.get(r.model_id, float("inf")) for r in call.requests)
            if call.kind == "forward_backward" and cap is not None:
                assert len(ids) <= cap
        singles = [r.id for r in plan.singles]
        assert singles == sorted(singles)
        seen.extend(plan.request_ids())
    # every request runs in exactly one call
    assert sorted(seen) == [r.id for r in queue]
    assert len(seen) == len(set(seen))


LIFECYCLE = [*TYPES, "create_model", "unload_model", "save_weights"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(LIFECYCLE), st.sampled_from(["a", "b", "c"]), st.sampled_from(["", "c1", "c2"])),
        min_size=1,
        max_size=60,
    ),
    st.one_of(st.none(), st.integers(1, 4)),
    st.sampled_from(["continuous", "serial"]),
    st.one_of(st.none(), st.integers(1, 3)),
    st.one_of(st.none(), st.frozensets(st.sampled_from(["a", "b", "c"]))),
)
def test_the_actionable_requests_plan_as_the_whole_queue(items, cap, sampling, max_samples, loaded):
    """``actionable`` leaves out a model's blocked backlog; the plan from what is left is the plan from the whole
    queue, iteration after iteration until the queue drains (models loaded and unloaded on the way)."""
    pending = [req(i + 1, kind, model, 10, checkpoint) for i, (kind, model, checkpoint) in enumerate(items)]
    engine = Engine(forward_backward_max_request_count=cap, sampling=sampling, sample_max_num_sequences=max_samples)
    while pending:
        queues: dict[str, list[Request]] = {}
        for request in pending:
            if request.type != "sample":
                queues.setdefault(request.model_id, []).append(request)
        some = actionable(
            queues.values(), [r for r in pending if r.type == "sample"], continuous=sampling == "continuous"
        )
        plan = plan_iteration(pending, engine, loaded)
        assert plan_iteration(some, engine, loaded) == plan
        ran = set(plan.request_ids())
        assert ran and ran <= {r.id for r in some}
        for single in plan.singles:
            loaded, _ = apply_single(single, loaded)
        pending = [r for r in pending if r.id not in ran]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 40_000), min_size=1, max_size=64),
    st.integers(1, 4),
    st.integers(1, 16),
    st.sampled_from([1, 2, 4]),
    st.booleans(),
    st.booleans(),
    st.sampled_from([-1, 4096, 50_000]),
)
def test_padded_rows_are_multiples_of_the_alignment(lengths, dp, micro, tp, cap_aware, remove_padding, budget):
    endpoint = Endpoint.model_validate(
        {
            "model": "tiny-dense",
            "hardware": {"devices": dp * tp},
            "parallelism": {"tp": tp, "dp": dp},
            "trainer": {
                "micro_train_batch_size_per_gpu": micro,
                "remove_microbatch_padding": remove_padding,
                "max_tokens_per_microbatch": budget,
            },
            "engine": {"cap_aware_padding": cap_aware},
        }
    )
    for rule in (MEGATRON, FSDP):
        shape = shape_call("forward_backward", lengths, endpoint, rule)
        assert shape.padded_rows % shape.alignment == 0
        assert shape.padded_rows >= shape.rows == len(lengths)
        assert shape.width == max(lengths) + 1
        real = [mb for mb in shape.microbatches if not mb.dummy]
        assert sum(len(mb.row_tokens) for mb in real) == shape.padded_rows  # dummy rows are none of the call's
        if budget > 0 and rule is MEGATRON:  # _pad_microbatch_to_size: one row count per rank
            assert all(len({mb.rows for mb in shape.microbatches_of_rank(r)}) == 1 for r in range(dp))
        if rule is FSDP:
            assert all(mb.dummy_rows == 0 for mb in shape.microbatches)
        assert shape.slots >= shape.real_tokens
        for mb in real:
            # Megatron's sequence parallelism splits a micro-batch's tokens over TP; FSDP has no TP and runs every
            # micro-batch at the call's width (SkyRL's FSDP worker trims nothing)
            assert mb.packed or (mb.width % tp == 0 if rule is MEGATRON else mb.width == shape.width)
            if budget > 0 and len(mb.row_tokens) > 1:
                assert mb.real_tokens <= budget
        counts = {len(shape.microbatches_of_rank(r)) for r in range(dp)}
        assert len(counts) == 1  # every DP rank runs the same number of micro-batches
    plain = endpoint.model_copy(update={"engine": endpoint.engine.model_copy(update={"cap_aware_padding": False})})
    with_cap = MEGATRON.align_rows(len(lengths), endpoint, "forward_backward").padded_rows
    # cap-aware padding never pads a call to more rows than plain padding does
    assert with_cap <= MEGATRON.align_rows(len(lengths), plain, "forward_backward").padded_rows
    # one micro-batch size, read by the row alignment and by the micro-batching alike
    size = call_micro_batch_size(len(lengths), endpoint, "forward_backward")
    assert size == (min(len(lengths), micro) if cap_aware else micro)
    assert MEGATRON.align_rows(len(lengths), endpoint, "forward_backward").alignment == dp * size
    if budget <= 0:
        shape = shape_call("forward_backward", lengths, endpoint, MEGATRON)
        assert max(len(mb.row_tokens) for mb in shape.microbatches) == min(size, shape.padded_rows // dp)


def test_barrier_types_are_optim_step_and_load_weights():
    assert set(BARRIERS) == {"optim_step", "load_weights"}
