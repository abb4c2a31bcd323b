"""A SkyRL-shaped database of generated multi-tenant traffic, for the import/replay benchmark and tests.

The tables carry the columns SkyRL 0.4.0 writes, stored the way its SQLModel tables store them (enum names for
``request_type`` and ``status``, JSON text for ``request_data``, SQLAlchemy's DateTime text), and the rows follow
SkyRL's own shapes (``ForwardBackwardInput`` with token lists, ``OptimStepInput``, ``SampleInput``, ...). Each tenant
creates its model, runs training steps (a few ``forward_backward`` then an ``optim_step``), saves sampler weights and
samples from them every few steps, and unloads its model at the end; each step is a burst of back-to-back requests.
Every ``oom_every``-th pass fails with PyTorch's out-of-memory message, as an OOM in SkyRL's engine is recorded.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

OOM_TEXT = "CUDA out of memory. Tried to allocate 9.08 GiB. GPU 0 has a total capacity of 139.81 GiB"


def _tokens(n: int) -> dict[str, Any]:
    return {"chunks": [{"type": "encoded_text", "tokens": [7] * n}]}


def _datum(n: int) -> dict[str, Any]:
    return {
        "model_input": _tokens(n),
        "loss_fn_inputs": {"target_tokens": {"data": [7] * n}, "weights": {"data": [1.0] * n}},
    }


def tenant_requests(rng: random.Random, tenant: int, count: int, max_len: int) -> list[list[tuple[str, dict[str, Any]]]]:
    """One tenant's requests as bursts of (request_type, request_data), each burst submitted back to back as a Tinker
    client does: its create_model, then per training step its passes and optim_step (and every 4th step a sampler save
    and two samples), and its unload_model."""
    bursts: list[list[tuple[str, dict[str, Any]]]] = [
        [("create_model", {"lora_config": {"rank": 8, "alpha": 32.0, "seed": tenant}, "model_role": "policy"})]
    ]
    step = 0
    total = 1
    while total < count - 1:
        out: list[tuple[str, dict[str, Any]]] = []
        for _ in range(rng.randint(1, 4)):
            datums = [_datum(rng.randint(16, max_len)) for _ in range(rng.choice((1, 1, 2)))]
            kind = "forward" if rng.random() < 0.1 else "forward_backward"
            out.append((kind, {"data": datums, "loss_fn": "cross_entropy"}))
        out.append(("optim_step", {"adam_params": {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12}}))
        step += 1
        if step % 4 == 0:
            name = f"step-{step}"
            out.append(("save_weights_for_sampler", {"path": name}))
            for _ in range(2):
                params = {"temperature": 1.0, "max_tokens": rng.choice((16, 64, 128)), "seed": step}
                out.append(
                    (
                        "sample",
                        {
                            "prompt": _tokens(rng.randint(8, 256)),
                            "sampling_params": params,
                            "num_samples": 1,
                            "checkpoint_id": name,
                            "prompt_logprobs": False,
                        },
                    )
                )
        out = out[: count - 1 - total]
        total += len(out)
        bursts.append(out)
    bursts.append([("unload_model", {})])
    return bursts


def write_synthetic_db(
    target: str | Path,
    requests: int,
    tenants: int = 8,
    seed: int = 0,
    max_len: int = 512,
    gap_s: float = 12.0,
    burst_gap_s: float = 0.002,
    oom_every: int = 0,
) -> Path:
    """Write about ``requests`` futures rows (every tenant gets an equal share) to ``target``, a new SQLite file path
    or a SQLAlchemy URL of an empty database:
    bursts ``burst_gap_s`` apart inside, ``gap_s`` apart on average (exponential) between a tenant's bursts."""
    import orjson
    from sqlalchemy import JSON, Column, DateTime, Integer, MetaData, String, Table, Text, create_engine

    url = str(target) if "://" in str(target) else None
    path = Path(target) if url is None else None
    if path is not None and path.exists():
        path.unlink()
    metadata = MetaData()
    futures = Table(
        "futures",
        metadata,
        Column("request_id", Integer, primary_key=True, autoincrement=True),
        Column("request_type", String(24), nullable=False),
        Column("model_id", String, index=True),
        Column("seq_id", Integer),
        Column("request_data", JSON, nullable=False),
        Column("result_data", Text),
        Column("status", String(9), nullable=False, index=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("completed_at", DateTime(timezone=True)),
    )
    models = Table(
        "models",
        metadata,
        Column("model_id", String, primary_key=True),
        Column("base_model", String, nullable=False),
        Column("lora_config", JSON, nullable=False),
        Column("status", String, nullable=False),
        Column("request_id", Integer, nullable=False),
        Column("session_id", String, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
    )
    rng = random.Random(seed)
    start = datetime(2026, 11, 23, tzinfo=UTC)
    events: list[tuple[float, int, str, dict[str, Any]]] = []
    share = max(2, requests // tenants)
    for tenant in range(tenants):
        clock = rng.uniform(0, gap_s)
        for burst in tenant_requests(rng, tenant, share, max_len):
            for kind, data in burst:
                events.append((clock, tenant, kind, data))
                clock += burst_gap_s
            clock += rng.expovariate(1 / gap_s)
    events.sort(key=lambda e: e[0])
    rows: list[dict[str, Any]] = []
    model_rows: list[dict[str, Any]] = []
    passes = 0
    for request_id, (at, tenant, kind, data) in enumerate(events, start=1):
        model_id = f"model_{tenant:08x}"
        created = start + timedelta(seconds=at)
        status, result = "COMPLETED", b'{"type":"ok"}'
        if kind in ("forward_backward", "forward"):
            passes += 1
            if oom_every and passes % oom_every == 0:
                status, result = "FAILED", orjson.dumps({"error": OOM_TEXT, "status": "failed"})
        rows.append(
            {
                "request_id": request_id,
                "request_type": kind.upper(),
                "model_id": model_id,
                "seq_id": None,
                "request_data": data,
                "result_data": result.decode(),
                "status": status,
                "created_at": created,
                "completed_at": created + timedelta(seconds=0.5),
            }
        )
        if kind == "create_model":
            model_rows.append(
                {
                    "model_id": model_id,
                    "base_model": "Qwen/Qwen3.6-27B",
                    "lora_config": data["lora_config"],
                    "status": "unloaded",
                    "request_id": request_id,
                    "session_id": "session-0",
                    "created_at": created,
                }
            )
    engine = create_engine(url or f"sqlite:///{path}", json_serializer=lambda v: orjson.dumps(v).decode())
    metadata.create_all(engine)
    with engine.begin() as conn:
        for i in range(0, len(rows), 5000):
            conn.execute(futures.insert(), rows[i : i + 5000])
        if model_rows:
            conn.execute(models.insert(), model_rows)
    engine.dispose()
    return path if path is not None else Path(str(target))
