"""The engine's request: one API request as SkyRL's engine sees it once submitted, and the request types that are
barriers in its scheduling (``engine.rules``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from skyrl_sim.engine.frozen import quick_init
from skyrl_sim.schema.requests import LossInputs, RecordedRoutes

BARRIERS: frozenset[str] = frozenset({"optim_step", "load_weights"})
"""A model's destructive barriers: passes of that model below the smallest pending one's id batch, the first pass at or
after it is blocked (``engine.rules``)."""


@quick_init
@dataclass(frozen=True, slots=True)
class Request:
    """One request as the engine sees it. ``id`` is the arrival order at the API (assigned at submission)."""

    id: int
    type: str
    model_id: str
    datums: tuple[int, ...] = ()
    learning_rate: float = 1e-4
    prompt_tokens: int = 0
    max_tokens: int = 0
    num_samples: int = 1
    checkpoint: str = ""
    client: str = ""
    loss_fn: str = "cross_entropy"
    loss_fn_config: tuple[tuple[str, float], ...] = ()
    loss_fn_inputs: LossInputs | None = field(default=None, hash=False, compare=False)
    prompt_logprobs: bool = False
    lora: tuple[int, float] | None = None  # create_model: (rank, alpha) it names; None: the endpoint's lora
    routed_experts: RecordedRoutes | None = field(default=None, hash=False, compare=False)  # a pass's R3 routes

    @property
    def tokens(self) -> int:
        return sum(self.datums)
