#!/usr/bin/env bash
# GPU check: the real backend's training path on CUDA (NCCL, bf16, the device's own OOM under
# set_per_process_memory_fraction) for the miniature 17-request drain against scenarios/endpoints/mid-cuda.yaml.
# Writes the RunResults to ${OUT:-gpu_check_out}/gpu_check.json and a log beside it. Budget: under 8 minutes.
# Usage: bash scripts/gpu_check.sh            (from the repository root, after scripts/test.sh has built .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check_out}
mkdir -p "$out"
py=.venv/bin/python
[ -x "$py" ] || py=python3
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible to torch; nothing to check" | tee "$out/gpu_check.log"
  exit 2
fi
"$py" -c "import torch; print('device:', torch.cuda.get_device_name(0), torch.__version__)" | tee "$out/gpu_check.log"
# checkpoints (5.6 GB per variant) go to a scratch directory, not beside the result
run_dir=${RUN_DIR:-$(mktemp -d /tmp/skyrl-sim-gpu-check.XXXXXX)}
trap 'rm -rf "$run_dir"' EXIT
start=$(date +%s)
# 450 s for the three variants (each starts its own worker), leaving time to write and print the result.
timeout --signal=TERM --kill-after=20 450 "$py" -m skyrl_sim.cli run scenarios/queue_drain_17_tiny.yaml \
  --endpoint mid-cuda --backend megatron --all-variants \
  --option run_dir="$run_dir" --option startup_timeout_s=240 --option call_timeout_s=240 \
  --json "$out/gpu_check.json" 2>&1 | tee -a "$out/gpu_check.log"
echo "gpu_check took $(( $(date +%s) - start )) s" | tee -a "$out/gpu_check.log"
"$py" - "$out/gpu_check.json" <<'PY' | tee -a "$out/gpu_check.log"
import sys
from skyrl_sim.result import read_results
for run in read_results(sys.argv[1]):
    s = run.summary()
    peak = (s["peak_bytes_max"] or 0) / 2**30
    print(f"{run.variant}: {s['completed']}/{s['requests']} completed, {s['oom_calls']} OOM calls, "
          f"peak {peak:.2f} GiB, makespan {s['makespan_s']:.1f} s")
    for call in run.oom_calls:
        print(f"  call {call.index}: attempted {call.oom.attempted_bytes / 2**30:.2f} GiB in {call.oom.where}")
PY
