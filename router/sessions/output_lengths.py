"""How many tokens the router expects a call to generate, learned from the calls it served.

A client's ``max_tokens`` says how much it allows, not what it will get (coding agents send
32000 to every model), so placement's load figures use each model's recent answers instead:
an exponentially weighted mean of the output tokens of its finished calls, never more than
the call's ``max_tokens``; before any, ``prior_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["OutputLengths"]

# Before a model has answered here: the order of a coding agent's answer (the shared real
# trace's calls: median 113, p90 556 output tokens; workloads/data/traces/README.md).
DEFAULT_PRIOR_TOKENS = 256.0


@dataclass
class OutputLengths:
    alpha: float = 0.2
    prior_tokens: float = DEFAULT_PRIOR_TOKENS
    _means: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if not self.prior_tokens >= 1.0:
            raise ValueError(f"prior_tokens must be >= 1, got {self.prior_tokens}")

    def observe(self, model: str, output_tokens: int) -> None:
        mean = self._means.get(model)
        self._means[model] = (float(output_tokens) if mean is None
                              else mean + self.alpha * (output_tokens - mean))

    def expected(self, model: str, max_tokens: int) -> int:
        """Output tokens to expect of a call of ``model`` allowed ``max_tokens``."""
        return max(1, min(max_tokens, round(self._means.get(model, self.prior_tokens))))
