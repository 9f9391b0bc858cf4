"""Instance health from call outcomes, beside the polls of ``router.instances.health``.

An instance that cannot be reached (no process, a connection that breaks) is down at once,
and its polls say when it is back: a restarted process is re-added at its first answer.
Other failures (an error status, a malformed stream, a first-token or stall deadline missed)
count; ``failures_to_down`` in a row start a cooldown, during which a healthy poll does not
bring the instance back. Failures during a cooldown belong to the same episode. After it the
instance is on probation: one more failure starts the next cooldown, twice as long; a call
that finishes well clears everything, and so does a report from another process (its epoch
changed: the instance restarted, and the failures were the old process's). So an instance that answers ``/state`` but fails every
call is not re-added at each poll, and one burst of failures costs one cooldown. (While no
instance is healthy, the router still places calls on instances cooling down whose polls
answer: ``RouterCore.suspect``.)
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
    """Consecutive call failures per instance, its cooldowns in a row, and until when it
    stays down."""

    rules: HealthRules = field(default_factory=HealthRules)
    failures: dict[str, int] = field(default_factory=dict)
    episodes: dict[str, int] = field(default_factory=dict)
    down_until: dict[str, float] = field(default_factory=dict)
    epochs: dict[str, str] = field(default_factory=dict)  # each instance's last reported

    def success(self, instance_id: str) -> None:
        self.failures.pop(instance_id, None)
        self.episodes.pop(instance_id, None)
        self.down_until.pop(instance_id, None)

    def failure(self, instance_id: str, now: float) -> bool:
        """Count a failed call; True when the instance is (still) down for a cooldown."""
        if now < self.down_until.get(instance_id, float("-inf")):
            return True  # the same episode
        n = self.failures.get(instance_id, 0) + 1
        if n < self.rules.failures_to_down:
            self.failures[instance_id] = n
            return False
        episode = self.episodes.get(instance_id, 0) + 1
        self.episodes[instance_id] = episode
        self.failures[instance_id] = self.rules.failures_to_down - 1  # probation afterwards
        cooldown = self.rules.cooldown_s * 2 ** min(episode - 1, 16)
        self.down_until[instance_id] = now + min(self.rules.max_cooldown_s, cooldown)
        return True

    def may_come_back(self, instance_id: str, now: float, epoch: str | None = None) -> bool:
        """Whether a healthy report brings the instance back: not during a cooldown, unless
        the report's ``epoch`` is another than the last one's (a restarted process: its
        record starts afresh). ``None``: a report without one, which changes nothing."""
        if epoch is not None:
            if self.epochs.setdefault(instance_id, epoch) != epoch:
                self.success(instance_id)
                self.epochs[instance_id] = epoch
        return now >= self.down_until.get(instance_id, float("-inf"))
