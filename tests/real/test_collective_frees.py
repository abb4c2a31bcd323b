"""The CPU meter's peaks do not depend on the machine's load under tensor parallelism: a collective's tensors are freed
where the caller drops them, in the caller's thread (``memory_meter.settle_collective``), never later by gloo's worker
thread. Two gloo ranks gather into a buffer the caller drops right after reading it, many times over: every free must
come between the two ops around the drop, and every one on the main thread."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from skyrl_sim_plugins.megatron_vllm.memory_meter import LiveTensorMeter, single_worker_gloo

pytestmark = pytest.mark.real

ROUNDS = 200


def gather_and_drop(rank: int, init_file: str, results: str) -> None:
    single_worker_gloo()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    log: list[tuple[str, int, int]] = []
    others: list[str] = []
    meter = LiveTensorMeter([], log)
    original = meter._free

    def watched(ptr: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            others.append(threading.current_thread().name)
        original(ptr)

    meter._free = watched  # type: ignore[method-assign]
    shard = torch.ones(1024)
    with meter:
        for _ in range(ROUNDS):
            gathered = torch.empty(2048)
            dist.all_gather_into_tensor(gathered, shard)
            head = gathered[:100] * 2
            del gathered  # the caller's last hold: freed here, not whenever gloo's thread lets go
            tail = head + 1
            del head, tail
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(results).write_text(json.dumps({"log": log, "others": others}))


def test_a_dropped_gather_buffer_is_freed_where_the_caller_drops_it_on_every_round(tmp_path: Path) -> None:
    results = tmp_path / "log.txt"
    mp.spawn(gather_and_drop, args=(str(tmp_path / "init"), str(results)), nprocs=2, join=True)
    body = json.loads(results.read_text())
    assert body["others"] == []  # no free on another thread
    log = body["log"]
    ops = [(entry[0], entry[1]) for entry in log]
    # each round: the buffer, the gather, mul, the buffer's free, add, the two small results' frees
    buffer = 2048 * 4
    expected = [("aten.empty.memory_format", buffer), ("aten.mul.Tensor", 400), ("free", -buffer)]
    expected += [("aten.add.Tensor", 400), ("free", -400), ("free", -400)]
    assert ops == expected * ROUNDS
