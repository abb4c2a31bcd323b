"""One line naming the GPU machine and the software a GPU check ran with (the ``measured_on`` of a validation
manifest): the card, driver, Python, torch with its CUDA, megatron-core, TransformerEngine and skyrl-sim versions.

    python3 scripts/gpu_env.py        (scripts/gpu_check.sh and scripts/gpu_check_seed_scale.sh call it)
"""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata

import torch


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def main() -> None:
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    smi = subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines()
    card = smi[0] if smi else torch.cuda.get_device_name(0)
    print(
        f"GPU: {card}, Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"megatron-core {version('megatron-core')}, transformer-engine {version('transformer-engine')}, "
        f"skyrl-sim {version('skyrl-sim')}"
    )


if __name__ == "__main__":
    main()
