"""Line up the real backend's per-op allocations of one small call with the simulator's walk of the same call.

    .venv/bin/python scripts/trace_call_memory.py [--endpoint tiny-cpu-tp1] [--rows 2] [--length 40] [--forward]
                                                  [--out trace.json]

Runs one ``forward_backward`` (``--forward``: one ``forward``) of ``rows`` rows of ``length`` tokens in this
process (one rank, gloo), under the live-tensor meter with its op log on, and prints every allocation and free (aten
op, bytes, running total) beside the walk's peak for the same ``CallShape``. This is how the walk's CPU-stack ops
(``sim/memory_ops.py``) were matched term by term; run it again after changing either side. An endpoint with TP > 1
re-runs the script under ``torchrun --nproc-per-node TP`` (gloo); rank 0 prints its log (every rank holds the same
sizes). A pipeline endpoint (``parallelism.pp`` above 1, e.g. tiny-cpu-pp2) runs a rank per stage (TP x PP ranks)
under megatron's 1F1B schedule; ``--stage S`` picks the stage whose log is printed, beside the walk of that stage
(its steps, from the walk's timeline). ``--lengths 120,110,100`` gives rows of different lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default="tiny-cpu-tp1")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--length", type=int, default=40, help="input tokens of every row")
    parser.add_argument("--calls", type=int, default=2, help="calls to run (the first creates the adapter gradients)")
    parser.add_argument("--forward", action="store_true", help="a forward-only call (no grad) instead of forward_backward")
    parser.add_argument("--out", help="write the log of the last call as JSON")
    parser.add_argument("--lengths", help="comma-separated input lengths of the rows (instead of --rows x --length)")
    parser.add_argument("--stage", type=int, default=0, help="pipeline endpoints: the stage whose log is printed")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from skyrl_sim.engine.shapes import MEGATRON, shape_call
    from skyrl_sim.schema.scenario import load_scenario
    from skyrl_sim_plugins.megatron_vllm.cpu_shims import apply_cpu_shims
    from skyrl_sim_plugins.megatron_vllm.local_ports import free_port
    from skyrl_sim_plugins.megatron_vllm.memory_meter import LiveTensorMeter, process_buffers, single_worker_gloo
    from skyrl_sim_plugins.megatron_vllm.single_rank import init_single_rank_group
    from skyrl_sim_plugins.megatron_vllm.trainer import LoraModel
    from skyrl_sim_plugins.sim.bound.memory import default_memory_model

    torch.set_num_threads(1)
    scenario = load_scenario(ROOT / "scenarios" / "queue_drain_17_tiny.yaml", args.endpoint)
    variant = scenario.resolve("cap-aware")  # rows stay as given
    endpoint, arch = variant.endpoint, variant.model
    tp, pp = endpoint.parallelism.tp, endpoint.parallelism.pp
    if tp * pp > 1 and "WORLD_SIZE" not in os.environ:
        ranks = str(tp * pp)
        rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", ranks, *rendezvous]
        return subprocess.run([*command, sys.argv[0], *sys.argv[1:]], timeout=600).returncode
    fsdp = endpoint.trainer.strategy == "fsdp"
    ranks_needed = endpoint.parallelism.dp if fsdp else tp * pp
    if fsdp and ranks_needed > 1 and "WORLD_SIZE" not in os.environ:
        rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks_needed), *rendezvous]
        return subprocess.run([*command, sys.argv[0], *sys.argv[1:]], timeout=600).returncode
    single_worker_gloo()  # as the workers do: a collective's tensors freed where the caller drops them
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")  # a rank that torch.distributed.run started
    else:
        init_single_rank_group()
    apply_cpu_shims()
    if fsdp:
        return trace_fsdp(args, endpoint, arch)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if pp > 1:
        from skyrl_sim_plugins.megatron_vllm.pipeline_stage import install_cpu_p2p

        install_cpu_p2p()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = LoraModel(arch, endpoint, 0, 4096)
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [args.length] * args.rows
    kind = "forward" if args.forward else "forward_backward"
    shape = shape_call(kind, lengths, endpoint, MEGATRON)
    log: list[tuple[str, int, int]] = []
    peak = 0
    for _ in range(args.calls):
        log = []
        meter = LiveTensorMeter([*model.held_tensors(), *process_buffers()], log)  # what the worker holds
        with meter:
            model.run_pass(shape, lengths, forward_only=args.forward)
        peak = meter.peak_bytes
    stage_rank = parallel_state.get_pipeline_model_parallel_rank()
    if stage_rank != args.stage or parallel_state.get_tensor_model_parallel_rank() != 0:
        dist.destroy_process_group()
        return 0
    for name, size, running in log:
        print(f"{name:60s} {size:+12d} {running:12d}")
    print(f"shape rows={shape.rows} padded={shape.padded_rows} width={shape.width}")
    print(f"real: baseline {meter.baseline} high {meter.high} peak {peak}")
    walk = default_memory_model()
    report = walk.evaluate(shape, endpoint, arch)
    print(f"walk: peak {report.peak_bytes} breakdown {report.breakdown} stage peaks {report.stage_peaks}")
    if model.stage is None and os.environ.get("TRACE_WALK"):  # the walk's steps beside the log
        for row in walk.walk(shape, endpoint, arch).resolve_timeline():
            print(f"  walk {row['microbatch']} {row['phase']:8s} {str(row['layer']):18s} {row['op']:50s} "
                  f"{row['bytes']:+12d} {row['allocated']:12d} {row.get('peak', 0):12d}")
    if model.stage is not None:
        bound = walk.bind(endpoint, arch)
        stage = bound.walk_bound(shape, None, bound.stages()[model.stage.index])
        for row in stage.resolve_timeline():
            print(f"  walk {row['microbatch']} {row['phase']:8s} {str(row['layer']):18s} {row['op']:50s} "
                  f"{row['bytes']:+12d} {row['allocated']:12d} {row.get('peak', 0):12d}")
        print(f"walk stage {args.stage}: peak {stage.peak_bytes} breakdown {stage.breakdown}")
    if args.out:
        Path(args.out).write_text(json.dumps({"log": log, "baseline": meter.baseline, "peak": peak}))
    dist.destroy_process_group()
    return 0


def trace_fsdp(args: argparse.Namespace, endpoint: object, arch: object) -> int:
    """The FSDP trainer's call (``fsdp_trainer.FsdpModel``) under the meter, FSDP2's storage resizes counted."""
    import torch.distributed as dist

    from skyrl_sim.engine.shapes import FSDP, shape_call
    from skyrl_sim_plugins.megatron_vllm.fsdp_trainer import FsdpModel
    from skyrl_sim_plugins.megatron_vllm.memory_meter import LiveTensorMeter, fsdp_storage_hooks
    from skyrl_sim_plugins.sim.bound.memory import default_memory_model

    model = FsdpModel(arch, endpoint, 0, 4096)  # type: ignore[arg-type]
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [args.length] * args.rows
    kind = "forward" if args.forward else "forward_backward"
    shape = shape_call(kind, lengths, endpoint, FSDP)  # type: ignore[arg-type]
    log: list[tuple[str, int, int]] = []
    for _ in range(args.calls):
        log = []
        meter = LiveTensorMeter(model.held_tensors(), log)
        with meter, fsdp_storage_hooks(meter):
            model.run_pass(shape, lengths, forward_only=args.forward)
    if dist.get_rank() == 0:
        for name, size, running in log:
            print(f"{name:60s} {size:+12d} {running:12d}")
        print(f"shape rows={shape.rows} padded={shape.padded_rows} width={shape.width}")
        print(f"real: baseline {meter.baseline} high {meter.high} peak {meter.peak_bytes}")
        report = default_memory_model().walk(shape, endpoint, arch)  # type: ignore[arg-type]
        print(f"walk: peak {report.peak_bytes} breakdown {report.breakdown}")
        for row in report.resolve_timeline():
            print(f"  walk {row['microbatch']} {row['phase']:8s} {str(row['layer']):18s} {row['op']:50s} "
                  f"{row['bytes']:+12d} {row['allocated']:12d} {row.get('peak', 0):12d}")
        if args.out:
            Path(args.out).write_text(json.dumps({"log": log, "baseline": meter.baseline, "peak": meter.peak_bytes}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
