"""The endpoint's ``placement`` section: whether training and inference share devices, with SkyRL's key names.

``colocate_all`` is SkyRL 0.4.0's ``trainer.placement.colocate_all`` (``skyrl/train/config/config.py``:
``PlacementConfig``, default true): training and the vLLM engines share the same devices, and vLLM sleeps while the
trainer runs. With it false the engines run on devices of their own, and SkyRL's API forwards ``/asample`` straight
to them (``skyrl/tinker/api.py``: ``_should_forward_sample_requests``), so samples never enter the engine's queue.
What it decides for sampling is in ``skyrl_sim.engine.rules.sampling_mode``.
"""

from __future__ import annotations

from pydantic import Field

from skyrl_sim.schema.strict import Strict


class Placement(Strict):
    """Where the trainer and the inference engines run."""

    colocate_all: bool = Field(
        True, description="training and inference share the same devices (SkyRL: trainer.placement.colocate_all)"
    )
