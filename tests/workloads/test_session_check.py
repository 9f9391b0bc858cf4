"""Sessions inferred from prompts on the replay with ids withheld: the match measure on hand-
built cases, then a small generated trace on the simulated cluster (every session's first
prompt starting with one shared system prompt), inferred against sent."""

from __future__ import annotations

import pytest

from workloads.cluster import ClusterSpec
from workloads.generator import generate_trace
from workloads.replay import CallRecord, SessionResult
from workloads.session_check import check_inference, format_check, session_match
from workloads.systems import SYSTEMS


def _result(true: str, inferred: list[str | None]) -> SessionResult:
    calls = [CallRecord(k, 0.0, None, 1.0, 10, 1, 0, session_id=s) for k, s in enumerate(inferred)]
    return SessionResult(true, "m", 0.0, calls)


def test_match_counts_splits_and_merges() -> None:
    exact = session_match([_result("a", ["x", "x", "x"]), _result("b", ["y", "y"])])
    assert (exact.matched, exact.calls, exact.rate) == (5, 5, 1.0)
    split = session_match([_result("a", ["x", "x", "z"]), _result("b", ["y", "y"])])
    assert split.matched == 4 and split.inferred_sessions == 3
    merged = session_match([_result("a", ["x", "x", "x"]), _result("b", ["x", "y", "y"])])
    assert merged.matched == 5 and merged.true_sessions == 2  # b's first call went to a's session
    with pytest.raises(ValueError, match="no session"):
        session_match([_result("a", [None])])


def test_inferred_sessions_match_and_cost_nothing_on_a_small_trace() -> None:
    models = ("glm-4.5-air", "mistral-large-2407")
    trace = generate_trace(num_sessions=6, total_calls=48, models=models, seed=5)
    check = check_inference(trace, SYSTEMS["talaria"], ClusterSpec(models=models), shared_prefix_tokens=4000)
    assert check.match.rate >= 0.99 and check.match.inferred_sessions == 6
    assert all(c.session_id and c.session_id.startswith("inferred-") for s in check.without_ids.sessions
               for c in s.calls)
    assert all(c.session_id == s.session_id for s in check.with_ids.sessions for c in s.calls)
    sent = sorted(s.sct_s for s in check.with_ids.sessions)
    inferred = sorted(s.sct_s for s in check.without_ids.sessions)
    assert all(abs(a - b) <= 0.05 * a for a, b in zip(sent, inferred, strict=True))
    assert check.with_ids.failed_calls == check.without_ids.failed_calls == 0
    # The shared system prompt is served from cache to every model's sessions after its first.
    later_firsts = len(trace) - len({s.model for s in trace})
    assert sum(s.calls[0].cached_tokens for s in check.without_ids.sessions) >= later_firsts * 3968
    assert "calls in their true session (100.00%)" in format_check(check)
