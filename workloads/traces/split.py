"""The development / report split of a trace's sessions.

A session belongs to the report half when the CRC-32 of its id is odd, else to the
development half: a fixed, seedless split that a session keeps whatever else the trace
holds. Rules and constants are chosen on the development half (and the development traces);
the report half is what the headline shows and nothing was tuned on.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from workloads.traces.trace import Session

__all__ = ["dev_half", "in_report_half", "report_half"]


def in_report_half(session_id: str) -> bool:
    return zlib.crc32(session_id.encode()) % 2 == 1


def report_half(sessions: Sequence[Session]) -> list[Session]:
    return [s for s in sessions if in_report_half(s.session_id)]


def dev_half(sessions: Sequence[Session]) -> list[Session]:
    return [s for s in sessions if not in_report_half(s.session_id)]
