"""A refused call restores the let-go it withdrew only when no other call of its session came
to that instance meanwhile: one session's parallel calls (an agent's) on one instance, one
accepted and one refused (a full queue), leave the session current there. Before, the refused
one put back the release (or forget) it had withdrawn while its sibling ran, and the next
poll released the reservation (or forgot the KV) the sibling had just left."""

from __future__ import annotations

import asyncio

import pytest

from router.instances.inprocess import InProcessClient
from router.instances.let_go import PendingLetGo
from talaria.protocol import CallEvent, CallRequest, InstanceState, SamplingParams
from talaria.protocol.errors import overloaded


def _call(call_id: str, session: str = "s") -> CallRequest:
    return CallRequest(call_id=call_id, session_id=session, model="m",
                       prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=1))


class Target:
    """Refuses call ``refused`` once ``gate`` opens (it waited in a full queue); runs the
    others at once. Records what polls carry."""

    def __init__(self, refused: str) -> None:
        self.refused = refused
        self.gate = asyncio.Event()
        self.asked: list[str] = []

    async def stream(self, call: CallRequest):  # type: ignore[no-untyped-def]
        if call.call_id == self.refused:
            await self.gate.wait()
            raise overloaded("queue full", 1.0)
        yield CallEvent(call_id=call.call_id, token_ids=[5], finished=True, finish_reason="length")

    def abort(self, call_id: str) -> None:
        pass

    def release_reservations(self, ids: list[str]) -> None:
        self.asked.append("release " + ",".join(ids))

    def forget_sessions(self, ids: list[str]) -> None:
        self.asked.append("forget " + ",".join(ids))

    def state(self) -> InstanceState:
        return InstanceState(instance_id="i0")


async def _drain(client: InProcessClient, call: CallRequest) -> list[CallEvent]:
    return [e async for e in client.submit(call)]


@pytest.mark.parametrize("let_go", ["release", "forget"])
async def test_a_refused_call_restores_nothing_when_a_sibling_ran_meanwhile(let_go: str) -> None:
    target = Target(refused="refused")
    client = InProcessClient("i0", target)
    getattr(client, f"{let_go}_{'reservations' if let_go == 'release' else 'sessions'}")(["s"])
    refused = asyncio.ensure_future(_drain(client, _call("refused")))
    await asyncio.sleep(0)  # it withdrew the let-go and waits in the queue
    assert [e.finished for e in await _drain(client, _call("ran"))] == [True]  # ran: current here
    target.gate.set()
    with pytest.raises(Exception, match="queue full"):
        await refused
    await client.state()
    assert target.asked == []


async def test_a_refused_call_restores_nothing_while_a_sibling_runs() -> None:
    """The sibling came first and still streams when the refused call ends."""
    held = PendingLetGo(bound=10)
    sibling = held.withdraw("s")  # nothing pending then
    held.add_release(["s"])  # the router let it go meanwhile (another call moved it)
    refused = held.withdraw("s")
    held.settle("s", refused, ran=False)  # the sibling is still open: the session is current
    assert held.batch(10) == ([], [])
    held.settle("s", sibling, ran=True)
    assert held.batch(10) == ([], [])


def test_a_refused_call_alone_restores_and_nothing_is_left_behind() -> None:
    held = PendingLetGo(bound=10)
    held.add_forget(["s"])
    first = held.withdraw("s")
    held.settle("s", first, ran=False)
    assert held.batch(10) == (["s"], [])
    second = held.withdraw("s")
    held.settle("s", second, ran=True)
    assert held.batch(10) == ([], []) and not held.open_calls
