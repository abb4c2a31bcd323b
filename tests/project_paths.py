"""Paths every test uses; a module of its own so test folders with their own conftest.py cannot shadow it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios"
