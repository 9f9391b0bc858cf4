"""Instance health from call outcomes, beside the polls of ``router.health``.

An instance that cannot be reached at all is down at once (its polls say when it is back).
Other failures (an error status, a broken or malformed stream, a first-token or stall
deadline missed) count; ``failures_to_down`` in a row mark it down for a cooldown that
doubles while it keeps failing, during which a healthy poll does not bring it back; a call
that finishes well clears the count. So an instance that answers ``/state`` but fails every
call is not re-added at each poll.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CallHealth", "HealthRules"]


@dataclass(frozen=True)
class HealthRules:
    failures_to_down: int = 3
    cooldown_s: float = 5.0
    max_cooldown_s: float = 120.0

    def __post_init__(self) -> None:
        if self.failures_to_down < 1:
            raise ValueError(f"failures_to_down must be >= 1, got {self.failures_to_down}")
        if self.cooldown_s < 0 or self.max_cooldown_s < self.cooldown_s:
            raise ValueError("need 0 <= cooldown_s <= max_cooldown_s")


@dataclass
class CallHealth:
    """Consecutive call failures per instance, and until when each stays down."""

    rules: HealthRules = field(default_factory=HealthRules)
    failures: dict[str, int] = field(default_factory=dict)
    down_until: dict[str, float] = field(default_factory=dict)

    def success(self, instance_id: str) -> None:
        self.failures.pop(instance_id, None)
        self.down_until.pop(instance_id, None)

    def failure(self, instance_id: str, now: float) -> bool:
        """Count a failed call; True when the instance is now down for a cooldown."""
        n = self.failures.get(instance_id, 0) + 1
        self.failures[instance_id] = n
        over = n - self.rules.failures_to_down
        if over < 0:
            return False
        cooldown = min(self.rules.max_cooldown_s, self.rules.cooldown_s * 2 ** min(over, 16))
        self.down_until[instance_id] = now + cooldown
        return True

    def may_come_back(self, instance_id: str, now: float) -> bool:
        return now >= self.down_until.get(instance_id, float("-inf"))
