"""Build the wheel set the offline GPU machine needs: this project's wheel and the Python 3.12 wheels of every
package it needs that the machine's image does not carry.

    .venv/bin/python scripts/gpu_wheels.py [--out .whl]        (on a networked machine, from the repository root)

The GPU machine (Python 3.12, torch preinstalled, no network) installs them with
``pip install --no-index --no-deps --target DIR .whl/*.whl`` (``scripts/gpu_check.sh`` does). The set is the
dependency closure of skyrl-sim's core requirements plus megatron-core, at the versions installed in this venv (the
versions the tests ran with), minus what the image already holds (``IMAGE``, as the device notes list it). vLLM is
not carried (its wheel is too large): GPU runs are training-only.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTRA = ("megatron-core",)  # the real backend's trainer; torch is the image's own
IMAGE = frozenset(
    [
        "numpy",
        "torch",
        "triton",
        "pluggy",
        "pyyaml",
        "rich",
        "matplotlib",
        "transformers",
        "tokenizers",
        "safetensors",
        "packaging",
        "typing-extensions",
        "pillow",
        "contourpy",
        "cycler",
        "fonttools",
        "kiwisolver",
        "pyparsing",
        "python-dateutil",
        "six",
        "markdown-it-py",
        "mdurl",
        "pygments",
        "filelock",
        "fsspec",
        "jinja2",
        "markupsafe",
        "networkx",
        "sympy",
        "mpmath",
        "huggingface-hub",
        "hf-xet",
        "regex",
        "requests",
        "urllib3",
        "idna",
        "certifi",
        "charset-normalizer",
        "tqdm",
        "greenlet",
        "setuptools",
        "wheel",
        "pip",
        "psutil",
        "attrs",
        "anyio",
        "h11",
        "httpcore",
        "httpx",
        "sniffio",
    ]
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(dist: str) -> list[str]:
    """The unconditional (no extra, no environment marker that fails here) requirements of an installed dist."""
    names = []
    for spec in metadata.requires(dist) or []:
        requirement, _, marker = spec.partition(";")
        if "extra" in marker:
            continue
        names.append(normalise(re.split(r"[\s<>=!~\[(]", requirement.strip(), maxsplit=1)[0]))
    return names


def closure(roots: list[str]) -> dict[str, str]:
    """Installed name -> version of every package the roots need, transitively."""
    seen: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = normalise(todo.pop())
        if name in seen:
            continue
        try:
            seen[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"gpu_wheels: {name} is not installed here; run scripts/test.sh first") from None
        todo += requirement_names(name)
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / ".whl"), help="wheel folder (default .whl, git-ignored)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    needed = closure([*requirement_names("skyrl-sim"), *EXTRA])
    carried = {name: version for name, version in sorted(needed.items()) if name not in IMAGE}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(out), str(ROOT)], check=True, timeout=600)
    platform = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for name, version in carried.items():
        command = [
            *pip,
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *platform,
            "-d",
            str(out),
            f"{name}=={version}",
        ]
        subprocess.run(command, check=True, timeout=600)
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {size:.1f} MiB in {out}: " + ", ".join(w.name.split("-")[0] for w in wheels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
