"""Shared fixtures for the instance tests: the tiny random-weight catalog, written once per
test session, for tests that run an instance on the real multi-model engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.models.tiny import make_tiny_models


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_tiny_models(tmp_path_factory.mktemp("instance-models"))
