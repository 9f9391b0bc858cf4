"""Sessions inferred from prompts against the trace's own: the replay with ids withheld.

``talaria replay --strip-session-ids`` replays the trace twice on the simulated cluster under
one system (default Talaria): once sending each call's session id, once sending none, so the
router infers every session from the prompts. It reports how many calls the router served in
their true session and both runs' SCT.

A call counts as matched when its inferred session and its true session are each other's
majority: most of the true session's calls went to that inferred session, and most of that
inferred session's calls belong to that true session. A split session (a continuation that
started a new inferred session) or a merged one (two true sessions in one inferred) loses the
calls on the minority side.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import ReplayResult, SessionResult, run_sim
from workloads.replay.systems import SystemConfig
from workloads.suite.stats import percentile
from workloads.traces.trace import Session

__all__ = ["SessionMatch", "InferenceCheck", "session_match", "check_inference", "format_check"]


@dataclass(frozen=True)
class SessionMatch:
    calls: int
    matched: int
    true_sessions: int
    inferred_sessions: int

    @property
    def rate(self) -> float:
        return self.matched / self.calls if self.calls else 1.0


def session_match(results: Sequence[SessionResult]) -> SessionMatch:
    """How many calls the router served in their true session (see the module docstring)."""
    pairs = [(s.session_id, c.session_id) for s in results for c in s.calls]
    missing = sum(1 for _, inferred in pairs if inferred is None)
    if missing:
        raise ValueError(f"{missing} calls have no session the router used; replay them through the router")
    true_to: dict[str, Counter[str | None]] = {}
    inferred_to: dict[str | None, Counter[str]] = {}
    for true, inferred in pairs:
        true_to.setdefault(true, Counter())[inferred] += 1
        inferred_to.setdefault(inferred, Counter())[true] += 1
    major_inferred = {t: c.most_common(1)[0][0] for t, c in true_to.items()}
    major_true = {i: c.most_common(1)[0][0] for i, c in inferred_to.items()}
    matched = sum(1 for t, i in pairs if major_inferred[t] == i and major_true[i] == t)
    return SessionMatch(len(pairs), matched, len(true_to), len(inferred_to))


@dataclass(frozen=True)
class InferenceCheck:
    system: str
    with_ids: ReplayResult
    without_ids: ReplayResult
    match: SessionMatch
    shared_prefix_tokens: int


def check_inference(
    sessions: Sequence[Session], system: SystemConfig, spec: ClusterSpec | None = None, *,
    seed: int = 0, shared_prefix_tokens: int = 0, progress: bool = False,
) -> InferenceCheck:
    with_ids = run_sim(sessions, system, spec, seed=seed, progress=progress,
                       shared_prefix_tokens=shared_prefix_tokens)
    without = run_sim(sessions, system, spec, seed=seed, progress=progress, send_session_ids=False,
                      shared_prefix_tokens=shared_prefix_tokens)
    return InferenceCheck(system.name, with_ids, without, session_match(without.sessions), shared_prefix_tokens)


def _sct(result: ReplayResult, q: float) -> float:
    return percentile([s.sct_s for s in result.sessions], q)


def format_check(check: InferenceCheck) -> str:
    m = check.match
    lines = [
        f"session inference ({check.system}, shared prompt prefix {check.shared_prefix_tokens} tokens): "
        f"{m.matched}/{m.calls} calls in their true session ({100 * m.rate:.2f}%); "
        f"{m.true_sessions} true sessions, {m.inferred_sessions} inferred",
        "| run | SCT p50 (s) | SCT p95 (s) | mean SCT (s) | failed calls |",
        "|---|---|---|---|---|",
    ]
    for name, result in (("session ids sent", check.with_ids), ("ids withheld, inferred", check.without_ids)):
        mean = sum(s.sct_s for s in result.sessions) / len(result.sessions)
        lines.append(f"| {name} | {_sct(result, 50):.1f} | {_sct(result, 95):.1f} | {mean:.1f} | "
                     f"{result.failed_calls} |")
    p50 = _sct(check.without_ids, 50) / _sct(check.with_ids, 50) - 1
    p95 = _sct(check.without_ids, 95) / _sct(check.with_ids, 95) - 1
    lines.append(f"inferred vs sent: p50 {100 * p50:+.2f}%, p95 {100 * p95:+.2f}%")
    return "\n".join(lines)
