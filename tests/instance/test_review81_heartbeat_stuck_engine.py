"""Review 81: a heartbeat must not keep alive a call that an engine making no progress at
all holds. The router's stall deadline (``Deadlines.stall_s``) is the backstop for a call its
engine never resumes; heartbeats were meant for a call the engine preempted while it serves
the calls holding its blocks (``talaria.instance.heartbeats``). Here the engine runs nothing
at all (every step ``num_steps`` 0, no event) once the only call has 3 tokens: before the
heartbeats the router cut the call at its stall deadline; with them the call is kept forever
(the client's stream gets keep-alives forever too)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fake_engine import FakeEngine
from instance_helpers import call

from engine.interface import StepResult
from router.core import RouterCore
from router.instances.deadlines import Deadlines
from router.instances.inprocess import InProcessClient
from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig
from talaria.protocol import CallEvent


@dataclass
class StuckEngine(FakeEngine):
    """Once request ``stuck`` has 3 tokens, no step runs anything, ever (a wedged scheduler:
    the request waits for blocks that never free), while the engine answers every call."""

    stuck: str = "c0"

    def step(self) -> StepResult:
        req = self._reqs.get(self.stuck)
        if req is not None and req.out == 3:
            return StepResult([], 0.0, num_steps=0)
        return super().step()


def _through_router(heartbeat_s: float) -> list[CallEvent] | None:
    """The stuck call's events through the router (stall deadline 12 s), or None when it has
    not ended after 10 minutes (virtual)."""
    engine = StuckEngine(["m"], num_blocks=400, step_s=0.1)

    async def main() -> list[CallEvent] | None:
        inst = Instance("i", engine, PolicyConfig(call_heartbeat_s=heartbeat_s))
        await inst.start()
        core = RouterCore({"i": InProcessClient("i", inst)}, "load", refresh_after_call=False,
                          deadlines=Deadlines(first_token_s=300.0, stall_s=12.0))
        events: list[CallEvent] = []

        async def run() -> None:
            async for e in core.submit(call("c0", "s0", "m", 40, max_tokens=8)):
                events.append(e)

        try:
            await asyncio.wait_for(run(), 600.0)
            result: list[CallEvent] | None = events
        except TimeoutError:
            result = None
        await core.close()
        await inst.stop(drain=False)
        return result

    return run_virtual(main())


def test_without_heartbeats_the_router_cuts_the_stuck_call() -> None:
    events = _through_router(heartbeat_s=0.0)
    assert events is not None and events[-1].finish_reason == "error"


def test_heartbeats_do_not_keep_a_call_the_engine_never_resumes() -> None:
    events = _through_router(heartbeat_s=5.0)
    assert events is not None, "the stuck call was kept alive by heartbeats for 10 minutes"
    assert events[-1].finish_reason == "error"
