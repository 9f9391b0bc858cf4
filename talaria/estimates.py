"""Time and size estimates the admission loop and its policies decide with.

All seconds come from the instance's RateBook (learned from what engine ops reported), so the
same code is right live and in simulation; unknown rates make the work they price free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.interface import Residency
from talaria.call_handle import CallHandle
from talaria.policies.reservations import Reservation
from talaria.policies.session_prefill import SPCandidate
from talaria.protocol import CallRequest, CallUsage
from talaria.rates import Ewma

if TYPE_CHECKING:
    from talaria.admission import Instance

__all__ = ["PendingCall", "Estimator"]


@dataclass
class PendingCall:
    """A call inside the instance, queued (``admitted`` None) or running."""

    call: CallRequest
    handle: CallHandle
    arrived: float
    continuation: bool  # its session has finished a call of this model here before
    need_blocks: int = 0  # KV blocks it may hold at most (prompt + max_tokens)
    admitted: float | None = None
    sp: bool = False  # admitted by session-prefill after its slot closed
    out_tokens: int = 0
    expected_out: float = 0.0
    usage: CallUsage | None = None


class Estimator:
    def __init__(self, instance: Instance) -> None:
        self.inst = instance
        self.output_tokens = Ewma(instance.policy.gap_ewma_alpha)

    # sizes ------------------------------------------------------------------------------

    def blocks_for(self, call: CallRequest) -> int:
        block = max(1, self.inst.stats.block_size)
        return math.ceil((len(call.prompt_token_ids) + call.params.max_tokens) / block)

    def observe_output(self, tokens: int) -> None:
        self.output_tokens.update(float(tokens))

    def expected_output(self, call: CallRequest) -> float:
        hist = self.inst.gaps.get(call.session_id)
        if hist is not None and hist.output_tokens is not None:
            guess = hist.output_tokens
        elif self.output_tokens.known:
            guess = self.output_tokens.value
        else:
            guess = float(call.params.max_tokens)
        return max(1.0, min(float(call.params.max_tokens), guess))

    def new_tokens(self, call: CallRequest) -> int:
        """Prompt tokens the engine will have to prefill (beyond the session's device KV)."""
        hist = self.inst.gaps.get(call.session_id)
        cached = 0
        if hist is not None and hist.model == self.inst.active_model:
            cached = min(self.inst.kv_tokens.get(call.session_id, (0, 0))[0], hist.last_tokens)
        return max(0, len(call.prompt_token_ids) - cached)

    # times ------------------------------------------------------------------------------

    def service_s(self, call: CallRequest) -> float:
        rates = self.inst.rates.models[call.model]
        decode = self.expected_output(call) * rates.decode_step_s.value
        return rates.prefill_s(self.new_tokens(call)) + decode

    def queue_service_s(self, model: str) -> float:
        """A batch of the model's queued calls: their prefills, then the longest decode."""
        rates = self.inst.rates.models[model]
        queue = self.inst.queues[model]
        if not queue:
            return 0.0
        prefill = sum(rates.prefill_s(self.new_tokens(p.call)) for p in queue)
        decode = max(self.expected_output(p.call) for p in queue) * rates.decode_step_s.value
        return prefill + decode

    def slot_s(self, model: str) -> float:
        return min(self.inst.policy.slot_quantum_s, self.queue_service_s(model))

    def drain_left_s(self) -> float:
        """Until the calls in flight finish."""
        model = self.inst.active_model
        if model is None or not self.inst.running:
            return 0.0
        rates = self.inst.rates.models[model]
        left = 0.0
        for p in self.inst.running.values():
            prefill = rates.prefill_s(self.new_tokens(p.call)) if p.usage is None else 0.0
            steps = max(1.0, p.expected_out - p.out_tokens)
            left = max(left, prefill + steps * rates.decode_step_s.value)
        return left

    def switch_s(self, model: str) -> float:
        staged = self.inst.residency.get(model) in (Residency.STAGED, Residency.STAGING)
        return self.inst.rates.models[model].switch_s(staged)

    def switch_back_s(self, model: str) -> float:
        """The switch back to ``model`` after a round: D2D when staging is on."""
        return self.inst.rates.models[model].switch_s(self.inst.policy.d2d_staging)

    def round_wait_s(self, model: str) -> float:
        """The other models' slots (with their switches) a call of ``model`` waits for if
        ``model``'s slot ends now."""
        return sum(
            self.switch_s(m) + self.slot_s(m)
            for m in self.inst.models
            if m != model and self.inst.queues[m]
        )

    def current_left_s(self) -> float:
        slot = self.inst.slot
        left = self.drain_left_s()
        if slot is not None and slot.open:
            quantum_left = max(0.0, slot.opened + slot.quantum_s - self.inst.now())
            left += min(quantum_left, self.queue_service_s(slot.model))
        return left

    def wait_s(self, model: str) -> float:
        slot = self.inst.slot
        return self.inst.rounds.wait_s(
            self.inst.active_model,
            model,
            current_open=slot is not None and slot.open and slot.model == model,
            current_left_s=self.current_left_s(),
            has_work=lambda m: bool(self.inst.queues[m]),
            slot_s=self.slot_s,
            switch_s=self.switch_s,
        )

    def rebuild_s(self, session_id: str, model: str) -> float:
        """What the session's KV costs to rebuild after a switch away and back."""
        hist = self.inst.gaps.get(session_id)
        tokens = hist.last_tokens if hist is not None else 0
        if self.inst.policy.host_kv:
            return self.inst.rates.restore_s(tokens)
        return self.inst.rates.models[model].prefill_s(tokens)

    # session-prefill candidates ---------------------------------------------------------

    def sp_candidate_queued(self, pending: PendingCall) -> SPCandidate:
        call = pending.call
        return SPCandidate(
            session_id=call.session_id,
            arrival=self.inst.now(),
            service_s=self.service_s(call),
            rebuild_s=self.rebuild_s(call.session_id, call.model),
            queued=True,
        )

    def sp_candidate_reserved(self, res: Reservation) -> SPCandidate:
        rates = self.inst.rates.models[res.model]
        hist = self.inst.gaps.get(res.session_id)
        new = hist.new_tokens if hist is not None and hist.new_tokens is not None else 0.0
        if hist is not None and hist.output_tokens is not None:
            out = hist.output_tokens
        else:
            out = self.output_tokens.value
        service = rates.prefill_s(int(new)) + out * rates.decode_step_s.value
        return SPCandidate(
            session_id=res.session_id,
            arrival=max(self.inst.now(), res.expected_return),
            service_s=service,
            rebuild_s=self.rebuild_s(res.session_id, res.model),
            queued=False,
        )
