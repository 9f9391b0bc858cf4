"""Builders shared by the instance tests (virtual clock + FakeEngine)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fake_engine import FakeEngine

from engine.sampling_params import SamplingParams
from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig
from talaria.protocol import CallEvent, CallRequest


def call(
    call_id: str,
    session: str,
    model: str,
    prompt_len: int,
    max_tokens: int = 5,
    gap: float | None = None,
    last: bool = False,
) -> CallRequest:
    return CallRequest(
        call_id=call_id,
        session_id=session,
        model=model,
        prompt_token_ids=[(i * 7) % 500 for i in range(prompt_len)],
        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        expected_gap_s=gap,
        last_call=last,
    )


@dataclass
class Timed:
    """When a call was sent, got its first event and finished (loop time), and its events."""

    sent: float
    first: float | None = None
    done: float | None = None
    events: list[CallEvent] = field(default_factory=list)

    @property
    def last(self) -> CallEvent:
        return self.events[-1]


async def run_call(inst: Instance, req: CallRequest) -> Timed:
    loop = asyncio.get_running_loop()
    timed = Timed(sent=loop.time())
    async for event in inst.submit(req):
        if timed.first is None:
            timed.first = loop.time()
        timed.events.append(event)
    timed.done = loop.time()
    return timed


async def run_session(
    inst: Instance,
    session: str,
    model: str,
    calls: int,
    *,
    prompt_len: int = 100,
    growth: int = 20,
    max_tokens: int = 5,
    gap: float = 0.1,
    hint: bool = True,
    start_after: float = 0.0,
) -> list[Timed]:
    """A session of ``calls`` calls whose prompt grows by the last output plus ``growth``."""
    await asyncio.sleep(start_after)
    out: list[Timed] = []
    length = prompt_len
    for i in range(calls):
        last = i == calls - 1
        req = call(
            f"{session}-{i}",
            session,
            model,
            length,
            max_tokens,
            gap=gap if hint else None,
            last=last,
        )
        timed = await run_call(inst, req)
        out.append(timed)
        length += max_tokens + growth
        if not last:
            await asyncio.sleep(gap)
    return out


def index(log: list[tuple[str, str]], entry: tuple[str, str]) -> int:
    return log.index(entry)


def late_continuation(policy: PolicyConfig, engine: FakeEngine | None = None):  # type: ignore[no-untyped-def]
    """s1 decodes 5 s on model a; s2's short call ends at 2.5 and its continuation comes at
    3.0 while s1 still runs and a call of b waits. Returns ((s1, s2, b1), instance)."""
    engine = engine or FakeEngine(["a", "b"], step_s=0.1, switch_host_s=2.0)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, policy)
        await inst.start()
        long = asyncio.ensure_future(run_call(inst, call("s1-0", "s1", "a", 100, 50)))
        s2 = asyncio.ensure_future(run_session(inst, "s2", "a", 2, gap=0.5))
        b1 = asyncio.ensure_future(run_call(inst, call("b1", "sb", "b", 100, 5)))
        out = await long, await s2, await b1
        await inst.stop()
        return out, inst

    return run_virtual(main())
