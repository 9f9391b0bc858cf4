"""Shared pytest configuration: tests run on the CPU with few threads.

torch is not imported here (the router's and the simulator's tests import without it); once
collection is done, if some test module imported it, its thread count is capped at 2."""

from __future__ import annotations

import sys

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
