#!/usr/bin/env bash
# GPU check: the real backend on CUDA against the simulator, written as validation folders.
#
# Runs as is on the offline GPU machine (Python 3.12, torch preinstalled, no network) from the repository root:
#   - with .whl/ present (bash scripts/gpu_wheels.sh builds it on a networked machine), it installs the project and
#     what the image lacks with `pip install --no-index --no-deps --target`; else it uses .venv/ or python3 as found;
#   - CHECKS (default "seed-scale") picks what runs, in order:
#       seed-scale  scripts/gpu_check_seed_scale.sh: queue_drain_17.yaml's three variants at their real lengths on
#                   seed-scale-h200-tp1 (one H200, TP 1, flash attention, fused LM-head log-prob, bf16 adapters),
#                   into validation/seed-scale-h200-tp1/; about 4-4.5 minutes (estimate in that script);
#       mid-cuda    the mid-cuda endpoint (bf16, megatron-core local spec, TP 1): the miniature 17-request drain
#                   (every variant, 40 GiB limit), the seed's full lengths (cap-aware, 130 GiB) and a multi-row
#                   multi-tenant mix, into validation/$NAME/ (runs/, measured.yaml); about 4 minutes (42-46 s per
#                   worker start, measured at b17158d);
#       allocator   scripts/gpu_check_allocator.py: the classic caching allocator model against torch.cuda
#                   (expandable_segments:False) on the same allocation sequences (its rule cases, and one rank's
#                   calls of mid-cuda as the walk orders them), reserved and allocated bytes compared after every
#                   operation, into $OUT/allocator_check.json; under a minute;
#       vllm-start  scripts/measure_vllm_start.py --device cuda: vLLM's start (Qwen3-0.6B's shape, bf16, no override,
#                   utilization 0.8) step by step from torch.cuda counters (the weights, the profile run, the KV
#                   cache, the CUDA-graph capture, the sampler warm-up) beside the simulator's start on the same
#                   device, into $OUT/vllm-start/summary.json; needs vLLM on the machine (it says so and goes on
#                   when there is none); about 1-2 minutes (estimate: never run, no GPU with vLLM has been lent);
#   - each check regenerates its folder's summary with scripts/validate.py --measured (the simulator's side runs
#     there too) and copies the few files worth keeping to $OUT.
# Budget: under 6 minutes of GPU time for the default; CHECKS="seed-scale mid-cuda" needs about 8-9.
# SNAPSHOT=1 also records CUDA allocator snapshots of single calls (mid-cuda).
# Without CUDA it stops with exit code 2 and says so.
# Usage: bash scripts/gpu_check.sh      (NAME=mid-cuda-h200 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
name=${NAME:-mid-cuda-h200}
checks=${CHECKS:-seed-scale}
folder=validation/$name
out=${OUT:-gpu_check_out}
mkdir -p "$out"
log="$out/gpu_check.log"
: >"$log"
say() { echo "$@" | tee -a "$log"; }

py=python3
if compgen -G ".whl/*.whl" >/dev/null; then
  site=${SITE:-/tmp/skyrl-sim-site}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
elif [ -x .venv/bin/python ]; then
  py=.venv/bin/python
fi
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  say "gpu_check: no CUDA device visible to torch; nothing to check"
  exit 2
fi
measured_on=$("$py" scripts/gpu_env.py)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
say "measured on: $measured_on, commit $commit"
start=$(date +%s)

for check in $checks; do
  case "$check" in
    seed-scale | mid-cuda | allocator | vllm-start) ;;
    *) say "gpu_check: unknown check '$check' in CHECKS (known: seed-scale, mid-cuda, allocator, vllm-start)"; exit 2 ;;
  esac
done
status=0
if [[ " $checks " == *" seed-scale "* ]]; then
  PY="$py" MEASURED_ON="$measured_on" OUT="$out" bash scripts/gpu_check_seed_scale.sh 2>&1 | tail -n 60 | tee -a "$log" \
    || status=$?
  say "gpu_check: seed-scale finished after $(( $(date +%s) - start )) s"
fi
if [[ " $checks " == *" allocator "* ]]; then
  timeout --signal=TERM --kill-after=20 240 "$py" scripts/gpu_check_allocator.py --out "$out" 2>&1 | tee -a "$log" \
    || status=1
  say "gpu_check: allocator finished after $(( $(date +%s) - start )) s"
fi
if [[ " $checks " == *" vllm-start "* ]]; then
  mkdir -p "$out/vllm-start"
  timeout --signal=TERM --kill-after=20 240 "$py" scripts/measure_vllm_start.py --device cuda --out "$out/vllm-start" \
    2>&1 | tail -n 40 | tee -a "$log" || say "gpu_check: vllm-start did not finish (see the log)"
  say "gpu_check: vllm-start finished after $(( $(date +%s) - start )) s"
fi
if [[ " $checks " != *" mid-cuda "* ]]; then
  say "gpu_check took $(( $(date +%s) - start )) s"
  exit "$status"
fi
mkdir -p "$folder/runs"

run_dir=${RUN_DIR:-$(mktemp -d /tmp/skyrl-sim-gpu-check.XXXXXX)}
trap 'rm -rf "$run_dir"' EXIT
opts=(--backend megatron --endpoint mid-cuda --option run_dir="$run_dir" --option startup_timeout_s=180
      --option call_timeout_s=180)
real() {  # real SECONDS JSON SCENARIO ARGS...: one scenario on the real backend, bounded
  local seconds=$1 json=$2 scenario=$3
  shift 3
  timeout --signal=TERM --kill-after=20 "$seconds" "$py" -m skyrl_sim.cli run "$scenario" "${opts[@]}" "$@" \
    --json "$json" 2>&1 | tail -n 40 | tee -a "$log" || say "gpu_check: $scenario did not finish in ${seconds} s"
}
real 210 "$folder/runs/queue_drain_17_tiny.megatron.json" scenarios/queue_drain_17_tiny.yaml --all-variants
real 90 "$folder/runs/queue_drain_17.capaware_130gib.megatron.json" scenarios/queue_drain_17.yaml \
  --variant cap-aware --set memory_limit_gib=130
real 120 "$folder/runs/multi_tenant_mix.megatron.json" scenarios/multi_tenant_mix.yaml --all-variants
say "gpu_check: real runs took $(( $(date +%s) - start )) s"

cat >"$folder/measured.yaml" <<YAML
# Real runs of the real backend on CUDA, written by scripts/gpu_check.sh at commit $commit; regenerate the summary with
#   .venv/bin/python scripts/validate.py --measured $folder/measured.yaml
name: $name
endpoint: mid-cuda
measured_on: "$measured_on, skyrl-sim commit $commit"
runs:
  - {scenario: scenarios/queue_drain_17_tiny.yaml, file: runs/queue_drain_17_tiny.megatron.json}
  - {scenario: scenarios/queue_drain_17.yaml, file: runs/queue_drain_17.capaware_130gib.megatron.json, set: {memory_limit_gib: 130}}
  - {scenario: scenarios/multi_tenant_mix.yaml, file: runs/multi_tenant_mix.megatron.json}
YAML
for f in "$folder"/runs/*.megatron.json; do [ -s "$f" ] || { say "gpu_check: $f missing"; rm -f "$f"; }; done

if [ "${SNAPSHOT:-0}" = 1 ]; then
  timeout 120 "$py" scripts/cuda_memory_snapshot.py "$out" 2>&1 | tail -n 30 | tee -a "$log" || true
fi
"$py" scripts/validate.py --measured "$folder/measured.yaml" 2>&1 | tail -n 25 | tee -a "$log" || true
cp "$folder"/runs/*.megatron.json "$folder/measured.yaml" "$out"/ 2>/dev/null || true
cp "$folder/summary.md" "$out"/ 2>/dev/null || true
say "gpu_check took $(( $(date +%s) - start )) s; validation folder: $folder (bring back runs/ and measured.yaml)"
exit "$status"
