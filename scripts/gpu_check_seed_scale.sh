#!/usr/bin/env bash
# GPU check at the seed's per-GPU scale: queue_drain_17.yaml (its real lengths, 35,000 tokens included, micro 16) in
# all three variants against scenarios/endpoints/seed-scale-h200-tp1.yaml on one H200, simulator first (its verdicts
# are pinned by tests/test_seed_scale.py), then the real backend (flash attention on CUDA, the device's own OOM under
# set_per_process_memory_fraction at the endpoint's 66.5 GiB), compared call by call.
# Writes ${OUT:-gpu_check_out}/seed_scale.{sim,megatron,compare}.json and seed_scale.log. Budget: under 6 minutes.
# Usage: bash scripts/gpu_check_seed_scale.sh   (from the repository root; scripts/gpu_check.sh may call it)
# The endpoint runs the fused LM-head log-prob, as the seed's does; until the real backend has one it refuses the
# endpoint (trainer.fused_lm_head_logprob), and this script then stops after the simulator's part with exit code 3.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check_out}
mkdir -p "$out"
log="$out/seed_scale.log"
py=.venv/bin/python
[ -x "$py" ] || py=python3
endpoint=seed-scale-h200-tp1
scenario=scenarios/queue_drain_17.yaml
start=$(date +%s)
"$py" -m skyrl_sim.cli check "$scenario" --endpoint "$endpoint" --json "$out/seed_scale.sim.json" 2>&1 | tee "$log"
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check_seed_scale: no CUDA device visible to torch; simulator part only" | tee -a "$log"
  exit 2
fi
"$py" -c "import torch; print('device:', torch.cuda.get_device_name(0), torch.__version__)" | tee -a "$log"
run_dir=${RUN_DIR:-$(mktemp -d /tmp/skyrl-sim-seed-scale.XXXXXX)}
trap 'rm -rf "$run_dir"' EXIT
# 300 s for the three variants (each starts its own worker and builds 1.0 B parameters), leaving time to compare.
set +e
timeout --signal=TERM --kill-after=20 300 "$py" -m skyrl_sim.cli run "$scenario" \
  --endpoint "$endpoint" --backend megatron --all-variants \
  --option run_dir="$run_dir" --option startup_timeout_s=180 --option call_timeout_s=180 \
  --json "$out/seed_scale.megatron.json" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -eq 2 ]; then
  echo "gpu_check_seed_scale: the real backend refused the endpoint (see above)" | tee -a "$log"
  exit 3
fi
"$py" -m skyrl_sim.cli compare "$scenario" --endpoint "$endpoint" --backends sim --all-variants \
  --against "$out/seed_scale.megatron.json" --json "$out/seed_scale.compare.json" 2>&1 | tee -a "$log" || true
echo "gpu_check_seed_scale took $(( $(date +%s) - start )) s (real backend exit code $rc)" | tee -a "$log"
exit "$rc"
