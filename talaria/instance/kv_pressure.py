"""What the admission loop does when a model's queued calls need more KV than it has.

Both answers are gated on the same measure: the blocks the calls queued for a model need
(``blocks_for``: each call's prompt and all of its output).

- KV demotion (after each engine step, ``demotion_due``): the sessions whose calls ended in
  the step have their new KV copied to host, the blocks not there yet. The device blocks stay
  where they are, pinned by a reservation or cached; when they are given up, nothing is lost,
  and a switch out has only what was computed since to copy.
- Lending the staging region (at each switch, ``lend_staging_due``): the incoming model's
  KV cache spans the staging region for its slot, and nothing is staged meanwhile. A slot
  that meets the pressure after it opened (its calls arrived after the switch) admits
  nothing more until its calls in flight end, then lends (``lend_in_slot``): the lent view
  lays the KV cache out anew, so it cannot change under running calls.

Who owns what: the loop tells this object which sessions' calls ended (``call_ended``) and
when a step or a switch happens; this object calls the executor, keeps the sessions' KV
locations current after a copy and counts what it did. It never touches the engine while an
operation is in flight (it is called only between the loop's awaited operations).
"""

from __future__ import annotations

import structlog

from engine.interface import EngineStats
from talaria.instance.calls import CallBook, PendingCall
from talaria.instance.executor import EngineExecutor
from talaria.instance.sessions import SessionKeeper
from talaria.policies.config import PolicyConfig
from talaria.policies.reservations import demotion_due
from talaria.policies.staging import lend_staging_due

log = structlog.get_logger("talaria.admission")

__all__ = ["KVPressure"]


class KVPressure:
    def __init__(
        self,
        instance_id: str,
        policy: PolicyConfig,
        executor: EngineExecutor,
        calls: CallBook,
        sessions: SessionKeeper,
        counters: dict[str, int],
    ) -> None:
        self.instance_id = instance_id
        self.policy = policy
        self.executor = executor
        self.calls = calls
        self.sessions = sessions
        self.counters = counters
        self.ended: list[str] = []  # sessions whose call ended this step (demotion candidates)

    def queued_blocks(self, model: str) -> int:
        return sum(p.need_blocks for p in self.calls.waiting(model))

    def call_ended(self, pending: PendingCall) -> None:
        """A call ended normally: its session's KV may be demoted after this step (never a
        last call's, never without host KV)."""
        if self.policy.kv_demotion and self.policy.host_kv and not pending.call.last_call:
            self.ended.append(pending.call.session_id)

    async def demote(self, model: str | None, stats: EngineStats) -> EngineStats | None:
        """After a step (``stats`` read after it): demote the KV of the sessions whose calls
        ended when ``demotion_due``. Returns the engine's stats after a copy, None without."""
        sessions, self.ended = sorted(set(self.ended)), []
        if model is None or not sessions:
            return None
        # a copy to host frees no device block: the step's stats still hold
        if not demotion_due(self.queued_blocks(model), stats.num_free_blocks):
            return None
        report = await self.executor.offload_kv(sessions)
        self.counters["kv_demotions"] = self.counters.get("kv_demotions", 0) + len(sessions)
        for session_id in sessions:
            self.sessions.kv_tokens[session_id] = self.executor.session_kv_tokens(session_id)
        log.debug("kv_demoted", instance=self.instance_id, sessions=len(sessions),
                  bytes=report.bytes)
        return self.executor.stats()  # the host store's use moved

    def lend_staging(self, model: str) -> bool:
        """Whether ``model``'s slot borrows the staging region for its KV cache
        (``lend_staging_due``; needs D2D staging, so a staging region)."""
        if not (self.policy.lend_staging and self.policy.d2d_staging):
            return False
        queued = self.queued_blocks(model)
        return lend_staging_due(queued, self.executor.kv_capacity_blocks(model),
                                self.executor.kv_capacity_blocks(model, lent=True))

    def lend_in_slot_due(self, model: str, lent: bool) -> bool:
        """Whether the open slot of the active ``model`` meets KV pressure it did not meet
        when it opened (``lend_staging`` on its queued calls; ``lent``: already lent)."""
        return not lent and self.lend_staging(model)

    async def lend_in_slot(self, model: str) -> None:
        """Lend the staging region to the active ``model``'s KV cache inside its slot. The
        loop calls it with no call in flight (the re-viewed cache drops device KV): the
        sessions' KV goes to host first and comes back by restore, as after a switch."""
        if self.policy.host_kv:
            await self.executor.offload_kv(None)
        await self.executor.activate(model, lend_staging=True)
        self.lent()
        self.counters["slot_lends"] = self.counters.get("slot_lends", 0) + 1
        log.info("slot_lend", instance=self.instance_id, model=model)

    def lent(self) -> None:
        """A switch lent the staging region (counted once the activation succeeded)."""
        self.counters["staging_lends"] = self.counters.get("staging_lends", 0) + 1
