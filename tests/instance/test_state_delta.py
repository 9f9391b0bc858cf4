"""The state report as deltas: a poller's copy fed deltas (some answers lost, removals let go,
the instance restarted) always ends up holding what the instance's report holds, and a poll
carries only what changed; sessions the router let go are forgotten by the instance, so its
table (and its report) is bounded by the router's."""

from __future__ import annotations

import random

import orjson
import pytest
from aiohttp.test_utils import TestServer
from fake_engine import FakeEngine
from instance_helpers import call

from router.core import RouterCore
from router.instances.http import HttpInstanceClient
from router.sessions.table import SessionTable
from talaria.instance.instance import Instance
from talaria.instance.session_report import SessionReport
from talaria.policies.config import PolicyConfig
from talaria.protocol import InstanceState, SessionKV
from talaria.protocol.state_delta import SessionsCursor, encode_report
from talaria.serving.instance_server import InstanceServerSettings, create_instance_app


def poll(report: SessionReport, cursor: SessionsCursor, lost: bool = False) -> dict:
    """One poll over the wire format; the answer as sent (not applied when ``lost``)."""
    report.sync()
    state = InstanceState("i", sessions=dict(report.entries))
    answer = orjson.loads(encode_report(state, report.since(cursor.epoch, cursor.version)))
    if not lost:
        cursor.apply(answer)
    return answer


@pytest.mark.parametrize("seed", range(4))
def test_a_cursor_fed_deltas_holds_what_the_report_holds(seed: int) -> None:
    rng = random.Random(seed)
    truth: dict[str, SessionKV] = {}
    report = SessionReport(truth.get, max_removed=8)
    cursor = SessionsCursor()
    changes = 0
    for _step in range(600):
        sid = f"s{rng.randrange(60)}"
        if rng.random() < 0.3:
            truth.pop(sid, None)
        else:
            truth[sid] = SessionKV(sid, "m", device_tokens=rng.randrange(4) * 16)
        report.touch(sid)
        changes += 1
        if rng.random() < 0.2:
            lost = rng.random() < 0.2
            answer = poll(report, cursor, lost)
            if not answer["sessions_full"]:
                assert len(answer["sessions"]) + len(answer["sessions_removed"]) <= changes
            if not lost:
                changes = 0
                assert cursor.sessions == report.entries == truth
    poll(report, cursor)
    assert cursor.sessions == truth
    restarted = SessionReport(truth.get)  # a new instance process: another epoch
    for sid in list(truth)[:3]:
        restarted.touch(sid)
    assert poll(restarted, cursor)["sessions_full"]
    assert cursor.sessions == {sid: truth[sid] for sid in list(truth)[:3]}


def test_a_poll_carries_only_what_changed() -> None:
    truth = {f"s{i}": SessionKV(f"s{i}", "m", device_tokens=16) for i in range(1000)}
    report = SessionReport(truth.get)
    for sid in truth:
        report.touch(sid)
    cursor = SessionsCursor()
    assert len(poll(report, cursor)["sessions"]) == 1000  # the first poll: the whole table
    truth["s5"] = SessionKV("s5", "m", device_tokens=32)
    del truth["s7"]
    report.touch("s5")
    report.touch("s7")
    report.touch("s9")  # touched, unchanged
    answer = poll(report, cursor)
    assert not answer["sessions_full"]
    assert list(answer["sessions"]) == ["s5"] and answer["sessions_removed"] == ["s7"]
    assert cursor.sessions == truth
    assert poll(report, cursor)["sessions"] == {}  # nothing changed since


async def test_the_instance_forgets_the_sessions_the_router_let_go() -> None:
    """A router that holds two sessions, over an instance that would keep ten thousand: after
    six sessions the instance holds (and reports) the router's two, their reservations
    included, and the rest were released there."""
    engine = FakeEngine(["m"], num_blocks=256, step_s=0.005)
    instance = Instance("i", engine, PolicyConfig(reservation_ttl_s=600.0, default_gap_s=1.0))
    server = TestServer(create_instance_app(instance, InstanceServerSettings()))
    await server.start_server()
    client = HttpInstanceClient("i", str(server.make_url("/")))
    core = RouterCore({"i": client}, "load", sessions=SessionTable(max_sessions=2),
                      refresh_after_call=False)
    try:
        for n in range(6):
            events = [e async for e in core.submit(call(f"c{n}", f"s{n}", "m", 40))]
            assert events[-1].finished and events[-1].error is None
            await core.refresh("i")
        await core.refresh("i")  # the last forget is sent; the loop drops it
        for _ in range(50):
            if len(instance.sessions.gaps.sessions) <= 2:
                break
            await core.refresh("i")
        held = {"s4", "s5"}
        assert {r.session_id for r in core.sessions._sessions.values()} == held
        assert set(instance.sessions.gaps.sessions) == held
        assert {r.session_id for r in instance.sessions.reservations.all()} == held
        assert set(core.states["i"].sessions) == held  # the router's copy, by deltas
        assert instance.counters["sessions_dropped"] == 4
        assert [n for n in range(6) if engine.pinned(f"s{n}")] == [4, 5]  # the rest unpinned
    finally:
        await core.close()
        await client.close()
        await server.close()


def test_the_state_report_bench_measures_each_kind_of_report() -> None:
    from talaria.bench.state_report import bench_state_report

    rows = bench_state_report(sizes=(200,), changed=4, repeats=1)
    assert [(r.kind, r.changed) for r in rows] == [("full", 200), ("first", 200), ("delta", 4)]
    full, first, delta = rows
    assert delta.bytes * 10 < first.bytes and abs(first.bytes - full.bytes) < 200
    assert all(r.parse_ms > 0 and r.instance_ms > 0 for r in rows)


def test_a_whole_report_reads_back_as_the_state_it_encodes() -> None:
    from talaria.protocol import ModelState, Residency, to_json

    sessions = {"s": SessionKV("s", "m", 16, 32, 5.5, None), "t": SessionKV("t", "n", 0, 48)}
    state = InstanceState("i", now=3.25, active_model="m", sessions=sessions, free_kv_blocks=7,
                          models={"m": ModelState("m", Residency.ACTIVE, kv_capacity_tokens=2048),
                                  "n": ModelState("n", Residency.STAGED, wait_s=1.5)})
    report = SessionReport(sessions.get)
    for sid in sessions:
        report.touch(sid)
    report.sync()
    encoded = orjson.loads(encode_report(state, report.since(None, None)))
    assert InstanceState.from_dict(encoded) == state
    assert {k: v for k, v in encoded.items() if not k.startswith("sessions_")} == orjson.loads(to_json(state))
