"""The in-process client (the simulated replay's) hands the router's forgets over as the
HTTP client does: at the next state poll, before the state is read."""

from __future__ import annotations

from router.instances.inprocess import InProcessClient
from talaria.protocol import CallRequest, InstanceState


class Target:
    """An instance object as the simulated replay holds it; records what it is asked, in order."""

    def __init__(self, forgets: bool) -> None:
        self.asked: list[str] = []
        if forgets:
            self.forget_sessions = lambda ids: self.asked.append("forget " + ",".join(ids))
            self.release_reservations = lambda ids: self.asked.append("release " + ",".join(ids))

    async def stream(self, call: CallRequest):  # type: ignore[no-untyped-def]
        yield None

    def abort(self, call_id: str, answered: bool = False) -> None:
        pass

    def state(self) -> InstanceState:
        self.asked.append("state")
        return InstanceState(instance_id="i0")


async def test_the_in_process_client_forgets_at_the_next_state_poll() -> None:
    target = Target(forgets=True)
    client = InProcessClient("i0", target)
    client.forget_sessions(["s1", "s2"])
    client.forget_sessions(["s1"])
    assert target.asked == []  # not before the poll, as over HTTP
    await client.state()
    await client.state()
    assert target.asked == ["forget s1,s2", "state", "state"]


async def test_a_target_that_cannot_forget_is_polled_as_before() -> None:
    target = Target(forgets=False)
    client = InProcessClient("i0", target)
    client.forget_sessions(["s1"])
    assert (await client.state()).instance_id == "i0"
    assert target.asked == ["state"]


async def test_releases_go_before_forgets_and_a_forget_covers_a_release() -> None:
    target = Target(forgets=True)
    client = InProcessClient("i0", target)
    client.release_reservations(["moved", "dropped"])
    client.forget_sessions(["dropped"])
    await client.state()
    assert target.asked == ["release moved", "forget dropped", "state"]
