"""The isolated lower bound: each session alone, its model resident, nothing to contend with.

Every session gets its own simulated instance (same server, TP and engine block size as the
benchmark cluster) whose engine has the session's model already active before the session
starts, so no call waits for a slot, a switch or another session: a call's time is its own
prefill (of what the device prefix cache does not hold) plus its decode. Instances run side by
side on one virtual loop (they share nothing but the clock), in batches to bound memory.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace

from engine.sim.engine import SimEngine, SimEngineConfig
from talaria.clock import run_virtual
from talaria.config import preset
from talaria.instance.admission import Instance
from talaria.protocol import CallRequest
from workloads.cluster import ClusterSpec
from workloads.replay import (
    CallOutcome,
    ReplayResult,
    SessionTokens,
    collect_outcome,
    drive,
    model_limits,
)
from workloads.trace import Session

__all__ = ["InstanceTarget", "run_lower_bound", "LOWER_BOUND_NAME"]

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


def run_lower_bound(
    sessions: Sequence[Session], spec: ClusterSpec | None = None, *, seed: int = 0,
    progress: bool = False,
) -> ReplayResult:
    """Replay every session alone on its own instance with its model resident."""
    spec = spec or ClusterSpec()
    vocab, context = model_limits(spec.models)
    # The stable substrate without a staging region: the largest KV region an instance of
    # the catalog has while every model keeps the same addresses (no switch happens anyway).
    config = SimEngineConfig(
        server=spec.server, tp=spec.tp, block_size=spec.block_size, stable_substrate=True,
        staging=False, host_kv_bytes=0, max_fused_decode_steps=spec.max_fused_decode_steps,
    )
    wall = time.perf_counter()
    results = []
    for start in range(0, len(sessions), _BATCH):
        batch = list(sessions[start : start + _BATCH])

        async def main(batch: list[Session] = batch) -> list:
            loop = asyncio.get_running_loop()
            instances: dict[str, Instance] = {}
            for s in batch:
                engine = SimEngine(list(spec.models), config, clock=loop.time)
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
                    progress=progress, desc=LOWER_BOUND_NAME,
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
