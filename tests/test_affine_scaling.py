"""Every op declares how its cost scales (``layer_ops.Scaling``), and the time model's compiled fast path
(``fast.time_program``) prices a pass as affine only when every op of it is: an op that does not declare itself
affine, or that declares it falsely, is refused (``NotAffine``) and the pass is priced op by op by the reference,
never extrapolated from the few points the affine form is probed at."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.architecture import PRESETS
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim_plugins.sim.bound.timing import RooflineTimeModel
from skyrl_sim_plugins.sim.description import layer_ops
from skyrl_sim_plugins.sim.description.layer_ops import AFFINE, NONLINEAR, Op, Scaling, Work
from skyrl_sim_plugins.sim.fast.time_program import AffinePass, NotAffine
from skyrl_sim_plugins.sim.reference.time_model import BACKWARD_FACTOR, microbatch_variables

MODEL = PRESETS["qwen3-8b"]
LENGTHS = [300, 1200, 77, 4000]


def endpoint() -> Endpoint:
    return Endpoint.model_validate(
        {
            "model": "qwen3-8b",
            "hardware": {"profile": "h200", "devices": 2},
            "parallelism": {"tp": 2},
            "trainer": {"micro_train_batch_size_per_gpu": 2, "remove_microbatch_padding": False},
        }
    )


def squared(work: Work) -> float:
    """A cost that grows with the square of the tokens: what no affine form of tokens and pairs can hold."""
    return 40.0 * work.tokens * work.tokens


@pytest.fixture
def quadratic_op(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Adds to every decoder layer's forward an op whose FLOPs are quadratic in the tokens, declared as asked."""

    def install(scaling: Scaling) -> None:
        original = layer_ops.DecoderLayer.forward

        def forward(self: layer_ops.DecoderLayer, work: Work, setup: layer_ops.Setup) -> layer_ops.LayerWork:
            out = original(self, work, setup)
            out.ops.append(Op("quadratic", squared(work), 0.0, "matmul", "frozen", scaling=scaling))
            return out

        monkeypatch.setattr(layer_ops.DecoderLayer, "forward", forward)

    yield install


def test_the_description_declares_its_training_ops_affine() -> None:
    reference = RooflineTimeModel().bind(endpoint(), MODEL).reference
    ops, collectives = reference.layers_direct(Work(1000.0, 5e5), backward=True)
    assert ops and collectives
    assert {op.scaling for op, _ in ops} == {AFFINE}
    assert {c.scaling for c, _ in collectives} == {AFFINE}


def test_an_op_that_does_not_say_how_it_scales_is_not_affine() -> None:
    assert Op("unknown", 1.0, 1.0, "memory", "elementwise").scaling == NONLINEAR

    def listed(tokens: float, pairs: float) -> Any:
        return [(Op("unknown", tokens, 0.0, "memory", "elementwise"), 1.0)], []

    with pytest.raises(NotAffine, match="op unknown is nonlinear"):
        AffinePass.build(listed, 2)


def test_a_decode_step_is_refused_by_the_affine_form() -> None:
    """A decode step's attention reads sequences x context: its op says it is not affine, and the build says so."""
    reference = RooflineTimeModel().bind(endpoint(), MODEL).reference
    setup = reference.sampler_setup(False)

    def listed(sequences: float, context: float) -> Any:
        work = Work(sequences, 0.0, decode=True, sequences=int(sequences), context=context)
        layer = reference.layer_kinds[0].forward(work, setup)
        return [(op, 1.0) for op in layer.ops], [(c, 1.0) for c in layer.collectives]

    with pytest.raises(NotAffine, match="core_attention is nonlinear"):
        AffinePass.build(listed, 2)


def test_an_op_that_claims_to_be_affine_and_is_not_is_caught_at_the_check_point() -> None:
    def listed(tokens: float, pairs: float) -> Any:
        return [(Op("liar", tokens * tokens, 0.0, "matmul", "frozen", scaling=AFFINE), 1.0)], []

    with pytest.raises(NotAffine, match="op liar is not affine"):
        AffinePass.build(listed, 2)


@pytest.mark.parametrize("declared", [NONLINEAR, AFFINE])
def test_a_non_affine_op_is_priced_at_its_value_not_as_affine(quadratic_op: Any, declared: Scaling) -> None:
    """With a quadratic op in every layer the pass has no compiled program (refused whether the op says it is not
    affine or falsely says it is), and a call's cost is the reference's: the op's FLOPs at each micro-batch's own
    tokens. An affine form probed at 0 and 1 token would have priced it at 40 FLOPs per token."""
    ep = endpoint()
    shape = shape_call("forward_backward", LENGTHS, ep, MEGATRON)
    before = RooflineTimeModel().bind(ep, MODEL).call(shape)
    quadratic_op(declared)
    bound = RooflineTimeModel().bind(ep, MODEL)
    assert bound.microbatch_program("forward_backward") is None
    assert bound.padded_fields("forward_backward", 2, 1200, 1200) is None
    after = bound.call(shape)
    assert after.fields() == bound.reference.call(shape).fields()
    # Every layer's forward, its recompute (full recompute) and its backward (a frozen op's costs its forward's).
    repeats = MODEL.num_layers * (1 + bound.reference.recompute_fraction + BACKWARD_FACTOR["frozen"])
    quadratic = sum(squared(Work(*microbatch_variables(mb, 2))) for mb in shape.microbatches_of_rank(0))
    assert after.flops - before.flops == pytest.approx(repeats * quadratic, rel=1e-9)
    assert quadratic > 40.0 * 4 * sum(mb.slots for mb in shape.microbatches_of_rank(0))  # far from any affine form
