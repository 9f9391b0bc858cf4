"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this sample as greedy: dividing logits by less overflows float32 and
# turns the probabilities into NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    """How a request's tokens are chosen and when it stops.

    temperature below ``GREEDY_BELOW_TEMPERATURE`` (0 included) means greedy. A seed makes
    the request's sampling reproducible whatever else shares its batch (each request draws
    from its own generator). Every field is checked by type and range: a boolean is not an
    integer, a number must be finite.

    ``thinking_budget`` (None: none) caps a reasoning model's thinking: once the answer has
    thought that many tokens, ``thinking_end_ids`` are forced next (``engine.thinking_budget``).
    The thinking starts at the answer's first token when ``thinking_from_start``, else after
    the answer opens with ``thinking_start_ids`` (an answer opening otherwise is not capped);
    a budget needs end ids and one of the two.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 (or vLLM's -1) disables top-k
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # a str or None is taken too (vLLM's)
    stop_token_ids: list[int] = field(default_factory=list)  # None too
    ignore_eos: bool = False
    logprobs: bool = False
    thinking_budget: int | None = None
    thinking_start_ids: list[int] = field(default_factory=list)
    thinking_end_ids: list[int] = field(default_factory=list)
    thinking_from_start: bool = False

    def __post_init__(self) -> None:
        self._take_vllm_spellings()
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if self.seed is not None and not (
            _is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            raise ValueError(f"seed must be a 64-bit integer or None, got {self.seed!r}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        for name in ("stop_token_ids", "thinking_start_ids", "thinking_end_ids"):
            if not _is_id_list(getattr(self, name)):
                raise ValueError(f"{name} must be a list of integers >= 0")
        for name in ("ignore_eos", "logprobs", "thinking_from_start"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        self._check_thinking_budget()

    def _take_vllm_spellings(self) -> None:
        """What a script written for vLLM passes for the defaults: one stop string, ``None``
        for no stop strings or ids, ``top_k=-1`` for no top-k."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0

    def _check_thinking_budget(self) -> None:
        budget = self.thinking_budget
        if budget is None:
            return
        if not _is_int(budget) or budget < 0:
            raise ValueError(f"thinking_budget must be an integer >= 0 or None, got {budget!r}")
        if not self.thinking_end_ids:
            raise ValueError("thinking_budget needs thinking_end_ids (the tokens forced to end the thinking)")
        if not (self.thinking_from_start or self.thinking_start_ids):
            raise ValueError("thinking_budget needs thinking_start_ids or thinking_from_start "
                             "(where the thinking starts)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(t) and t >= 0 for t in value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
