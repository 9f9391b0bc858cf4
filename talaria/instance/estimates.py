"""Time and size estimates the admission loop and its policies decide with.

All seconds come from the instance's RateBook (learned from what engine ops reported), so the
same code is right live and in simulation; unknown rates make the work they price free.
``Estimator`` satisfies ``talaria.policies.view.Estimates``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from engine.interface import Residency
from talaria.instance.calls import CallBook
from talaria.instance.rates import Ewma, RateBook
from talaria.instance.sessions import SessionKeeper
from talaria.policies.reservations import Reservation
from talaria.policies.view import InstanceView
from talaria.protocol import CallRequest

__all__ = ["Estimator", "blocks_for"]


def blocks_for(call: CallRequest, output_tokens: float, block_size: int) -> int:
    """KV blocks a call holds with its prompt and ``output_tokens`` of answer."""
    return math.ceil((len(call.prompt_token_ids) + output_tokens) / max(1, block_size))


class Estimator:
    def __init__(
        self, view: InstanceView, calls: CallBook, sessions: SessionKeeper, rates: RateBook
    ) -> None:
        self.view = view
        self.calls = calls
        self.sessions = sessions
        self.rates = rates
        self.output_tokens = Ewma(view.policy.gap_ewma_alpha)

    # sizes ------------------------------------------------------------------------------

    def observe_output(self, tokens: int) -> None:
        self.output_tokens.update(float(tokens))

    def expected_output(self, call: CallRequest) -> float:
        """The answer ``call`` is expected to give: its session's last answers here, else the
        instance's recent answers, else the policy's prior; never more than ``max_tokens``.
        Nothing here knows an answer's length before it ends."""
        return self.expected_outputs((call,))[0]

    def expected_outputs(self, calls: Iterable[CallRequest]) -> list[float]:
        """``expected_output`` of each call (a report prices every queue at every poll)."""
        history, out = self.sessions.gaps.sessions.get, []
        fallback: float | None = None  # the instance's recent answers, else the prior
        for call in calls:
            hist = history(call.session_id)
            if hist is not None and hist.output_tokens is not None:
                guess = hist.output_tokens
            else:
                if fallback is None:
                    fallback = (self.output_tokens.value if self.output_tokens.known
                                else float(self.view.policy.output_prior_tokens))
                guess = fallback
            out.append(max(1.0, min(float(call.params.max_tokens), guess)))
        return out

    def new_tokens(self, call: CallRequest) -> int:
        """Prompt tokens the engine will have to prefill (beyond the session's device KV)."""
        return self.new_tokens_of((call,))[0]

    def new_tokens_of(self, calls: Iterable[CallRequest]) -> list[int]:
        """``new_tokens`` of each call (a report prices every queue at every poll)."""
        history, device_kv = self.sessions.gaps.sessions.get, self.sessions.kv_tokens.get
        active, out = self.view.active_model, []
        for call in calls:
            hist = history(call.session_id)
            cached = 0
            if hist is not None and hist.model == active:
                cached = min(device_kv(call.session_id, (0, 0))[0], hist.last_tokens)
            out.append(max(0, len(call.prompt_token_ids) - cached))
        return out

    # times ------------------------------------------------------------------------------

    def service_s(self, call: CallRequest) -> float:
        rates = self.rates.models[call.model]
        decode = self.expected_output(call) * rates.decode_step_s.value
        return rates.prefill_s(self.new_tokens(call)) + decode

    def reserved_service_s(self, reservation: Reservation) -> float:
        rates = self.rates.models[reservation.model]
        hist = self.sessions.gaps.get(reservation.session_id)
        new = hist.new_tokens if hist is not None and hist.new_tokens is not None else 0.0
        if hist is not None and hist.output_tokens is not None:
            out = hist.output_tokens
        else:
            out = self.output_tokens.value
        return rates.prefill_s(int(new)) + out * rates.decode_step_s.value

    def queue_new_tokens(self, model: str) -> list[int]:
        """``new_tokens`` of each of the model's queued calls, in queue order."""
        return self.new_tokens_of([p.call for p in self.calls.queues[model]])

    def queue_service_s(self, model: str, new_tokens: list[int] | None = None) -> float:
        """A batch of the model's queued calls: their prefills, then the longest decode
        (``new_tokens``: ``queue_new_tokens(model)``, when the caller has it already)."""
        rates = self.rates.models[model]
        queue = self.calls.queues[model]
        if not queue:
            return 0.0
        if new_tokens is None:
            new_tokens = self.queue_new_tokens(model)
        prefill = sum(map(rates.prefill_s, new_tokens))
        decode = max(self.expected_outputs([p.call for p in queue])) * rates.decode_step_s.value
        return prefill + decode

    def slot_s(self, model: str) -> float:
        return min(self.view.policy.slot_quantum_s, self.queue_service_s(model))

    def drain_left_s(self) -> float:
        model = self.view.active_model
        if model is None or not self.calls.running:
            return 0.0
        rates = self.rates.models[model]
        left = 0.0
        for p in self.calls.running.values():
            prefill = rates.prefill_s(self.new_tokens(p.call)) if p.usage is None else 0.0
            steps = max(1.0, p.expected_out - p.out_tokens)
            left = max(left, prefill + steps * rates.decode_step_s.value)
        return left

    def switch_s(self, model: str) -> float:
        staged = self.view.residency.get(model) in (Residency.STAGED, Residency.STAGING)
        return self.rates.models[model].switch_s(staged)

    def switch_back_s(self, model: str) -> float:
        """The switch back to ``model`` after a round: D2D when staging is on."""
        return self.rates.models[model].switch_s(self.view.policy.d2d_staging)

    def round_wait_s(self, model: str) -> float:
        return sum(
            self.switch_s(m) + self.slot_s(m)
            for m in self.view.models
            if m != model and self.calls.queues[m]
        )

    def current_left_s(self, queue_service_s: Callable[[str], float] | None = None) -> float:
        """Until the open slot's calls end: what is in flight, then its queue within its
        quantum (``queue_service_s``: a model's queue's price, this estimator's own
        ``queue_service_s`` unless a report passes the prices it already has)."""
        slot = self.view.slot
        left = self.drain_left_s()
        if slot is not None and slot.open:
            quantum_left = max(0.0, slot.opened + slot.quantum_s - self.view.now())
            left += min(quantum_left, (queue_service_s or self.queue_service_s)(slot.model))
        return left

    def wait_s(self, model: str) -> float:
        """Until ``model``'s slot opens (the round scheduler's estimate)."""
        return self._wait_s(model, self.current_left_s(), self.slot_s)

    def waits_s(self, new_tokens: dict[str, list[int]] | None = None) -> dict[str, float]:
        """``wait_s`` of every model, for a report: each queue priced once, not once for
        every model that waits behind it (``new_tokens``: ``queue_new_tokens`` of each
        model, when the report has them already)."""
        new_tokens = new_tokens or {}
        priced = {m: self.queue_service_s(m, new_tokens.get(m)) for m in self.view.models}
        quantum = self.view.policy.slot_quantum_s
        left = self.current_left_s(priced.__getitem__)
        return {m: self._wait_s(m, left, lambda x: min(quantum, priced[x]))
                for m in self.view.models}

    def _wait_s(self, model: str, current_left_s: float, slot_s: Callable[[str], float]) -> float:
        slot = self.view.slot
        return self.view.rounds.wait_s(
            self.view.active_model,
            model,
            current_open=slot is not None and slot.open and slot.model == model,
            current_left_s=current_left_s,
            has_work=self.calls.has_queued,
            slot_s=slot_s,
            switch_s=self.switch_s,
        )

    def rebuild_s(self, session_id: str, model: str) -> float:
        hist = self.sessions.gaps.get(session_id)
        tokens = hist.last_tokens if hist is not None else 0
        if self.view.policy.host_kv:
            return self.rates.restore_s(model, tokens)
        return self.rates.models[model].prefill_s(tokens)
