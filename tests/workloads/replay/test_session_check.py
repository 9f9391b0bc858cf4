"""Sessions inferred from prompts on the replay with ids withheld: the match measure on hand-
built cases, then a small generated trace on the simulated cluster (every session's first
prompt starting with one shared system prompt), inferred against sent."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from engine.models.tiny import build_tokenizer
from router.app import RouterConfig, create_app
from talaria.protocol import CallEvent, CallRequest, CallUsage, InstanceState
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import CallRecord, SessionResult, drive
from workloads.replay.live import LiveTarget
from workloads.replay.session_check import check_inference, format_check, session_match
from workloads.replay.systems import SYSTEMS
from workloads.traces.generator import generate_trace
from workloads.traces.trace import Call, Session


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


class _EchoInstance:
    """An in-process instance that answers every call with ``max_tokens`` tokens of id 5."""

    instance_id = "i0"

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        n = call.params.max_tokens
        yield CallEvent(call.call_id, [5] * n, finished=True, finish_reason="length",
                        usage=CallUsage(len(call.prompt_token_ids), n, 0))

    async def abort(self, call_id: str, answered: bool = False) -> None:
        return None

    async def state(self) -> InstanceState:
        return InstanceState("i0")


async def test_live_replay_without_ids_reads_the_inferred_sessions_back(tmp_path: Path) -> None:
    build_tokenizer(512).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    config = RouterConfig(models={"m": str(tmp_path)}, instances={"i0": "unused"}, poll_interval_s=None)
    server = TestServer(create_app(config, clients={"i0": _EchoInstance()}))
    await server.start_server()
    sessions = [Session(f"s{i}", "m", (Call(40, 3, 0.0), Call(60, 3, 0.0), Call(90, 2, None))) for i in range(3)]
    try:
        async with aiohttp.ClientSession() as http:
            results = await drive(sessions, LiveTarget(http, str(server.make_url("/v1"))), vocab_of=lambda m: 300,
                                  output_kv_reusable=False, send_session_ids=False)
    finally:
        await server.close()
    assert session_match(results).rate == 1.0
    names = {c.session_id or "" for r in results for c in r.calls}
    prefix = os.path.commonprefix(sorted(names))
    assert re.fullmatch(r"inferred-[0-9a-f]{8}-", prefix)  # this router process's names
    assert names == {f"{prefix}{n}" for n in range(3)}
