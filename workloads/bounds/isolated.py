"""The isolated row: each session alone, its model resident, nothing to contend with.

A call's time is then its own prefill (of what the device prefix cache does not hold) plus its
decode, as the engine serves it (``workloads.bounds.call_work.alone_seconds``): ``run_isolated``
prices it in closed form, each session starting at its arrival with its calls back to back
but for its tool gaps. It is every call's "own" time in the time split, and the yardstick
of the isolated ratios; the proven bound is ``workloads.bounds.bound``.

``simulate_isolated`` replays the same through the simulator (every session on its own
simulated instance, its model active before it starts), for the test that holds the two
equal; it takes seconds where the closed form takes milliseconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace

from engine.sim.cost_model import CostModel
from engine.sim.engine import SimEngine, SimEngineConfig
from substrate.devices import server_preset
from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import preset
from talaria.protocol import CallRequest
from workloads.bounds.call_work import (
    alone_seconds,
    call_shapes,
    prefill_seconds,
    replayed_lengths,
)
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import (
    AGENT_MAX_TOKENS,
    CallOutcome,
    CallRecord,
    ReplayResult,
    SessionResult,
    call_contexts,
    collect_outcome,
    drive,
    model_limits,
)
from workloads.replay.prompts import SessionTokens
from workloads.traces.trace import Session

__all__ = ["InstanceTarget", "LOWER_BOUND_NAME", "run_isolated", "simulate_isolated"]

LOWER_BOUND_NAME = "isolated"
_BATCH = 32  # sessions simulated at once (each has its own engine and KV pool)


class InstanceTarget:
    """Sends each session's calls straight to that session's own instance."""

    def __init__(self, instances: dict[str, Instance]) -> None:
        self.instances = instances

    async def call(self, request: CallRequest, tokens: SessionTokens) -> CallOutcome:
        inst = self.instances[request.session_id]
        request.step_events = False  # collect_outcome reads the first token and the finish
        return await collect_outcome(inst.stream(request), inst.instance_id)


def run_isolated(sessions: Sequence[Session], spec: ClusterSpec | None = None) -> ReplayResult:
    """Every session alone, in closed form: each call sent at the end of the previous one
    plus its tool gap, taking ``alone_seconds``."""
    spec = spec or ClusterSpec()
    wall = time.perf_counter()
    config = SimEngineConfig()
    budget = spec.max_num_batched_tokens or config.max_num_batched_tokens
    server = server_preset(spec.server)
    costs = {name: CostModel(server, model, spec.tp) for name, model in spec.catalog().items()}
    context = call_contexts(spec)
    lengths = replayed_lengths(sessions, AGENT_MAX_TOKENS, context)
    results = []
    for s in sessions:
        result = SessionResult(s.session_id, s.model, s.arrival_s)
        now = s.arrival_s
        shapes = call_shapes(s, spec.block_size, lengths, max_tokens=AGENT_MAX_TOKENS,
                             context=context[s.model])
        for k, (call, shape) in enumerate(zip(s.calls, shapes, strict=True)):
            if k > 0:
                now += s.calls[k - 1].tool_gap_s or 0.0
            prefill = prefill_seconds(costs[s.model], shape, budget)
            done = now + alone_seconds(costs[s.model], shape, budget)
            result.calls.append(CallRecord(
                index=k, sent_s=now, first_token_s=now + prefill, done_s=done,
                prompt_tokens=call.input_tokens, output_tokens=shape.output,
                reusable_tokens=shape.cached, cached_tokens=shape.cached,
                instance_id=f"alone-{s.session_id}", session_id=s.session_id))
            now = done
        results.append(result)
    return ReplayResult(LOWER_BOUND_NAME, results, None, time.perf_counter() - wall)


def simulate_isolated(
    sessions: Sequence[Session], spec: ClusterSpec | None = None, *, seed: int = 0,
    progress: bool = False,
) -> ReplayResult:
    """Replay every session alone on its own simulated instance with its model resident."""
    spec = spec or ClusterSpec()
    vocab, context = model_limits(spec.models)
    # The stable substrate without a staging region: the largest KV region an instance of
    # the catalog has while every model keeps the same addresses (no switch happens anyway).
    config = SimEngineConfig(
        server=spec.server, tp=spec.tp, block_size=spec.block_size, stable_substrate=True,
        staging=False, host_kv_bytes=0, max_fused_decode_steps=spec.max_fused_decode_steps,
        cut_fused_steps=spec.cut_fused_steps,
    )
    wall = time.perf_counter()
    results = []
    for start in range(0, len(sessions), _BATCH):
        batch = list(sessions[start : start + _BATCH])

        async def main(batch: list[Session] = batch) -> list:
            loop = asyncio.get_running_loop()
            instances: dict[str, Instance] = {}
            answers: dict[str, int] = {}
            for s in batch:
                engine = SimEngine(list(spec.models), config, clock=loop.time,
                                   answer_lengths=answers)
                engine.activate(s.model)
                inst = Instance(f"alone-{s.session_id}", engine, preset("baseline"))
                await inst.start()
                instances[s.session_id] = inst
            # Arrival times do not matter to a session alone: all start at once.
            alone = [_at_zero(s) for s in batch]
            try:
                return await drive(
                    alone, InstanceTarget(instances), seed=seed, vocab_of=vocab.__getitem__,
                    context_of=context.__getitem__, block_size=spec.block_size,
                    progress=progress, desc=LOWER_BOUND_NAME, answers=answers,
                    prompt_chains=True,
                )
            finally:
                for inst in instances.values():
                    await inst.stop(drain=False)

        results.extend(run_virtual(main()))
    by_id = {s.session_id: s.arrival_s for s in sessions}
    for r in results:
        r.arrival_s = by_id[r.session_id]
    return ReplayResult(LOWER_BOUND_NAME, results, None, time.perf_counter() - wall)


def _at_zero(session: Session) -> Session:
    return replace(session.alone(), arrival_s=0.0)
