"""A session the router lets go is forgotten by its instances under every key they know it
by; a call whose first token is late frees its instance's load whenever its client leaves."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from router_fakes import FakeInstance

from router.core import NoHealthyInstance, RouterCore
from router.instances.deadlines import Deadlines
from router.sessions.table import SessionTable
from talaria.protocol import CallEvent, CallRequest, InstanceState, SamplingParams


class Forgetting(FakeInstance):
    def __init__(self, *a, **k) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **k)
        self.forgotten: list[str] = []

    def forget_sessions(self, ids) -> None:  # type: ignore[no-untyped-def]
        self.forgotten.extend(ids)


def _call(i: int, session: str, prompt: list[int]) -> CallRequest:
    return CallRequest(call_id=f"c{i}", session_id=session, model="m", prompt_token_ids=prompt,
                       params=SamplingParams(max_tokens=3))


async def _run(core: RouterCore, call: CallRequest) -> None:
    async for _ in core.submit(call):
        pass


async def test_every_branch_key_is_forgotten_where_it_last_ran() -> None:
    """A side call's branch (``s#1``) holds a reservation on its instance as the main loop's
    does; both go when the session leaves, each told to the instance it last ran on."""
    a, b = Forgetting("a", [7, 8, 9]), Forgetting("b", [7, 8, 9])
    now = [0.0]
    core = RouterCore({"a": a, "b": b}, "load", sessions=SessionTable(ttl_s=10.0),
                      clock=lambda: now[0], refresh_after_call=False)
    main, side = list(range(100, 164)), list(range(500, 564))
    for i, prompt in enumerate((main, side, main + [7, 8, 9] + list(range(200, 216)),
                                side + [7, 8, 9] + list(range(300, 316)))):
        await _run(core, _call(i, "s", prompt))
    ran = {c.session_id: inst.instance_id for inst in (a, b) for c in inst.calls}
    assert set(ran) == {"s", "s#1"}
    now[0] = 100.0
    assert core.cleanup_sessions() == 1
    told = {key: inst.instance_id for inst in (a, b) for key in inst.forgotten}
    assert told == ran


async def test_a_session_id_ending_like_a_branch_is_forgotten_under_its_key() -> None:
    inst = Forgetting("i0", [7, 8, 9])
    now = [0.0]
    core = RouterCore({"i0": inst}, "load", sessions=SessionTable(ttl_s=10.0),
                      clock=lambda: now[0], refresh_after_call=False)
    await _run(core, _call(1, "task#3", list(range(100, 164))))
    key = inst.calls[0].session_id
    assert key == "task#3#0"
    now[0] = 100.0
    assert core.cleanup_sessions() == 1
    assert inst.forgotten == [key]


class Hung:
    """Sends nothing for a call, and its aborts hang too (a stopped process)."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        await asyncio.sleep(3600)
        yield CallEvent(call_id=call.call_id)

    async def abort(self, call_id: str, answered: bool = False) -> None:
        await asyncio.sleep(3600)

    async def state(self) -> InstanceState:
        return InstanceState(instance_id=self.instance_id)


@pytest.mark.parametrize("leave_after_s", [0.15, None], ids=["client-leaves", "client-waits"])
async def test_a_late_first_token_frees_the_instance_whenever_the_client_leaves(
    leave_after_s: float | None,
) -> None:
    """The abort of the late call runs beside the retry (it may hang as long as its
    instance does), so the call fails over at once and its load is released even when its
    client leaves while that abort is still waiting."""
    core = RouterCore({"i0": Hung("i0")}, "load", refresh_after_call=False,
                      deadlines=Deadlines(first_token_s=0.1, stall_s=1.0, state_s=2.0))
    call = CallRequest(call_id="c1", session_id="s", model="m",
                       prompt_token_ids=list(range(100)), params=SamplingParams(max_tokens=10))
    events = core.submit(call)
    start = time.monotonic()
    consumer = asyncio.ensure_future(anext(events))
    if leave_after_s is not None:
        await asyncio.sleep(leave_after_s)  # the deadline has passed; the abort hangs
        consumer.cancel()
    outcome = (await asyncio.gather(consumer, return_exceptions=True))[0]
    waited = time.monotonic() - start
    await events.aclose()
    await core.close()
    if leave_after_s is None:
        assert isinstance(outcome, NoHealthyInstance) and waited < 1.0  # not the abort's 2 s
    assert core.context.outstanding_tokens.get("i0", 0) == 0
    assert core.context.outstanding_prefill.get("i0", 0) == 0


class SlowAbort(FakeInstance):
    """Holds its call after the first token; its abort hangs (and says when it began)."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(instance_id, [7, 8, 9], hold=asyncio.Event())
        self.abort_started = asyncio.Event()
        self.closed = False

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        try:
            async for event in super().submit(call):
                yield event
        finally:
            self.closed = True

    async def abort(self, call_id: str, answered: bool = False) -> None:
        self.abort_started.set()
        await asyncio.sleep(3600)


async def test_a_call_cancelled_again_while_it_aborts_still_ends_in_its_session() -> None:
    """Cancelled once (its client left: the call aborts on its instance), then again while
    that abort waits (a shut-down cancelling what is left): the call still ends in its
    session's books, so the session can expire, and its stream is still closed."""
    inst = SlowAbort("i0")
    now = [0.0]
    core = RouterCore({"i0": inst}, "load", sessions=SessionTable(ttl_s=10.0),
                      clock=lambda: now[0], refresh_after_call=False)
    events = core.submit(_call(1, "s", list(range(100, 164))))
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in events:
            first.set()

    task = asyncio.ensure_future(consume())
    await first.wait()
    task.cancel()
    await inst.abort_started.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    record = core.sessions.get("s")
    assert record is not None and record.active_calls == 0
    assert inst.closed
    now[0] = 100.0
    assert core.cleanup_sessions() == 1
    await core.close()
