"""The settings each RL loss reads (a forward_backward's ``loss_fn_config``), as the endpoint's SkyRL backend reads them.

The Tinker API takes any ``dict[str, float]``; what becomes of a key is the backend's business:

- **SkyRL-Train** (``trainer.strategy`` megatron or fsdp; ``skyrl/backends/skyrl_train_backend.py``:
  ``_normalize_policy_loss_request``): for ``ppo`` and ``gspo`` it turns Tinker's ``clip_low_threshold`` /
  ``clip_high_threshold`` into ``eps_clip_low = 1 - low`` / ``eps_clip_high = high - 1``; for ``dppo`` it nests
  ``delta_low`` / ``delta_high`` under ``dppo``; every other key is merged into the worker's ``AlgorithmConfig``
  (``workers/worker.py``, ``megatron_model_wrapper.py``: ``OmegaConf.merge``), whose ``build_nested_dataclass``
  refuses a key it has no field for, so the call fails. ``importance_sampling`` and ``cispo`` read nothing from it
  (``backends/skyrl_train/utils/ppo_utils.py``: ``importance_sampling_loss`` reads no setting, and ``cispo``'s clip
  is ``config.cispo.cispo_eps_clip_*``, which a flat dict of floats cannot reach).
- **JAX** (``trainer.strategy`` jax; ``skyrl/backends/jax.py``: ``_build_loss_fn_config``): every request's
  ``clip_low_threshold`` / ``clip_high_threshold`` (defaults 0.8 / 1.2), read by ``ppo_loss`` and ``cispo_loss``
  (``skyrl/tinker/loss_fns.py``); any other key is ignored.

So a scenario's ``loss_fn_config`` may hold exactly the keys its loss reads on its endpoint's backend, with values
the loss can mean: a clip range that holds the ratio 1 (``0 <= clip_low_threshold <= 1 <= clip_high_threshold``),
and non-negative DPPO thresholds. Anything else is refused when the scenario loads, naming the request and key. Both
SkyRL revisions (0.4.0, pr1874) read these keys alike for the losses they have; a loss a revision lacks is refused
by the API at submission (``engine.admission``).
"""

from __future__ import annotations

from collections.abc import Mapping

CLIP = ("clip_low_threshold", "clip_high_threshold")
DPPO = ("delta_low", "delta_high")

SKYRL_TRAIN: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": CLIP,
    "gspo": CLIP,
    "cispo": (),
    "dppo": DPPO,
}
"""What each loss reads on SkyRL-Train (megatron, fsdp): see the module docstring."""

JAX: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": CLIP,
    "gspo": (),
    "cispo": CLIP,
    "dppo": (),
}
"""What each loss reads on the JAX backend: see the module docstring."""


def settings_read(loss_fn: str, strategy: str) -> tuple[str, ...]:
    """The ``loss_fn_config`` keys ``loss_fn`` reads on a backend of ``strategy`` (a plugin's strategy: as
    SkyRL-Train)."""
    table = JAX if strategy == "jax" else SKYRL_TRAIN
    return table.get(loss_fn, ())


def loss_settings_problem(loss_fn: str, config: Mapping[str, float], strategy: str) -> tuple[str, str] | None:
    """(key, reason) of the first setting ``loss_fn`` does not read on ``strategy``'s backend, or whose value it cannot
    mean; None when every setting is read and sound."""
    read = settings_read(loss_fn, strategy)
    backend = "the JAX backend" if strategy == "jax" else "SkyRL-Train"
    for key in config:
        if key not in read:
            takes = f"it reads only {', '.join(read)}" if read else "it reads no setting"
            return key, f"{loss_fn} on {backend} does not read '{key}' ({takes})"
    low, high = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if low is not None and not 0 <= low <= 1:
        return "clip_low_threshold", f"{low} is outside [0, 1]: the ratio is clipped to [low, high] around 1"
    if high is not None and high < 1:
        return "clip_high_threshold", f"{high} is below 1: the ratio is clipped to [low, high] around 1"
    for key in DPPO:
        value = config.get(key)
        if value is not None and value < 0:
            return key, f"{value} is negative: a divergence threshold is at least 0 (0 masks every changed token)"
    return None
