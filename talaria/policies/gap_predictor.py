"""Per-session history: when a session's next call is expected and how big it will be.

Gaps (end of a call -> arrival of the session's next call) are learned per session with an
EWMA; before a session has a measured gap, the instance-wide EWMA (itself seeded with a
configured prior) stands in. A client hint (``expected_gap_s``) overrides the estimate for the
gap it describes. Sizes (new prompt tokens per call, output tokens per call) are learned the
same way and feed service-time estimates. The instance-wide recent gaps are kept as samples
(a bounded window) for rules that need their distribution, not only their mean; and each
session's attained service and total wait, for priority rules.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["SessionHistory", "GapPredictor"]


@dataclass
class SessionHistory:
    session_id: str
    model: str
    calls: int = 0
    last_end: float | None = None  # loop time the last call finished
    last_tokens: int = 0  # prompt + output tokens of the last call (its KV prefix)
    hint_gap_s: float | None = None  # client's hint for the current gap
    last_call: bool = False
    gap_s: float | None = None  # EWMA of observed gaps
    new_tokens: float | None = None  # EWMA of prompt tokens beyond the previous prefix
    output_tokens: float | None = None  # EWMA of output tokens per call
    last_seen: float = 0.0
    first_arrival: float = 0.0  # when its first call (of this model) arrived here
    attained_s: float = 0.0  # execution time of its finished calls here
    waited_s: float = 0.0  # time its finished calls waited for admission here


GAP_SAMPLES = 1000  # recent gaps kept instance-wide


class GapPredictor:
    def __init__(self, default_gap_s: float, alpha: float) -> None:
        self.alpha = alpha
        self.global_gap_s = default_gap_s
        self.sessions: dict[str, SessionHistory] = {}
        self.recent_gaps: deque[float] = deque(maxlen=GAP_SAMPLES)

    def get(self, session_id: str) -> SessionHistory | None:
        return self.sessions.get(session_id)

    def on_arrival(self, session_id: str, model: str, prompt_tokens: int, now: float) -> None:
        """A call of the session arrived: learn the gap since its previous call ended."""
        hist = self.sessions.get(session_id)
        if hist is None or hist.model != model:
            # New here, or the session moved to another model: its history does not apply.
            self.sessions[session_id] = SessionHistory(
                session_id, model, last_seen=now, first_arrival=now
            )
            return
        hist.last_seen = now
        if hist.last_end is not None:
            gap = max(0.0, now - hist.last_end)
            hist.gap_s = gap if hist.gap_s is None else self._mix(hist.gap_s, gap)
            self.global_gap_s = self._mix(self.global_gap_s, gap)
            self.recent_gaps.append(gap)
            hist.last_end = None
        new = max(0, prompt_tokens - hist.last_tokens)
        hist.new_tokens = new if hist.new_tokens is None else self._mix(hist.new_tokens, new)

    def on_end(
        self,
        session_id: str,
        total_tokens: int,
        output_tokens: int,
        now: float,
        hint_gap_s: float | None,
        last_call: bool,
    ) -> None:
        hist = self.sessions[session_id]
        hist.calls += 1
        hist.last_end = now
        hist.last_seen = now
        hist.last_tokens = total_tokens
        hist.hint_gap_s = hint_gap_s
        hist.last_call = last_call
        out = float(output_tokens)
        hist.output_tokens = (
            out if hist.output_tokens is None else self._mix(hist.output_tokens, out)
        )

    def on_service(self, session_id: str, waited_s: float, served_s: float) -> None:
        """A call of the session waited ``waited_s`` for admission and ran ``served_s``."""
        hist = self.sessions.get(session_id)
        if hist is not None:
            hist.waited_s += max(0.0, waited_s)
            hist.attained_s += max(0.0, served_s)

    def predict_gap(self, session_id: str) -> float | None:
        """Expected seconds from the session's last call end to its next call (None: no
        next call expected)."""
        hist = self.sessions.get(session_id)
        if hist is None or hist.last_call:
            return None
        if hist.hint_gap_s is not None:
            return max(0.0, hist.hint_gap_s)
        return hist.gap_s if hist.gap_s is not None else self.global_gap_s

    def forget(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def _mix(self, old: float, new: float) -> float:
        return self.alpha * new + (1 - self.alpha) * old
