#!/usr/bin/env bash
# Install a real SkyRL Tinker service (PyPI skyrl==0.4.0, JAX backend, CPU) into its own venv, for tests/service/.
#
# skyrl 0.4.0 declares Python >= 3.12; it runs on 3.11 with the shims in tests/service/shims.py, so the wheel goes in
# with --no-deps --ignore-requires-python and its runtime dependencies are installed by hand (flax==0.12.8 pulls jax;
# aiohttp is used but not declared). Idempotent: a finished venv is marked with .installed and reused.
#
# Usage: scripts/install_skyrl_service.sh [VENV_DIR]   (default: .venv-skyrl-service at the repository root)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-skyrl-service}"
PYTHON="${SKYRL_SERVICE_PYTHON:-python3.11}"
STAMP="$VENV/.installed-skyrl-0.4.0"
if [[ -f "$STAMP" ]]; then
  echo "skyrl service venv ready: $VENV"
  exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/pip" install --disable-pip-version-check --quiet --timeout 60 --retries 3)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" --no-deps --ignore-requires-python "skyrl==0.4.0"
# skyrl.backends.renderer imports torch and skyrl.tx imports peft even on the JAX path: the local CPU torch, pinned.
"${PIP[@]}" -c "$ROOT/constraints.txt" "torch==2.13.0" "peft==0.18.1"
# The service's runtime dependencies (API: fastapi/uvicorn/sqlmodel; engine: jax via flax, transformers for the
# tokenizer/config; the undeclared aiohttp). tokenizers builds the tiny local tokenizer.
"${PIP[@]}" -c "$ROOT/constraints.txt" "flax==0.12.8" optax "jax<1.0" aiohttp "fastapi[standard]" uvicorn sqlmodel "sqlalchemy[asyncio]" aiosqlite \
  "transformers>=5.6.1,<=5.16.1" "tokenizers>=0.23.1" "safetensors>=0.6.2" cloudpathlib typer rich loguru zstandard xxhash \
  jaxtyping "tinker==0.25.0" httpx typing_extensions
touch "$STAMP"
echo "skyrl service venv installed in $(( $(date +%s) - start )) s: $VENV"
