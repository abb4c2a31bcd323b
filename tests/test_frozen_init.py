"""``engine.frozen.quick_init``: the faster ``__init__`` of the engine's hot frozen dataclasses keeps each class's
signature, defaults, default factories, immutability, equality, hashing and ``replace``."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from dataclasses import FrozenInstanceError, dataclass, field, fields

import pytest

from project_paths import ROOT
from skyrl_sim.engine.clients import Await, Idle, Sleep, SleepUntil, Submit
from skyrl_sim.engine.frozen import quick_init
from skyrl_sim.engine.request import Request
from skyrl_sim.engine.rules import BatchCall, IterationPlan
from skyrl_sim.engine.shapes import CallShape, MicroBatch, RowAlignment
from skyrl_sim.engine.tenancy import Swap

CLASSES = [
    Request, RowAlignment, MicroBatch, CallShape, Sleep, Idle, SleepUntil, Submit, Await, BatchCall, Swap, IterationPlan
]


def test_every_quick_init_class_is_checked_here() -> None:
    """The classes above are every class ``@quick_init`` decorates in the host."""
    decorated = set()
    for path in (ROOT / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            named = [d.func if isinstance(d, ast.Call) else d for d in getattr(node, "decorator_list", [])]
            if isinstance(node, ast.ClassDef) and any(isinstance(d, ast.Name) and d.id == "quick_init" for d in named):
                decorated.add(node.name)
    assert decorated == {c.__name__ for c in CLASSES}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_the_signature_is_the_dataclass_fields(cls: type) -> None:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in fields(cls)]
    for p, f in zip(params, fields(cls), strict=True):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        assert (p.default is inspect.Parameter.empty) == required
        if f.default is not dataclasses.MISSING:
            assert p.default is f.default


def test_values_defaults_immutability_equality_and_replace() -> None:
    request = Request(7, "forward_backward", "m", (3, 4))
    assert (request.id, request.type, request.model_id, request.datums, request.learning_rate, request.loss_fn) == (
        7,
        "forward_backward",
        "m",
        (3, 4),
        1e-4,
        "cross_entropy",
    )
    with pytest.raises(FrozenInstanceError):
        request.id = 8  # type: ignore[misc]
    again = Request(7, "forward_backward", "m", (3, 4))
    assert request == again and hash(request) == hash(again)
    assert request != Request(7, "forward_backward", "m", (3, 5))
    moved = dataclasses.replace(request, id=9)
    assert moved.id == 9 and moved.datums == (3, 4)
    assert Sleep(1.0) != Idle(1.0) and type(Idle(1.0)) is Idle  # the dataclass's own equality: classes differ
    mb = MicroBatch(0, (5, 6), 8, False)
    assert (mb.pad_rows, mb.dummy, mb.dummy_rows, mb.rows) == (0, False, 0, 2)
    assert "MicroBatch(dp_rank=0" in repr(mb)


def test_a_default_factory_makes_a_new_value_each_time() -> None:
    @quick_init
    @dataclass(frozen=True)
    class Held:
        name: str
        items: list[int] = field(default_factory=list)

    a, b = Held("a"), Held("b")
    assert a.items == [] and a.items is not b.items
    assert Held("c", [1]).items == [1]


def test_held_instances_keep_their_attributes_inline() -> None:
    """A held class's instances take no more memory than the dataclass's own (no ``__dict__`` made for each), and a
    class that is not held does take more (the check can tell)."""
    import tracemalloc

    plain = dataclasses.make_dataclass("Plain", [(f.name, object, f) for f in fields(Request)], frozen=True)

    def bytes_of(make: object) -> int:
        tracemalloc.start()
        kept = [make(i, "sample", "m") for i in range(2000)]  # type: ignore[operator]
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del kept
        return size

    assert bytes_of(Request) <= bytes_of(plain) * 1.05
    unheld = quick_init(dataclasses.make_dataclass("Quick", [(f.name, object, f) for f in fields(Request)], frozen=True))
    assert bytes_of(unheld) > bytes_of(plain) * 1.3
    request = Request(1, "sample", "m")
    assert request.id == 1 and request.type == "sample" and request.datums == ()


def test_a_class_it_cannot_speed_up_is_refused() -> None:
    @dataclass
    class Mutable:
        x: int

    with pytest.raises(TypeError, match="not a frozen dataclass"):
        quick_init(Mutable)

    @dataclass(frozen=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            pass

    with pytest.raises(TypeError, match="__post_init__"):
        quick_init(Checked)
