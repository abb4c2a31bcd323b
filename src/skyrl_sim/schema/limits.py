"""The one place for the bounds on what a user may ask of skyrl-sim, each with its reason.

A value past one of these cannot be meant (no device or service reaches it) and would only make a run hang or exhaust
memory, so the schema refuses it at load time and the message names the limit.
"""

from __future__ import annotations

MAX_DOCUMENT_BYTES = 4 * 2**20
"""An endpoint, profile or HF config file larger than 4 MiB is refused before it is parsed (scenarios:
``MAX_SCENARIO_BYTES``)."""

MAX_SCENARIO_BYTES = 128 * 2**20
"""A scenario file larger than 128 MiB is refused before it is parsed. An imported trace takes about 45 bytes a
request, so a week of a busy service (10^6 requests) is about 42 MiB and ``MAX_REQUESTS`` about 85 MiB."""

MAX_RESULT_BYTES = 1024 * 2**20
"""A saved RunResult (``compare --against``, ``calibrate``) larger than 1 GiB is refused before it is read, unless it
is in the layout skyrl-sim writes: such a file is read record by record whatever its size (``results.result_stream``),
so every run the tool wrote (2,000,000 requests: about 2.5 GB) can be read back."""

MAX_NESTING = 64
"""YAML / JSON nesting deeper than this is refused (scenario documents are a few levels deep)."""

MAX_NUMBER_DIGITS = 100
"""An integer written with more digits than this is refused as the document (or ``--set`` value) is read: every
limit here has fewer than 20, and Python refuses to convert more than 4,300 digits at all."""

MAX_INDEX_DIGITS = 18
"""A list index in a ``--set`` key path has at most this many ASCII digits (no list is longer than 10^18)."""

MAX_TIME_S = 31 * 86_400.0
"""Any workload time (gaps, times_s, start_s, blocker lead, result timeout) is at most 31 days of simulated time: a
replay of weeks of a multi-tenant service (issue 17: 10^6 requests) submits at times that far in."""

MAX_SIM_TIME_S = 62 * 86_400.0
"""A simulated run that has not finished after twice the longest workload time is stopped with an error."""

MIN_ITERATION_SLEEP_S = 0.001
"""The engine's idle sleep and poll interval: 1 ms at least (0 would spin the loop without advancing time)."""

MAX_ITERATION_SLEEP_S = 60.0

MAX_TOKENS = 10_000_000
"""Tokens of one datum, a sample's prompt or its generation: past every model's context length."""

MAX_LEARNING_RATE = 1e3
"""An optim step's learning rate: positive and at most this (Adam diverges long before)."""

MAX_REQUESTS = 2_000_000
"""Requests one scenario expands to (after ``count`` and ``lengths``): 2x the largest benchmarked run (10^6)."""

MAX_MICRO_BATCH = 65_536
"""Rows of one micro-batch per GPU."""

MAX_SAMPLES = 65_536
"""``num_samples`` of one sample request."""

MAX_LEARNING_RATE = 1e3
"""An optim step's learning rate (Adam's are around 1e-4; past 1e3 is a unit mistake)."""

MAX_NAME_CHARS = 4_096
"""A model id or checkpoint name read from a database: it becomes a client name and is printed."""

MAX_ROW_BYTES = 256 * 2**20
"""One database cell (a row's ``request_data`` or ``result_data``) larger than 256 MiB is refused without being
fetched: a datum of ``MAX_TOKENS`` tokens with SkyRL's loss inputs (targets and weights per token) is about 200 MiB
of JSON."""

MAX_DEVICES = 1_048_576
"""Devices of one endpoint (and so any one parallelism degree)."""

MAX_ENGINES = 4_096
"""vLLM engines of one endpoint: each is simulated on its own (its scheduler, KV cache and adapters), so 10^5 took
19 s and 0.5 GB and 10^6 ran past two minutes and 4 GB; 4,096 engines are 32,768 devices at TP 8, past any SkyRL
deployment (each engine is a Ray actor of its own)."""

MAX_DEVICE_MEMORY_GIB = 1_048_576.0
"""Memory of one device, GiB: 1 PiB (today's largest are ~0.2 TiB; tests and benchmarks use 100,000 GiB for "room
for every shape")."""

MAX_MODEL_DIM = 1_048_576
"""Any one model width (hidden, FFN, head dim, vocabulary, experts, heads, LoRA rank)."""

MAX_MODEL_LAYERS = 4_096

MAX_GRID_POINTS = 10_000
"""A sweep grid larger than this needs ``--force``."""

MAX_FORCED_GRID_POINTS = 1_000_000
"""A sweep grid larger than this is refused even with ``--force``: every point is kept (memory, the JSON), and at
a tenth of a second a point it would run for more than a day on 16 cores."""

MAX_JOBS = 256
"""Worker processes of one sweep or advise (``--jobs``): each is a Python process holding the scenario."""
