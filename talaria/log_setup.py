"""Process-wide structlog setup for the live servers: one JSON object per line (orjson)."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import orjson
import structlog

__all__ = ["configure_logging"]


def configure_logging(level: str = "info", stream: TextIO | None = None, **context: str) -> None:
    """JSON lines on ``stream`` (stderr by default) at ``level`` and above; ``context``
    (e.g. ``process="instance"``) is bound into every record."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    out = stream if stream is not None else sys.stderr
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=orjson.dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.BytesLoggerFactory(out.buffer if hasattr(out, "buffer") else out),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if context:
        structlog.contextvars.bind_contextvars(**context)
