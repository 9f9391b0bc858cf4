"""The ideal bound: what the server could do with every model resident at once, switches and
KV movement free, its compute time-shared step by step between models (steps of different
models never overlap) and perfect batching within a model.

Every session gets its own simulated engine, its model active from the start and a KV region
larger than the session ever needs (nothing is evicted, switched or restored), so each of its
calls runs as it would alone whenever its model has the GPUs; the engines of one server
share a ``SharedDevice`` that time-shares the GPUs between models. Which model's steps go
next is the schedule's choice (``DeviceSchedule``), and none is best for every percentile:
taking turns step by step favours no one, while serving one model for a while (a slot
schedule with free switches) or the least- or most-served sessions first shortens some
sessions at others' expense, as the systems compared do. So the bound runs a family of
schedules (``IDEAL_SCHEDULES``) and takes, for each percentile, the best of them; the tuner
(``workloads.benchmark.tuning``) searches the family once and the benchmark re-runs only the members
that bound p50 and p95. Its batching is more than a step of the simulator's engine gives (a
model's engines run side by side, so a batch costs what its longest member's step costs
alone), so it may read below the lower bound where that counts each decode step's tokens
(``workloads.bounds.decode_steps``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from engine.sim.engine import SimEngine, SimEngineConfig
from talaria.clock import run_virtual
from talaria.instance.executor import EngineExecutor
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig
from workloads.benchmark.breakdown import attach_splits
from workloads.bounds.isolated import InstanceTarget
from workloads.bounds.shared_device import DeviceSchedule, SharedDevice
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import AGENT_MAX_TOKENS, ReplayResult, drive, model_limits
from workloads.replay.systems import ROUND_QUANTA
from workloads.traces.trace import Session

__all__ = ["IDEAL_NAME", "ideal_schedules", "run_ideal"]

IDEAL_NAME = "ideal"
_PLAIN = PolicyConfig(name=IDEAL_NAME, session_prefill=False, soft_reservations=False,
                      host_kv=False, d2d_staging=False, session_priority=False,
                      priority_switch=False, kv_demotion=False, lend_staging=False)


def ideal_schedules(quanta: Sequence[float] = ROUND_QUANTA) -> list[DeviceSchedule]:
    """The family: step-level orders, and slot schedules at ``quanta`` (each closing rule,
    preemptive or letting calls in flight finish)."""
    out = [DeviceSchedule(order) for order in ("fair", "las", "mas")]
    out += [DeviceSchedule("slots", close, q, preempt)
            for q in quanta for close in ("drained", "quantum") for preempt in (True, False)]
    return out


def _server_of(session_id: str) -> int:
    """Copy r of a replicated trace (``workloads.replay.driver.replicate``) runs on server r."""
    _, _, copy = session_id.rpartition("@")
    return int(copy) if copy.isdigit() else 0


def run_ideal(
    sessions: Sequence[Session], spec: ClusterSpec | None = None,
    schedule: DeviceSchedule | None = None, *, seed: int = 0, progress: bool = False,
) -> ReplayResult:
    """Replay ``sessions`` on the ideal machine under ``schedule`` (default: turns)."""
    spec = spec or ClusterSpec()
    schedule = schedule or DeviceSchedule()
    vocab, context = model_limits(spec.models)
    wall = time.perf_counter()

    answers: dict[str, int] = {}

    async def main() -> list:
        loop = asyncio.get_running_loop()
        devices: dict[int, SharedDevice] = {}
        instances: dict[str, Instance] = {}
        for s in sessions:
            device = devices.setdefault(
                _server_of(s.session_id), SharedDevice(spec.models, schedule, loop.time))
            # room for every call's prompt and all the answer it may ask for (the engine
            # refuses a call that could outgrow its KV cache)
            need = max(min(context[s.model], c.input_tokens + AGENT_MAX_TOKENS)
                       for c in s.calls) + 2 * spec.block_size
            config = SimEngineConfig(
                server=spec.server, tp=spec.tp, block_size=spec.block_size, staging=False,
                host_kv_bytes=0, max_fused_decode_steps=spec.max_fused_decode_steps,
                cut_fused_steps=spec.cut_fused_steps,
                kv_tokens=need,
            )
            engine = SimEngine([s.model], config, clock=loop.time, answer_lengths=answers)
            engine.activate(s.model)  # resident from the start
            inst = Instance(f"ideal-{s.session_id}", engine, _PLAIN,
                            executor=EngineExecutor(engine, device=device), record_splits=True)
            await inst.start()
            instances[s.session_id] = inst
        try:
            results = await drive(
                sessions, InstanceTarget(instances), seed=seed, vocab_of=vocab.__getitem__,
                context_of=context.__getitem__, block_size=spec.block_size, progress=progress,
                desc=IDEAL_NAME, answers=answers, prompt_chains=True,
            )
            splits = {k: v for inst in instances.values() for k, v in inst.loop.split.done.items()}
            engines = {inst.instance_id: inst.engine for inst in instances.values()}
            attach_splits(results, splits, engines)  # type: ignore[arg-type]
            return results
        finally:
            for inst in instances.values():
                await inst.stop(drain=False)

    results = run_virtual(main())
    return ReplayResult(f"{IDEAL_NAME}/{schedule.name}", results, None, time.perf_counter() - wall)
