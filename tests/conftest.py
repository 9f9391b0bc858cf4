"""Shared pytest configuration: tests run on the CPU with few threads.

torch is not imported here (the router's and the simulator's tests import without it); once
collection is done, if some test module imported it, its thread count is capped at 2, and
at 1 in each pytest-xdist worker (``make test`` runs one per core: they share the cores)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    torch = sys.modules.get("torch")
    if torch is not None:
        cap = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
        torch.set_num_threads(max(1, min(cap, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """A test that runs a CLI in-process configures structlog onto pytest's captured stderr,
    which closes after the test: every later log line (an admission loop's crash report)
    would then raise on a closed file. Each test's logging is put back as it found it."""
    import structlog

    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
    structlog.contextvars.clear_contextvars()
