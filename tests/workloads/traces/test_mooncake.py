"""Dynamo's agentic Mooncake traces: the reader (sessions, subagents that start after and join
their parents, gaps, prefixes from hash_ids), the dependencies kept by our trace format, and
the replay running children beside their parents as recorded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from talaria.clock import run_virtual
from talaria.protocol import CallRequest
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import CallOutcome, drive, replicate, run_sim
from workloads.replay.prompts import SessionTokens
from workloads.replay.systems import SYSTEMS
from workloads.traces.assignment import assign_models
from workloads.traces.mooncake import read_mooncake_trace
from workloads.traces.readers import load_any_trace
from workloads.traces.trace import (
    Call,
    CallRef,
    Session,
    TraceError,
    dumps_trace,
    loads_trace,
    validate_sessions,
)

FIXTURE = Path(__file__).parent / "data" / "agentic_mooncake.jsonl"
MAIN, CHILD, OTHER = "run-1:main", "run-1:main:explore-1", "run-2:main"


def test_reader_builds_sessions_children_and_prefixes() -> None:
    sessions = {s.session_id: s for s in load_any_trace(FIXTURE)}
    assert list(sessions) == [MAIN, CHILD, OTHER]
    main, child, other = sessions[MAIN], sessions[CHILD], sessions[OTHER]
    assert [(c.input_tokens, c.output_tokens, c.tool_gap_s) for c in main.calls] == [
        (130, 20, 0.2), (200, 16, 0.1), (300, 24, 0.03), (150, 9, None)]
    assert main.parent_id is None and main.arrival_s == 0.0 and other.arrival_s == pytest.approx(0.3)
    assert main.calls[2].waits_for == (CallRef(CHILD, 1),)  # the parent joins its subagent
    assert main.calls[1].extends_previous and main.calls[2].extends_previous
    assert (main.calls[3].prefix_from, main.calls[3].prefix_tokens) == (None, 128)  # compaction: 2 blocks kept
    assert child.parent_id == MAIN and child.start_after == CallRef(MAIN, 0) and child.arrival_s == pytest.approx(0.1)
    assert (child.calls[0].prefix_from, child.calls[0].prefix_tokens) == (CallRef(MAIN, 0), 64)
    assert child.calls[1].extends_previous and child.calls[0].tool_gap_s == pytest.approx(0.1)
    assert other.calls[0].tool_gap_s == pytest.approx(0.5)
    # Our JSONL keeps it all.
    assert loads_trace(dumps_trace(sessions.values())) == list(sessions.values())
    assigned = {s.session_id: s.model for s in assign_models(list(sessions.values()), ["a", "b"], seed=1)}
    assert assigned[CHILD] == assigned[MAIN]


@pytest.mark.parametrize("line, match", [
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}', "no session_id"),
    ('{"session_id": "s", "input_length": 0, "output_length": 2}', "input_length"),
    ('{"session_id": "s", "input_length": 9, "output_length": 2, "wait_for": ["nope"]}', "unknown request"),
])
def test_reader_errors_name_the_line(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceError, match=match):
        read_mooncake_trace(path)


def test_dependency_cycles_and_dangling_references_are_refused() -> None:
    a = Session("a", "m", (Call(10, 1, None, waits_for=(CallRef("b", 0),)),), start_after=None)
    b = Session("b", "m", (Call(10, 1, None, waits_for=(CallRef("a", 0),)),))
    with pytest.raises(TraceError, match="cycle"):
        validate_sessions([a, b])
    with pytest.raises(TraceError, match="not in the trace"):
        validate_sessions([Session("c", "m", (Call(10, 1, None),), start_after=CallRef("zz", 0))])
    assert replicate([a, b], 2)[2].calls[0].waits_for == (CallRef("b@1", 0),)


class _Recorder:
    """A target whose every call takes one second and answers with fixed tokens."""

    def __init__(self) -> None:
        self.sent: dict[str, tuple[float, list[int]]] = {}

    async def call(self, request: CallRequest, tokens: SessionTokens) -> CallOutcome:
        loop = asyncio.get_running_loop()
        self.sent[request.call_id] = (loop.time(), list(request.prompt_token_ids))
        await asyncio.sleep(1.0)
        return CallOutcome(loop.time(), loop.time(), [7] * request.params.max_tokens)


def test_children_run_beside_their_parents_as_recorded() -> None:
    sessions = read_mooncake_trace(FIXTURE)
    target = _Recorder()
    results = run_virtual(drive(sessions, target, vocab_of=lambda m: 1000, block_size=64))
    sent = {k: v[0] for k, v in target.sent.items()}
    prompt = {k: v[1] for k, v in target.sent.items()}
    assert sent[f"{MAIN}#0"] == 0.0 and sent[f"{OTHER}#0"] == pytest.approx(0.3)
    assert sent[f"{CHILD}#0"] == pytest.approx(1.1)  # main#0 ends at 1.0, then 100 ms
    assert sent[f"{MAIN}#1"] == pytest.approx(1.2)  # beside the child, not after it
    assert sent[f"{CHILD}#1"] == pytest.approx(2.2)
    assert sent[f"{MAIN}#2"] == pytest.approx(3.3)  # joins: after child#1 ends (3.2), then 100 ms
    assert sent[f"{MAIN}#3"] == pytest.approx(4.33)
    assert prompt[f"{CHILD}#0"][:64] == prompt[f"{MAIN}#0"][:64]  # the block it shares
    assert prompt[f"{CHILD}#0"][64] != prompt[f"{MAIN}#0"][64]
    assert prompt[f"{MAIN}#1"][:150] == prompt[f"{MAIN}#0"] + [7] * 20  # extends prompt + output
    assert prompt[f"{MAIN}#3"][:128] == prompt[f"{MAIN}#2"][:128] and prompt[f"{MAIN}#3"][128] != prompt[f"{MAIN}#2"][128]
    by_id = {r.session_id: r for r in results}
    assert by_id[CHILD].arrival_s == pytest.approx(1.1)


def test_a_mooncake_trace_replays_on_the_simulated_cluster() -> None:
    spec = ClusterSpec(models=("glm-4.5-air",), block_size=64)
    sessions = assign_models(read_mooncake_trace(FIXTURE), list(spec.models))
    result = run_sim(sessions, SYSTEMS["talaria"], spec)
    assert result.failed_calls == 0 and sum(len(s.calls) for s in result.sessions) == 8
    child = next(s for s in result.sessions if s.session_id == CHILD)
    main = next(s for s in result.sessions if s.session_id == MAIN)
    assert child.calls[0].sent_s >= main.calls[0].done_s + 0.1 - 1e-9
    assert main.calls[2].sent_s >= child.calls[1].done_s + 0.1 - 1e-9
