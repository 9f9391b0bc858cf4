"""The control plane's floor that ``--bench-sim`` runs: the same sessions, nothing left of a
call but its control-plane work."""

from __future__ import annotations

from dataclasses import replace

from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import run_sim
from workloads.replay.sim_bench import FLOOR_PROMPT_TOKENS, control_plane_floor
from workloads.replay.systems import SYSTEMS
from workloads.traces.generator import default_trace
from workloads.traces.trace import Call, CallRef, Session, validate_sessions


def _with_dependencies() -> list[Session]:
    parent = Session("p", "qwen3-235b-a22b", (
        Call(5000, 300, 1.0), Call(6000, 200, 0.5, waits_for=(CallRef("c", 1),)),
        Call(7000, 100, None)))
    child = Session("c", "glm-4.5-air", (
        Call(3000, 50, 0.2, prefix_from=CallRef("p", 0), prefix_tokens=2000),
        Call(3500, 80, None)), arrival_s=0.5, parent_id="p", start_after=CallRef("p", 0))
    return [parent, child]


def test_the_floor_keeps_every_session_and_dependency_with_tiny_calls() -> None:
    sessions = [*default_trace()[:4], *_with_dependencies()]
    floor = control_plane_floor(sessions)
    validate_sessions(floor)  # a valid trace: prompts grow, prefixes fit
    for before, after in zip(sessions, floor, strict=True):
        assert (after.session_id, after.model, after.arrival_s, after.parent_id,
                after.start_after) == (before.session_id, before.model, before.arrival_s,
                                       before.parent_id, before.start_after)
        assert [c.tool_gap_s for c in after.calls] == [c.tool_gap_s for c in before.calls]
        assert [(c.waits_for, c.prefix_from) for c in after.calls] == [
            (c.waits_for, c.prefix_from) for c in before.calls]
        assert [c.input_tokens for c in after.calls] == [
            FLOOR_PROMPT_TOKENS + 2 * k for k in range(len(before.calls))]
        assert {c.output_tokens for c in after.calls} == {1}


def test_the_floor_replays_every_call_and_each_answers_one_token() -> None:
    sessions = default_trace()[:3]
    result = run_sim(control_plane_floor(sessions), SYSTEMS["talaria"],
                     replace(ClusterSpec(), servers=1))
    assert result.failed_calls == 0
    calls = result.calls
    assert len(calls) == sum(s.num_calls for s in sessions)
    assert {c.output_tokens for c in calls} == {1}
