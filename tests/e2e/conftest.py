"""Shared fixtures for the end-to-end tests: one Talaria cache dir for every `talaria serve`
subprocess of the session (the first one writes the tiny models into it)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def serve_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("talaria-cache")
