"""What the API refuses at submission: a request that never reaches the futures table.

Two checks, both the service's own and both answered at once with an HTTP error (the client's future fails; no call
runs, nothing waits in the queue):

* the loss is one the endpoint's SkyRL revision knows (``SkyrlRules.loss_fns``): the Tinker API validates
  ``ForwardBackwardInput.loss_fn`` against a literal type, so FastAPI answers an unknown name with 422;
* the endpoint's admission limits (``Endpoint.admission``): a datum longer than ``max_context_length`` tokens, or a
  sample whose prompt plus generation is, is refused with 400 (Thinking Machines' hosted Tinker; SkyRL has no limit).

The simulator and the real backend both call ``admission_error`` in ``FuturesTable.submit``; the refused request's
record keeps an id for the report, which the service itself never assigns.
"""

from __future__ import annotations

from collections.abc import Sequence

from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.requests import PASSES, RequestSpec


def admission_error(spec: RequestSpec, datums: Sequence[int], endpoint: Endpoint) -> str | None:
    """The error the API answers this request with at submission, or None when it is admitted."""
    rules = endpoint.rules
    if spec.type == "forward_backward" and spec.loss_fn not in rules.loss_fns:
        allowed = ", ".join(f"'{name}'" for name in rules.loss_fns)
        return (
            f"HTTP 422: forward_backward_input.loss_fn: Input should be {allowed} (got '{spec.loss_fn}'; "
            f"SkyRL {endpoint.skyrl_version} has no such loss)"
        )
    limit = endpoint.admission.max_context_length
    if limit is None:
        return None
    if spec.type in PASSES:
        for index, length in enumerate(datums):
            if length > limit:
                return (
                    f"HTTP 400: datum {index} has {length:,} tokens, more than the maximum sequence length of "
                    f"{limit:,} for this model"
                )
    elif spec.type == "sample" and spec.prompt_tokens + spec.max_tokens > limit:
        return (
            f"HTTP 400: prompt of {spec.prompt_tokens:,} tokens plus max_tokens {spec.max_tokens:,} is more than the "
            f"maximum sequence length of {limit:,} for this model"
        )
    return None
