"""A seeded random fault schedule at the router level, under the virtual clock (seconds of
wall time for minutes of faults): three in-process instances are killed and restarted,
stopped and continued (SIGSTOP), slowed, and made to drop their streams, while agent
sessions send their calls, re-sending a call that ends in an error as an agent would. The
router runs as served: its health poller, its default deadlines and grace.

Every attempt ends (an answer or an error) within ``BOUND_S`` of being sent; every session
completes every call; the router's books hold each session with every attempt counted and
nothing left outstanding (no wait, no placement count, no call in flight)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest
from fault_fakes import FaultyInstance

from router.core import NoHealthyInstance, RouterCore
from router.instances.health import HealthPoller
from talaria.clock import run_virtual
from talaria.protocol import CallRequest, SamplingParams

INSTANCES = 3
SESSIONS = 12
CALLS = 10
RESEND_AFTER_S = 0.5
# An instance that hangs is found within a poll interval and the poll's 2 s deadline, and
# its calls are cut within the 1 s grace: 4 s; one attempt may meet two such instances, or a
# slowed one (6 events x 0.5 s). Faults last up to FAULT_S, longer than the bound: a call
# must not wait for its instance to come back.
BOUND_S = 10.0
FAULT_S = 20.0


@dataclass
class Agent:
    session: int
    done: int = 0
    attempts: int = 0
    longest_s: float = 0.0
    errors: list[str] = field(default_factory=list)


async def run_agent(core: RouterCore, agent: Agent, rng: random.Random) -> None:
    loop = asyncio.get_running_loop()
    sid = f"s{agent.session}"
    await asyncio.sleep(rng.uniform(0.0, 5.0))
    while agent.done < CALLS:
        agent.attempts += 1
        call = CallRequest(f"{sid}-c{agent.done}-a{agent.attempts}", sid, "m",
                           list(range(32 + 16 * agent.done)), SamplingParams(max_tokens=6))
        sent = loop.time()
        try:
            events = [e async for e in core.submit(call)]
            failed = events[-1].error if events[-1].finish_reason == "error" else None
        except NoHealthyInstance as exc:
            failed = str(exc)
        agent.longest_s = max(agent.longest_s, loop.time() - sent)
        if failed is None:
            agent.done += 1
            await asyncio.sleep(rng.uniform(0.2, 3.0))  # the tool runs
        else:
            agent.errors.append(failed)
            await asyncio.sleep(RESEND_AFTER_S)


async def fault(inst: FaultyInstance, rng: random.Random, faulty: set[str]) -> None:
    """One fault on ``inst``, lasting a random while; then it is restarted or continued."""
    faulty.add(inst.instance_id)
    kind = rng.choice(["kill", "stop", "slow", "drop"])
    if kind == "kill":
        inst.killed = True
    elif kind == "stop":
        inst.stopped = True
    elif kind == "slow":
        inst.slow_s = rng.uniform(0.05, 0.5)
    else:
        inst.drop_after = rng.randrange(0, 4)
    await asyncio.sleep(rng.uniform(0.5, FAULT_S))
    inst.killed = inst.stopped = False
    inst.slow_s, inst.drop_after = 0.0, None
    faulty.discard(inst.instance_id)


async def chaos(instances: list[FaultyInstance], rng: random.Random, until: asyncio.Event) -> int:
    """Faults starting every few seconds on an instance not already faulty (up to all of
    them at once); returns how many there were."""
    faulty: set[str] = set()
    running: list[asyncio.Task[None]] = []
    while not until.is_set():
        await asyncio.sleep(rng.uniform(0.5, 3.0))
        healthy = [i for i in instances if i.instance_id not in faulty]
        if healthy:
            running.append(asyncio.ensure_future(fault(rng.choice(healthy), rng, faulty)))
    await asyncio.gather(*running)
    return len(running)


async def scenario(seed: int) -> tuple[RouterCore, list[Agent], list[FaultyInstance], int]:
    rng = random.Random(seed)
    instances = [FaultyInstance(f"i{n}", tokens=6, step_s=0.01) for n in range(INSTANCES)]
    core = RouterCore({i.instance_id: i for i in instances}, "talaria")
    poller = HealthPoller(core, interval_s=1.0)
    polling = poller.context()
    await anext(polling)
    agents = [Agent(n) for n in range(SESSIONS)]
    done = asyncio.Event()
    faults = asyncio.ensure_future(chaos(instances, rng, done))
    await asyncio.gather(*(run_agent(core, a, random.Random(seed * 100 + a.session)) for a in agents))
    done.set()
    n_faults = await faults
    for _ in range(100):  # the last aborts and polls settle
        if core._polls.idle and core.aborts.idle:
            break
        await asyncio.sleep(0.5)
    await polling.aclose()
    await core.close()
    return core, agents, instances, n_faults


@pytest.mark.parametrize("seed", range(6))
def test_every_call_ends_within_the_bound_and_no_session_is_lost(seed: int) -> None:
    core, agents, instances, faults = run_virtual(scenario(seed))
    assert faults >= 8
    assert all(a.done == CALLS for a in agents)  # every session completed every call
    worst = max(a.longest_s for a in agents)
    assert worst <= BOUND_S, (worst, [a.errors for a in agents])
    for agent in agents:
        record = core.sessions.get(f"s{agent.session}")
        assert record is not None and record.active_calls == 0
        assert record.calls == agent.attempts  # every attempt was booked to its session
    assert all(core.waits.waiting(i.instance_id) == 0 for i in instances)
    assert not any(core.context.outstanding_tokens.values())
    assert not any(core.context.outstanding_prefill.values())
    outcomes = core.metrics.requests.values
    assert sum(outcomes.values()) == sum(a.attempts for a in agents)
