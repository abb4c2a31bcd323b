"""The lanes' rule (``reference.memory_ops``'s module doc): a memory builder decides on a size only where every width
of a tile agrees, and never lets a size reach what ``Lanes`` cannot see (a name, a dict key).

Checked on every shipped endpoint, for every pass: each builder run over a tile of widths (``Lanes``) either
agrees on every decision or says where the widths part (``Diverged``, then each group again), never fails otherwise,
and gives, lane by lane, the graph it gives for that width alone: the same topology (op and tensor names, inputs,
what is saved) and the same bytes.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from skyrl_sim.schema.architecture import ModelArch, resolve_model
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.endpoint_files import load_endpoint
from skyrl_sim_plugins.sim.fast.memory_lanes import Diverged, Lanes
from skyrl_sim_plugins.sim.reference.memory_graph import size_table
from skyrl_sim_plugins.sim.reference.memory_ops import Dims
from skyrl_sim_plugins.sim.reference.segments import body_specs, head_specs

ROOT = Path(__file__).resolve().parent.parent
ENDPOINTS = sorted(p.stem for p in (ROOT / "scenarios" / "endpoints").glob("*.yaml"))
PASSES = {"training": (False, False), "rl": (False, True), "forward": (True, False)}
ROWS = 2
LANES_CHECKED = 6


def endpoint(name: str) -> tuple[Endpoint, ModelArch]:
    data, _ = load_endpoint(name, ROOT / "scenarios" / "queue_drain_17.yaml")
    ep = Endpoint.model_validate(data)
    return ep, resolve_model(ep.model, ROOT / "scenarios" / "endpoints")  # relative to the endpoint file


def graphs(ep: Endpoint, model: ModelArch, width: Any, logits: Any, forward_only: bool, rl: bool) -> list[Any]:
    """Every graph of a micro-batch of ``ROWS`` rows: its body's (``logits`` 0) and its head's."""
    keys = {(model.layer_types[i], model.is_moe_layer(i)) for i in range(model.num_layers)}
    body = body_specs(Dims.of(ep, model, ROWS, width, 0), model, ep, keys, forward_only)
    head = head_specs(Dims.of(ep, model, ROWS, width, logits, rl), model, forward_only)
    return [spec.graph for spec in body + head]


def groups(ep: Endpoint, model: ModelArch, widths: np.ndarray, passed: tuple[bool, bool]) -> list[tuple[np.ndarray, list]]:
    """The tile's lanes in the groups the builders part them into, each with its graphs (over ``Lanes``)."""
    try:
        return [(widths, graphs(ep, model, Lanes.of(widths), Lanes.of(widths - 1), *passed))]
    except Diverged as split:
        assert len(split.groups) > 1, "a divergence names at least two groups"
        return [part for group in split.groups for part in groups(ep, model, widths[group], passed)]


@pytest.mark.parametrize("name", ENDPOINTS)
@pytest.mark.parametrize("kind", sorted(PASSES))
def test_each_lane_of_a_block_builds_the_graph_of_its_width(name: str, kind: str) -> None:
    ep, model = endpoint(name)
    tp = ep.parallelism.tp
    rng = random.Random(f"{name} {kind}")
    for first in (1, 128):  # the first tile (widths up to 128 x TP) and the next
        widths = tp * np.arange(first + 1, first + 128, dtype=np.int64)
        for lanes, lane_graphs in groups(ep, model, widths, PASSES[kind]):
            for lane in sorted(rng.sample(range(len(lanes)), min(LANES_CHECKED, len(lanes)))):
                width = int(lanes[lane])
                alone = graphs(ep, model, width, width - 1, *PASSES[kind])
                assert len(alone) == len(lane_graphs), (width, kind)
                for block_graph, graph in zip(lane_graphs, alone, strict=True):
                    assert block_graph.topology() == graph.topology(), (width, kind)
                    row = size_table(block_graph.size_shapes(), len(lanes))[lane]
                    assert row.tolist() == graph.size_bytes(), (width, kind)
