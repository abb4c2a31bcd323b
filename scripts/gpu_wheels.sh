#!/usr/bin/env bash
# Build .whl/ for the offline GPU machine (Python 3.12): this project's wheel and the wheels its image lacks.
# Run on a networked machine after scripts/test.sh has built .venv (the versions the tests ran with are carried).
# Usage: bash scripts/gpu_wheels.sh [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
[ -x "$py" ] || { echo "gpu_wheels: run scripts/test.sh first (needs .venv)" >&2; exit 2; }
exec "$py" scripts/gpu_wheels.py "$@"
