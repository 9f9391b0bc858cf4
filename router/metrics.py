"""Router metrics in the Prometheus text exposition format (written by hand; no dependency).

Counters and histograms are updated by :class:`~router.core.RouterCore`; instance gauges
(residency, switches, reservations, KV bytes, KV demotions, staging lends) are rendered from
the last reported states.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from talaria.protocol import CallUsage, InstanceState, Residency

Labels = tuple[tuple[str, str], ...]

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
SCT_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0)


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


@dataclass
class Counter:
    name: str
    help: str
    values: dict[Labels, float] = field(default_factory=dict)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        lines += [f"{self.name}{_labels(k)} {_num(v)}" for k, v in sorted(self.values.items())]
        return lines


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    series: dict[Labels, tuple[list[int], list[float]]] = field(default_factory=dict)

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        counts, totals = self.series.setdefault(key, ([0] * (len(self.buckets) + 1), [0.0]))
        counts[bisect.bisect_left(self.buckets, value)] += 1
        totals[0] += value

    def count(self, **labels: str) -> int:
        entry = self.series.get(tuple(sorted(labels.items())))
        return sum(entry[0]) if entry else 0

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for key, (counts, totals) in sorted(self.series.items()):
            cumulative = 0
            for bound, n in zip((*self.buckets, float("inf")), counts, strict=True):
                cumulative += n
                lines.append(f"{self.name}_bucket{_labels((*key, ('le', _num(bound))))} {cumulative}")
            lines.append(f"{self.name}_sum{_labels(key)} {_num(totals[0])}")
            lines.append(f"{self.name}_count{_labels(key)} {cumulative}")
        return lines


class RouterMetrics:
    def __init__(self) -> None:
        self.requests = Counter("talaria_router_requests_total", "Calls by model, instance and outcome (ok, error, aborted, client_left, rejected, overloaded; a stop string's end is ok).")
        self.prompt_tokens = Counter("talaria_router_prompt_tokens_total", "Prompt tokens of finished calls.")
        self.cached_tokens = Counter("talaria_router_cached_tokens_total", "Prompt tokens served from cache (device or host).")
        self.completion_tokens = Counter("talaria_router_completion_tokens_total", "Generated tokens.")
        self.retries = Counter("talaria_router_retries_total", "Calls retried on another instance before the first token.")
        self.placements = Counter("talaria_router_placements_total", "Calls placed, by instance and whether it was the session's previous instance.")
        self.call_failures = Counter("talaria_router_call_failures_total", "Calls an instance failed, by instance and kind (unreachable, unavailable, deadline; marked_down: cut from an instance marked down; shutdown: cut by the router's shut-down past its drain; instance_shutdown: ended by its instance's own shut-down, and re-placed when it had no event yet, not a failure of the instance).")
        self.rejected = Counter("talaria_router_rejected_total", "Requests refused before placement as the client's error, by model and reason (kv_capacity, context_length: the call cannot fit; prompt_bytes: its text is too long to fit the context at any tokenization).")
        self.ttft = Histogram("talaria_router_ttft_seconds", "Time to first token seen by the router.", TTFT_BUCKETS)
        self.call_time = Histogram("talaria_router_call_seconds", "Call duration seen by the router.", SCT_BUCKETS)
        self.sct = Histogram("talaria_router_session_completion_seconds", "Session completion time (first call sent to last call done).", SCT_BUCKETS)

    def count_usage(self, model: str, usage: CallUsage | None, prompt: int, outputs: int) -> int:
        """A finished call's tokens: its instance's ``usage`` when it reported one, else its
        ``prompt`` and the ``outputs`` received. Returns its completion tokens."""
        self.prompt_tokens.inc(usage.prompt_tokens if usage else prompt, model=model)
        completion = usage.completion_tokens if usage else outputs
        self.completion_tokens.inc(completion, model=model)
        if usage:
            self.cached_tokens.inc(usage.cached_tokens, model=model)
        return completion

    def render(self, states: Mapping[str, InstanceState], healthy: set[str], sessions: int,
               instances: Iterable[str] = (), calls_in_flight: tuple[int, int] | None = None) -> str:
        """``instances``: every configured instance, so one that never reported has its
        health gauge (0) too, not none. ``calls_in_flight``: the calls inside the router now
        and its cap (beyond it a call gets 429)."""
        lines: list[str] = []
        for metric in (self.requests, self.prompt_tokens, self.cached_tokens, self.completion_tokens,
                       self.retries, self.placements, self.call_failures, self.rejected):
            lines += metric.render()
        for hist in (self.ttft, self.call_time, self.sct):
            lines += hist.render()
        lines += _gauge("talaria_router_sessions", "Sessions in the router's table.", [((), sessions)])
        if calls_in_flight is not None:
            lines += _gauge("talaria_router_calls_in_flight", "Calls inside the router now (tokenizing, waiting or streaming).",
                            [((), calls_in_flight[0])])
            lines += _gauge("talaria_router_max_calls_in_flight", "The router's cap on calls in flight (beyond it: 429).",
                            [((), calls_in_flight[1])])
        ids = sorted(set(states) | healthy | set(instances))
        lines += _gauge("talaria_instance_healthy", "1 if the instance is healthy.",
                        [((("instance", i),), 1 if i in healthy else 0) for i in ids])
        residency = [
            ((("instance", i), ("model", m), ("residency", r.value)), 1 if ms.residency == r else 0)
            for i, st in sorted(states.items()) for m, ms in sorted(st.models.items()) for r in Residency
        ]
        lines += _gauge("talaria_instance_model_residency", "1 where the model's weights are.", residency)
        per = sorted(states.items())
        lines += _gauge("talaria_instance_switches", "Model switches reported by the instance.",
                        [((("instance", i),), st.switches) for i, st in per])
        lines += _gauge("talaria_instance_reservations", "Sessions holding a live soft reservation.",
                        [((("instance", i),), sum(1 for s in st.sessions.values() if s.reserved_until is not None)) for i, st in per])
        lines += _gauge("talaria_instance_reserved_kv_blocks", "KV blocks held by reservations.",
                        [((("instance", i),), st.reserved_kv_blocks) for i, st in per])
        lines += _gauge("talaria_instance_free_kv_blocks", "Free KV blocks.",
                        [((("instance", i),), st.free_kv_blocks) for i, st in per])
        lines += _gauge("talaria_instance_kv_restored_bytes", "KV bytes restored from the host store.",
                        [((("instance", i),), st.kv_restored_bytes) for i, st in per])
        lines += _gauge("talaria_instance_kv_offloaded_bytes", "KV bytes offloaded to the host store.",
                        [((("instance", i),), st.kv_offloaded_bytes) for i, st in per])
        lines += _gauge("talaria_instance_kv_demotions", "Sessions' KV copied to host under KV pressure.",
                        [((("instance", i),), st.kv_demotions) for i, st in per])
        lines += _gauge("talaria_instance_staging_lends",
                        "Slots that lent the staging region to the KV cache.",
                        [((("instance", i),), st.staging_lends) for i, st in per])
        return "\n".join(lines) + "\n"


def _gauge(name: str, help_text: str, samples: list[tuple[Labels, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
    lines += [f"{name}{_labels(k)} {_num(v)}" for k, v in samples]
    return lines
