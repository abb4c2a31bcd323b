#!/usr/bin/env bash
# GPU check at the seed's per-GPU scale: queue_drain_17.yaml (its real lengths, 35,000 tokens included, micro 16) in
# all three variants against scenarios/endpoints/seed-scale-h200-tp1.yaml on one H200: the simulator first (its
# verdicts are pinned by tests/test_seed_scale.py), then the real backend (flash attention, the fused LM-head log-prob,
# bf16 model and adapters; the device's own OOM under set_per_process_memory_fraction at the endpoint's 67.5 GiB).
# Writes validation/seed-scale-h200-tp1/ (runs/queue_drain_17.megatron.json, measured.yaml, and the summary that
# scripts/validate.py --measured makes from them: compare.json, summary.md, ...) and copies the files worth keeping
# to ${OUT:-gpu_check_out}/seed-scale-h200-tp1/. Without CUDA it stops after the simulator's part with exit code 2.
# Time, estimated: the time model (h200 profile) puts the three variants' calls at 2.6 + 12.6 + 2.2 s (allow x3: the
# stock profile was 68-92% too fast for mid-cuda's calls); each variant starts its own worker, which took 42-46 s for
# mid-cuda on the H200 and needs about 20 s more here (1.0 B weights drawn on the host: 22 s on a 2-core machine, and a
# 2.1 GB checkpoint written): about 3 x 65 + 50 s = 4 to 4.5 minutes with the summary, inside the 300 s bound below
# and the 6-minute budget.
# Usage: bash scripts/gpu_check_seed_scale.sh   (from the repository root; scripts/gpu_check.sh calls it with PY set)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check_out}
mkdir -p "$out"
log="$out/seed_scale.log"
py=${PY:-}
if [ -z "$py" ]; then
  py=python3
  [ -x .venv/bin/python ] && py=.venv/bin/python
fi
endpoint=seed-scale-h200-tp1
scenario=scenarios/queue_drain_17.yaml
folder=validation/$endpoint
start=$(date +%s)
"$py" -m skyrl_sim.cli check "$scenario" --endpoint "$endpoint" --json "$out/seed_scale.sim.json" 2>&1 | tee "$log"
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check_seed_scale: no CUDA device visible to torch; simulator part only" | tee -a "$log"
  exit 2
fi
measured_on=${MEASURED_ON:-$("$py" scripts/gpu_env.py)}
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "measured on: $measured_on, commit $commit" | tee -a "$log"
mkdir -p "$folder/runs"
run_dir=${RUN_DIR:-$(mktemp -d /tmp/skyrl-sim-seed-scale.XXXXXX)}
trap 'rm -rf "$run_dir"' EXIT
set +e
timeout --signal=TERM --kill-after=20 300 "$py" -m skyrl_sim.cli run "$scenario" \
  --endpoint "$endpoint" --backend megatron --all-variants \
  --option run_dir="$run_dir" --option startup_timeout_s=180 --option call_timeout_s=180 \
  --json "$folder/runs/queue_drain_17.megatron.json" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -eq 2 ]; then
  echo "gpu_check_seed_scale: the real backend refused the endpoint (see above)" | tee -a "$log"
  exit 3
fi
if [ ! -s "$folder/runs/queue_drain_17.megatron.json" ]; then
  echo "gpu_check_seed_scale: no RunResult written (exit code $rc; a timeout is 124)" | tee -a "$log"
  exit 1
fi
cat >"$folder/measured.yaml" <<YAML
# Real runs of the real backend on CUDA, written by scripts/gpu_check_seed_scale.sh at commit $commit; regenerate the
# summary with: .venv/bin/python scripts/validate.py --measured $folder/measured.yaml
name: $endpoint
endpoint: $endpoint
measured_on: "$measured_on, skyrl-sim commit $commit"
runs:
  - {scenario: $scenario, file: runs/queue_drain_17.megatron.json}
YAML
"$py" scripts/validate.py --measured "$folder/measured.yaml" 2>&1 | tail -n 25 | tee -a "$log" || true
mkdir -p "$out/$endpoint"
cp "$folder/runs/queue_drain_17.megatron.json" "$folder/measured.yaml" "$out/$endpoint"/
cp "$folder/summary.md" "$folder/compare.json" "$out/$endpoint"/ 2>/dev/null || true
echo "gpu_check_seed_scale took $(( $(date +%s) - start )) s (real backend exit code $rc); bring back $folder/runs/" \
  "and $folder/measured.yaml" | tee -a "$log"
exit "$rc"
