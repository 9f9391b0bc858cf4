"""Fixtures shared by the workloads' command-line tests."""

from __future__ import annotations

import pytest

from workloads import replay_cli
from workloads.suite import day_cli


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``talaria replay``'s runs fail the test if reached: a refusal must come first."""
    def ran(*args: object, **kwargs: object) -> int:
        raise AssertionError("ran instead of refusing")

    for name in ("_simulate", "_develop", "_live"):
        monkeypatch.setattr(replay_cli, name, ran)
    monkeypatch.setattr(day_cli, "run_day_command", ran)
