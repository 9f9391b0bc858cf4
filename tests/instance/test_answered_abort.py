"""A call ended because its caller had the answer it wanted (``abort(..., answered=True)``: a
stop string, a settled tool call) ends as a finished call: its session's KV stays remembered
and its books go on (a soft reservation for its return), where a plain abort drops both."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestServer
from fake_engine import FakeEngine
from instance_helpers import call

from router.instances.http import HttpInstanceClient
from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig, preset
from talaria.serving.instance_server import InstanceServerSettings, create_instance_app


def _end_mid_answer(answered: bool) -> tuple[list[str], str | None, int, bool]:
    """A call cut after a few of its tokens: (finish reasons seen, its last one, the session's
    KV tokens the engine keeps, whether the session holds a reservation)."""
    engine = FakeEngine(["a", "b"], num_blocks=40, step_s=0.1, switch_host_s=2.0)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("talaria"))
        await inst.start()
        handle = inst.submit(call("c0", "s0", "a", 64, max_tokens=200, gap=5.0))
        reasons = []
        async for event in handle:
            reasons.append(event.finish_reason)
            if len(reasons) == 4:
                assert inst.abort("c0", answered=answered)
        kept = engine.session_kv_tokens("s0")[0]  # (device, host)
        reserved = inst.sessions.reservations.get("s0") is not None
        await inst.stop()
        return reasons, reasons[-1], kept, reserved

    return run_virtual(main())


def test_an_answered_call_ends_as_finished_its_session_kept() -> None:
    reasons, last, kept, reserved = _end_mid_answer(answered=True)
    assert last == "stop" and len(reasons) < 200
    assert kept >= 64  # the prompt and the tokens computed stay the session's
    assert reserved  # the session returns in ~5 s: its KV is held for it


def test_a_plain_abort_still_drops_the_session() -> None:
    _, last, kept, reserved = _end_mid_answer(answered=False)
    assert last == "abort"
    assert kept == 0 and not reserved


def test_answered_means_nothing_for_a_queued_call() -> None:
    engine = FakeEngine(["a"], num_blocks=40, step_s=0.1)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("baseline", max_running_calls=1))
        await inst.start()
        first = inst.submit(call("c0", "s0", "a", 50, max_tokens=50))
        queued = inst.submit(call("c1", "s1", "a", 50))
        await asyncio.sleep(0.5)
        assert inst.abort("c1", answered=True)
        events = await queued.collect()
        await first.collect()
        await inst.stop()
        return events

    events = run_virtual(main())
    assert [e.finish_reason for e in events] == ["abort"]
    assert ("add", "c1") not in engine.log


async def test_answered_crosses_the_instance_http_api() -> None:
    """The router's HTTP client says ``answered`` and the instance server hears it; a plain
    abort stays one."""
    engine = FakeEngine(["m"], num_blocks=256, step_s=0.01)
    instance = Instance("i", engine, PolicyConfig(reservation_ttl_s=600.0, default_gap_s=30.0))
    server = TestServer(create_instance_app(instance, InstanceServerSettings()))
    await server.start_server()
    client = HttpInstanceClient("i", str(server.make_url("/")))
    try:
        ends = {}
        for session, answered in (("kept", True), ("dropped", False)):
            handle = instance.submit(call(f"c-{session}", session, "m", 40, max_tokens=500))
            async for event in handle:
                if not event.finished and event.token_ids:
                    await client.abort(f"c-{session}", answered=answered)
                ends[session] = event.finish_reason
        assert ends == {"kept": "stop", "dropped": "abort"}
        assert {r.session_id for r in instance.sessions.reservations.all()} == {"kept"}
        assert engine.session_kv_tokens("kept")[0] > 40 and engine.session_kv_tokens("dropped")[0] == 0
    finally:
        await client.close()
        await instance.stop(drain=False)
        await server.close()
