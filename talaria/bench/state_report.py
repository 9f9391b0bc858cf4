"""The state report's cost per instance and per poll, at 1k and 10k sessions.

Before this report was kept as deltas, every poll carried the instance's whole session
table and the router parsed all of it (``GET /internal/v1/state``, ``InstanceState.from_dict``:
what ``full`` measures). Now the first poll carries the whole table (``first``, through the
poller's ``SessionsCursor``) and each later one what changed since (``delta``: ``changed``
sessions ended a call, one session was dropped). Each row: the bytes sent and the best of
``repeats`` timings of the router's parse (decode, check, merge) and of the instance's side
(recompute the changed entries, pick the delta, encode it). Sessions are shaped as an agent
trace makes them: uuid ids, device and host token counts, a reservation on two in three.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from talaria.instance.session_report import SessionReport
from talaria.protocol import InstanceState, ModelState, Residency, SessionKV, to_json
from talaria.protocol.state_delta import SessionsCursor, encode_report

__all__ = ["ReportCost", "bench_state_report"]

MODELS = ("qwen3-235b-a22b", "glm-4.5-air", "mistral-large-2407")


@dataclass
class ReportCost:
    sessions: int
    kind: str  # "full" (every poll before), "first" (the first poll now), "delta"
    changed: int  # sessions in the report (all, or the changed ones)
    bytes: int
    parse_ms: float  # the router's side
    instance_ms: float  # the instance's side


def _session(i: int, version: int = 0) -> SessionKV:
    sid = f"agent-{uuid.UUID(int=i)}"
    reserved = i % 3 != 0
    return SessionKV(sid, MODELS[i % len(MODELS)], device_tokens=16 * ((i + version) % 5000),
                     host_tokens=16 * ((i * 7 + version) % 5000),
                     reserved_until=1000.5 + i + version if reserved else None,
                     expected_return=990.25 + i + version if reserved else None)


def _best(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _whole_tables(
    n: int, state: InstanceState, report: SessionReport, repeats: int
) -> list[ReportCost]:
    """The whole table as every poll sent it before (``InstanceState`` JSON) and as the first
    poll sends it now (through the poller's cursor)."""
    full = to_json(state)
    first = encode_report(state, report.since(None, None))
    return [
        ReportCost(n, "full", n, len(full),
                   _best(lambda: InstanceState.from_dict(orjson.loads(full)), repeats),
                   _best(lambda: to_json(state), repeats)),
        ReportCost(n, "first", n, len(first),
                   _best(lambda: SessionsCursor().apply(orjson.loads(first)), repeats),
                   _best(lambda: encode_report(state, report.since(None, None)), repeats)),
    ]


def _deltas(
    truth: dict[str, SessionKV], report: SessionReport, state: InstanceState,
    changed: int, repeats: int,
) -> ReportCost:
    """Polls after ``changed`` sessions changed each: ``changed - 1`` ended a call (their KV
    grew, their reservation was renewed) and one was dropped."""
    ids = list(truth)  # ids[i] is session i's
    n = len(ids)
    cursor = SessionsCursor()
    cursor.apply(orjson.loads(encode_report(state, report.since(None, None))))
    instance_ms, parse_ms, size = float("inf"), float("inf"), 0
    for round_ in range(repeats):
        for j in range(changed):
            i = (round_ * changed + j) % n
            if j < changed - 1:
                truth[ids[i]] = _session(i, round_ + 1)
            else:
                truth.pop(ids[i], None)
            report.touch(ids[i])
        start = time.perf_counter()
        report.sync()
        delta = encode_report(state, report.since(cursor.epoch, cursor.version))
        instance_ms = min(instance_ms, (time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        cursor.apply(orjson.loads(delta))
        parse_ms = min(parse_ms, (time.perf_counter() - start) * 1e3)
        size = len(delta)
    if cursor.sessions != truth:
        raise AssertionError("the poller's copy differs from the instance's sessions")
    return ReportCost(n, "delta", changed, size, parse_ms, instance_ms)


def bench_state_report(
    sizes: tuple[int, ...] = (1000, 10_000), changed: int = 16, repeats: int = 5
) -> list[ReportCost]:
    if changed < 2 or repeats < 1:
        raise ValueError("need changed >= 2 and repeats >= 1")
    rows: list[ReportCost] = []
    for n in sizes:
        truth = {s.session_id: s for s in map(_session, range(n))}
        report = SessionReport(truth.get)
        for sid in truth:
            report.touch(sid)
        report.sync()
        models = {m: ModelState(m, Residency.ACTIVE if i == 0 else Residency.HOST)
                  for i, m in enumerate(MODELS)}
        state = InstanceState("bench", models=models, sessions=dict(report.entries))
        rows += _whole_tables(n, state, report, repeats)
        rows.append(_deltas(truth, report, state, changed, repeats))
    return rows
