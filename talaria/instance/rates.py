"""Measured (live) or modelled (sim) rates, learned from the seconds engine ops report.

An instance learns its own bandwidths and step times from what the engine says each
operation took; nothing here is a hard-coded GPU number. A rate never measured reads 0.0
(unknown), and estimates built on it treat the corresponding work as free.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.interface import MoveReport, StepResult

__all__ = ["Ewma", "ModelRates", "RateBook"]


class Ewma:
    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.value = 0.0
        self.count = 0

    def update(self, x: float) -> None:
        self.value = x if self.count == 0 else self.alpha * x + (1 - self.alpha) * self.value
        self.count += 1

    @property
    def known(self) -> bool:
        return self.count > 0


@dataclass
class ModelRates:
    prefill_tokens_per_s: Ewma
    decode_step_s: Ewma
    switch_host_s: Ewma
    switch_staged_s: Ewma

    def prefill_s(self, tokens: int) -> float:
        rate = self.prefill_tokens_per_s.value
        return tokens / rate if rate > 0 else 0.0

    def switch_s(self, staged: bool) -> float:
        if staged and self.switch_staged_s.known:
            return self.switch_staged_s.value
        return self.switch_host_s.value


class RateBook:
    """Per-model EWMAs of step and switch times, the host-KV link rate, and each model's KV
    bytes per token (a fact of the model on this rank, given by the engine, not learned)."""

    def __init__(
        self, models: list[str], alpha: float, kv_bytes_per_token: dict[str, float]
    ) -> None:
        self.alpha = alpha
        self.models = {
            m: ModelRates(Ewma(alpha), Ewma(alpha), Ewma(alpha), Ewma(alpha)) for m in models
        }
        self.kv_bytes_per_token = {m: float(kv_bytes_per_token[m]) for m in models}
        self.kv_offload_bytes_per_s = Ewma(alpha)
        self.kv_offloaded_bytes = 0
        self.kv_restored_bytes = 0.0
        self._restored_tokens_seen = 0

    def observe(self, kind: str, result: StepResult | MoveReport, model: str | None) -> None:
        if isinstance(result, StepResult):
            if model in self.models:
                self._observe_step(self.models[model], result)
            return
        if kind == "activate" and model in self.models:
            rates = self.models[model]
            if result.kind == "activate_d2d":
                rates.switch_staged_s.update(result.seconds)
            elif result.kind.startswith("activate"):
                rates.switch_host_s.update(result.seconds)
        elif kind == "offload_kv" and result.bytes > 0:
            self.kv_offloaded_bytes += result.bytes
            if result.seconds > 0:
                self.kv_offload_bytes_per_s.update(result.bytes_per_s)

    def observe_restores(self, model: str | None, restored_tokens_total: int) -> None:
        """After an engine step: the engine's count of tokens restored from the host store
        (``EngineStats.restored_tokens_total``, never decreasing); what it grew by since the
        last step was ``model``'s, the active one (only its requests ran). Every restore
        counts, whether or not its call went on to an event."""
        grown, self._restored_tokens_seen = (restored_tokens_total - self._restored_tokens_seen,
                                             restored_tokens_total)
        if grown > 0 and model in self.kv_bytes_per_token:
            self.kv_restored_bytes += grown * self.kv_bytes_per_token[model]

    def restore_s(self, model: str, tokens: int) -> float:
        """Estimated seconds to restore ``tokens`` of ``model``'s KV from the host store."""
        bps = self.kv_offload_bytes_per_s.value
        if bps <= 0:
            return 0.0
        return tokens * self.kv_bytes_per_token[model] / bps

    @staticmethod
    def _observe_step(rates: ModelRates, step: StepResult) -> None:
        steps = step.num_steps
        if step.seconds <= 0 or steps <= 0:
            return
        if step.num_prefill_tokens == 0:
            if step.num_decode_tokens > 0:
                # A simulated engine may fuse several decode-only steps into one result.
                rates.decode_step_s.update(step.seconds / steps)
            return
        # A mixed step: charge the decode part at the known decode step time.
        decode_part = rates.decode_step_s.value if step.num_decode_tokens > 0 else 0.0
        prefill_s = step.seconds - decode_part
        if prefill_s <= 0:
            prefill_s = step.seconds
        rates.prefill_tokens_per_s.update(step.num_prefill_tokens / prefill_s)
