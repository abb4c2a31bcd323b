"""Fixtures for the live-service tests: one SkyRL service (venv installed on first use) per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from skyrl_service import SkyRLService, install_service_venv, make_tiny_qwen3


@pytest.fixture(scope="session")
def skyrl_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkyRLService]:
    if os.environ.get("SKYRL_SIM_SKIP_SERVICE"):
        pytest.skip("SKYRL_SIM_SKIP_SERVICE is set")
    python = install_service_venv()
    model = make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))
    service = SkyRLService(model, workdir=tmp_path_factory.mktemp("skyrl-service"), python=python)
    with service:
        yield service
