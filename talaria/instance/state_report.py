"""The instance's report to the router: residency, pressure, rates, sessions, blocks."""

from __future__ import annotations

from typing import Protocol

from engine.interface import EngineStats, Residency
from talaria.instance.calls import CallBook
from talaria.instance.estimates import Estimator
from talaria.instance.rates import RateBook
from talaria.instance.sessions import SessionKeeper
from talaria.policies.view import InstanceView
from talaria.protocol import InstanceState, ModelState

__all__ = ["ReportSource", "build_state"]


class ReportSource(InstanceView, Protocol):
    """What the report reads: the policies' view plus the instance's own books."""

    @property
    def instance_id(self) -> str: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def counters(self) -> dict[str, int]: ...

    @property
    def calls(self) -> CallBook: ...

    @property
    def sessions(self) -> SessionKeeper: ...

    @property
    def rates(self) -> RateBook: ...

    @property
    def est(self) -> Estimator: ...

    @property
    def kv_capacity_tokens(self) -> dict[str, int]: ...


def build_state(inst: ReportSource) -> InstanceState:
    """Assemble an InstanceState from the loop's bookkeeping (no engine call: safe while
    an engine operation is in flight)."""
    now = inst.now()
    est = inst.est
    models: dict[str, ModelState] = {}
    new_tokens = {name: est.queue_new_tokens(name) for name in inst.models}
    waits = est.waits_s(new_tokens)
    for name in inst.models:
        rates = inst.rates.models[name]
        queue = inst.calls.queues[name]
        running = [p for p in inst.calls.running.values() if p.call.model == name]
        running_tokens = 0
        for p in running:
            prompt_left = est.new_tokens(p.call) if p.usage is None else 0
            running_tokens += prompt_left + max(0, int(p.expected_out) - p.out_tokens)
        models[name] = ModelState(
            name=name,
            residency=inst.residency.get(name, Residency.ABSENT),
            queued_calls=len(queue),
            queued_tokens=sum(new_tokens[name]),
            running_calls=len(running),
            running_tokens=running_tokens,
            wait_s=waits[name],
            prefill_tokens_per_s=rates.prefill_tokens_per_s.value,
            decode_step_s=rates.decode_step_s.value,
            switch_host_s=rates.switch_host_s.value,
            switch_staged_s=rates.switch_staged_s.value,
            kv_restore_bytes_per_s=inst.rates.kv_offload_bytes_per_s.value,
            kv_bytes_per_token=int(round(inst.rates.kv_bytes_per_token[name])),
            kv_capacity_tokens=inst.kv_capacity_tokens.get(name, 0),
        )
    report = inst.sessions.report
    report.sync()  # only the sessions changed since the last report are recomputed
    book = inst.sessions.reservations
    model = inst.active_model
    return InstanceState(
        instance_id=inst.instance_id,
        now=now,
        healthy=inst.healthy,
        active_model=model,
        models=models,
        sessions=dict(report.entries),
        total_kv_blocks=inst.stats.num_total_blocks,
        free_kv_blocks=inst.stats.num_free_blocks,
        reserved_kv_blocks=book.pinned_blocks(model) if model is not None else 0,
        block_size=inst.stats.block_size,
        switches=inst.counters["switches"],
        kv_restored_bytes=int(inst.rates.kv_restored_bytes),
        kv_offloaded_bytes=inst.rates.kv_offloaded_bytes,
        kv_demotions=inst.counters.get("kv_demotions", 0),
        staging_lends=inst.counters.get("staging_lends", 0),
    )
