"""Fast checks of the tinker backend's pure parts: SkyRL's log lines, and the JAX padding rule."""

from __future__ import annotations

from pathlib import Path

from skyrl_sim.engine.jax_padding import JAX, round_up_seq_len
from skyrl_sim.engine.shapes import shape_call
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.traffic.service_log import parse_service_log, read_service_log

ENDPOINT = Path(__file__).resolve().parents[2] / "scenarios" / "endpoints" / "skyrl-jax-cpu.yaml"
PAD = " " * 40  # SkyRL's rich handler pads each record to the console width

LOG = f"""2026-11-29 10:21:31,354 - INFO - skyrl: skyrl-sim-shim: call forward_backward ids=7,8{PAD}
2026-11-29 10:21:31,356 - INFO - skyrl: JIT compiling for train seq_len=48 in progress...{PAD}
2026-11-29 10:21:31,500 - INFO - skyrl: Padded batch from 2 to 16 (alignment=16){PAD}
2026-11-29 10:22:07,006 - INFO - skyrl: (timing) process_batch_requests(forward_backward, n=2) took 35.652s{PAD}
2026-11-29 10:22:07,069 - INFO - uvicorn.access: 127.0.0.1:35682 - "POST /api/v1/retrieve_future HTTP/1.1" 200
2026-11-29 10:22:08,000 - INFO - skyrl: skyrl-sim-shim: singles ids=9,10
2026-11-29 10:22:08,100 - ERROR - skyrl: Error processing request 9: boom
2026-11-29 10:22:08,200 - INFO - skyrl: (timing) process_single_request(optim_step) took 0.100s
2026-11-29 10:22:08,300 - INFO - skyrl: (timing) process_single_request(save_weights_for_sampler) took 0.050s
2026-11-29 10:22:09,000 - INFO - skyrl: (timing) process_batch_requests(forward, n=3) took 1.000s
"""


def test_parse_calls_ids_and_shapes() -> None:
    log = parse_service_log(LOG)
    assert [(c.kind, c.n, c.ids) for c in log.calls] == [
        ("forward_backward", 2, ["7", "8"]),
        ("optim_step", 1, ["9"]),
        ("save_weights_for_sampler", 1, ["10"]),
        ("forward", 3, None),
    ]
    first = log.calls[0]
    assert (first.padded_rows, first.alignment, first.jit_seq_len, first.duration_s) == (16, 16, 48, 35.652)
    assert log.calls[1].error == "boom" and log.calls[2].error is None
    assert log.has_ids
    assert abs(log.calls[3].end_epoch - log.calls[0].end_epoch - 1.994) < 1e-6


def test_read_from_offset_skips_earlier_runs(tmp_path: Path) -> None:
    path = tmp_path / "service.log"
    path.write_text(LOG)
    offset = path.stat().st_size
    with path.open("a") as handle:
        handle.write("2026-11-29 10:30:00,000 - INFO - skyrl: (timing) process_batch_requests(sample, n=4) took 2.000s\n")
    assert [c.kind for c in read_service_log(path, offset).calls] == ["sample"]


def test_round_up_seq_len_buckets() -> None:
    assert [round_up_seq_len(n) for n in (1, 8, 32, 33, 48, 49, 97, 512, 513, 5000)] == [
        32, 32, 32, 48, 48, 64, 128, 512, 768, 6144,
    ]  # fmt: skip
    for n in range(1, 5000):
        bucket = round_up_seq_len(n)
        assert bucket >= n and bin(bucket).count("1") <= 2


def test_jax_rule_pads_width_not_rows() -> None:
    endpoint = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "queue_drain_17.yaml", str(ENDPOINT))
    shape = shape_call("forward_backward", [5, 40, 9], endpoint.resolve("no-cap").endpoint, JAX)
    assert (shape.rows, shape.padded_rows, shape.width) == (3, 3, 48)
